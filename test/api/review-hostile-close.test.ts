/**
 * Review of the delivery-across-close change (issue 19 point 14) against a
 * raw agent peer: what arrives after the peer's CLOSE is not something that
 * "arrived before the peer closed", and once receive() rejected with
 * CONNECTION_CLOSED it keeps rejecting.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaBuilder, RdmaError, type RdmaListener } from "../../src/index.js";
import type { Device } from "../../src/transport/types.js";
import { MsgType } from "../../src/agent/codec.js";
import { RawAgentPeer } from "../support/agent-peer.js";
import { PROVIDER, deviceNames, openDevice } from "../support/seam.js";
import { eventually } from "../support/api.js";

describe(`review: messages after the peer's CLOSE [${PROVIDER}]`, { timeout: 120_000 }, () => {
  let listener: RdmaListener;
  let peerDev: Device;

  before(async () => {
    const b = new RdmaBuilder().setProvider(PROVIDER).setConnectionManager("tcp");
    const [sname, pname] = deviceNames();
    if (PROVIDER === "verbs" && sname) b.setDevice(sname);
    listener = await b.bind("127.0.0.1:0");
    peerDev = await openDevice(pname);
  });

  after(async () => {
    await listener?.close();
    peerDev?.close();
  });

  it("issue 19 point 14 (review): a message the peer sends after its CLOSE is not delivered; receive() rejects CONNECTION_CLOSED and keeps rejecting", async () => {
    const accepted = listener.accept({ timeoutMs: 30_000 });
    const peer = await RawAgentPeer.connect(peerDev, listener.port, { recvDepth: 16, rndvBytes: 64 * 1024 });
    const rdma = await accepted;
    try {
      // One burst: a message, CLOSE, then a rendezvous announcement and another message after the CLOSE.
      peer.send({ type: MsgType.DATA, a: 4 }, new Uint8Array([1, 2, 3, 4]));
      peer.send({ type: MsgType.CLOSE });
      peer.send({ type: MsgType.RNDV, token: 1, a: 1000, addr: peer.rndvMr.addr, rkey: peer.rndvMr.rkey });
      peer.send({ type: MsgType.DATA, a: 4 }, new Uint8Array([9, 9, 9, 9]));
      await eventually(() => rdma.isClosed, 30_000, "the server saw the close");
      const first = await rdma.receive();
      assert.deepEqual([...first.bytes], [1, 2, 3, 4], "the message sent before the CLOSE");
      first.dispose();
      const outcomes: string[] = [];
      for (let i = 0; i < 2; i++) {
        try {
          const m = await rdma.receive();
          outcomes.push(`message [${[...m.bytes].join(",")}]`);
          m.dispose();
        } catch (e) {
          outcomes.push(e instanceof RdmaError ? e.code : String(e));
        }
      }
      assert.deepEqual(outcomes, ["CONNECTION_CLOSED", "CONNECTION_CLOSED"], "nothing sent after the CLOSE is delivered");
    } finally {
      await rdma.close();
      peer.close();
    }
  });
});
