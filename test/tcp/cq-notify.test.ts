/**
 * Completion notification on the tcp CQ (TcpCq.push), the seam contract of
 * CompletionQueue.requestNotify: the handler runs only when armed, once per
 * arm, not for completions queued before the arm, and asynchronously (never
 * inside the postSend or poll that raised the completion).
 *
 * Provider-specific: a completion made by a socket read notifies when that
 * read is handled, in its callback; one made anywhere else ("a turn later")
 * from a setImmediate.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import { executionAsyncResource } from "node:async_hooks";
import { SendFlags, WcStatus, WrOpcode, type Device, type SendWr } from "../../src/transport/types.js";
import { tcpProvider } from "../../src/transport/tcp/index.js";
import { ALL_REMOTE, makeSide, sge, waitCompletions, type Side } from "../support/seam.js";

const HOST = "127.0.0.1";
const devices: Device[] = [];
after(() => {
  for (const d of devices.splice(0)) d.close();
});

async function pair(): Promise<{ a: Side; b: Side }> {
  const devA = await tcpProvider.openDevice("tcp-cqn-a", { host: HOST });
  const devB = await tcpProvider.openDevice("tcp-cqn-b", { host: HOST });
  devices.push(devA, devB);
  const a = makeSide(devA);
  const b = makeSide(devB);
  const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
  a.qp.connect(b.qp.localEndpoint(), attr);
  b.qp.connect(a.qp.localEndpoint(), attr);
  return { a, b };
}

/** One event-loop turn (a check phase) has passed. */
const turn = (): Promise<void> => new Promise((r) => setImmediate(r));

function sends(a: Side, from: number, n: number): SendWr[] {
  const src = a.pd.registerMr(8, ALL_REMOTE);
  return Array.from({ length: n }, (_, i) => ({ wrId: from + i, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] }));
}

function recvs(b: Side, n: number): { wrId: number; sgList: ReturnType<typeof sge>[] }[] {
  const dst = b.pd.registerMr(64, ALL_REMOTE);
  return Array.from({ length: n }, (_, i) => ({ wrId: 100 + i, sgList: [sge(dst)] }));
}

function drain(s: Side): number {
  let n = 0;
  let k: number;
  while ((k = s.cq.poll(s.buf)) > 0) n += k;
  return n;
}

describe("tcp CQ notification", () => {
  it("runs only when armed, once per arm, and not for completions queued before the arm", async () => {
    const { a, b } = await pair();
    let calls = 0;
    b.cq.onNotify = () => calls++;
    b.qp.postRecv(recvs(b, 16));

    // Not armed: B's receive completion raises nothing.
    a.qp.postSend(sends(a, 1, 1));
    await waitCompletions(a, 1); // A's SEND is acknowledged, so B's receive completion is queued
    await turn();
    await turn();
    assert.equal(calls, 0, "an unarmed CQ called its handler");
    assert.equal(drain(b), 1);

    // Armed once, five completions (in one or more chunks): one call.
    b.cq.requestNotify();
    a.qp.postSend(sends(a, 2, 5));
    await waitCompletions(a, 5);
    await turn();
    await turn();
    assert.equal(calls, 1, "one call per arm");
    assert.equal(drain(b), 5);

    // Completions already queued when arming raise nothing; the next new one does.
    a.qp.postSend(sends(a, 7, 1));
    await waitCompletions(a, 1);
    b.cq.requestNotify();
    await turn();
    await turn();
    assert.equal(calls, 1, "a completion queued before the arm raised a notification");
    a.qp.postSend(sends(a, 8, 1));
    await waitCompletions(a, 1);
    await turn();
    assert.equal(calls, 2);
    assert.equal(drain(b), 2);
    b.cq.onNotify = null;
  });

  it("never runs inside postSend or poll: a completion raised there is delivered a turn later, once", async () => {
    const { a } = await pair();
    a.qp.setError();
    let calls = 0;
    let inside = false;
    let reentered = false;
    a.cq.onNotify = () => {
      if (inside) reentered = true;
      calls++;
      // From inside the handler: post again (completes at once, flushed) without re-arming.
      inside = true;
      a.qp.postSend(sends(a, 50, 1));
      a.cq.poll(a.buf, 0);
      inside = false;
    };
    a.cq.requestNotify();
    inside = true;
    a.qp.postSend(sends(a, 1, 1)); // the QP is in ERR: the WR completes (flushed) inside postSend
    a.cq.poll(a.buf, 0);
    inside = false;
    assert.equal(calls, 0, "the handler ran inside postSend");
    await turn();
    assert.equal(calls, 1);
    await turn();
    await turn();
    assert.equal(calls, 1, "not re-armed: no second call");
    assert.equal(reentered, false, "the handler was re-entered from postSend/poll");
    const n = drain(a);
    assert.equal(n, 2);
    assert.equal(a.buf.status[0], WcStatus.WR_FLUSH_ERR);
    a.cq.onNotify = null;
  });

  it("issue 21 point 1: completions made by a socket read notify from that read's callback, once for all of them (no setImmediate hop)", async () => {
    const { a, b } = await pair();
    const seen: string[] = [];
    let completions = 0;
    const notified = new Promise<void>((resolve) => {
      b.cq.onNotify = () => {
        seen.push((executionAsyncResource() as object).constructor.name);
        completions += drain(b);
        resolve();
      };
    });
    b.qp.postRecv(recvs(b, 8));
    b.cq.requestNotify();
    a.qp.postSend(sends(a, 1, 8)); // one list: one write, read by B at once
    await notified;
    await waitCompletions(a, 8);
    assert.equal(seen.length, 1, "one notification");
    assert.notEqual(seen[0], "Immediate", "the notification waited for a setImmediate instead of running in the read's callback");
    completions += drain(b);
    assert.equal(completions, 8);
    b.cq.onNotify = null;
  });
});
