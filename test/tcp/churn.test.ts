/**
 * Objects released on the tcp device leave its tables: a connect/close churn
 * must not grow the device (issue 9 point 6: destroyed CQs stayed in the table).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { tcpProvider, type TcpDevice } from "../../src/transport/tcp/index.js";

describe("tcp device tables under churn", () => {
  it("5,000 CQ + QP create/destroy cycles leave no CQ, QP or key behind", async () => {
    const dev = (await tcpProvider.openDevice("tcp-churn", { host: "127.0.0.1" })) as TcpDevice;
    try {
      const pd = dev.allocPd();
      const base = { cqs: dev.cqs.size, qps: dev.qps.size, keys: dev.keys.size };
      for (let i = 0; i < 5_000; i++) {
        const cq = dev.createCq(64);
        const qp = pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 8, maxRecvWr: 8, maxSendSge: 1, maxRecvSge: 1, maxInlineData: 0, portNum: 1, access: 0 });
        const mr = pd.registerMr(64, 0);
        mr.deregister();
        qp.destroy();
        cq.destroy();
      }
      assert.deepEqual({ cqs: dev.cqs.size, qps: dev.qps.size, keys: dev.keys.size }, base);
      pd.dealloc();
    } finally {
      dev.close();
    }
  });
});
