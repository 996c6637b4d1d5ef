/**
 * The rules of agent/lifecycle.ts (issue 20: the agent in parts) on a
 * recording host: each rule a test that fails when the rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { QpState } from "../../src/transport/types.js";
import type { LocalMemory } from "../../src/memory/mr.js";
import { Lifecycle, type LifecycleHost } from "../../src/agent/lifecycle.js";
import { OpTable, newOp, type Op } from "../../src/agent/ops.js";
import type { Pending } from "../../src/agent/send-lanes.js";

/** A host whose parts record, in one log, what the lifecycle asked of them. */
function recording(opts: { outstanding?: number; recvs?: number; queued?: Pending[] } = {}) {
  const log: string[] = [];
  const ops = new OpTable(() => {});
  const dropped: { op: Op; parts: number; err: unknown }[] = [];
  let closeSent: ((ok: boolean) => void) | null = null;
  const rec = (name: string) => () => void log.push(name);
  const host: LifecycleHost = {
    qp: {
      state: QpState.RTS,
      setError: rec("qp.setError"),
      destroy: rec("qp.destroy"),
      onEvent: null,
    },
    cq: { destroy: rec("cq.destroy") },
    ops,
    lanes: { outstanding: opts.outstanding ?? 0, takeAll: () => (log.push("lanes.takeAll"), opts.queued ?? []) },
    headers: { put: rec("headers.put"), release: rec("headers.release") },
    recvs: { size: opts.recvs ?? 0, release: rec("recvs.release") },
    poller: { pollNow: rec("poller.pollNow"), armForFlush: rec("poller.armForFlush"), stop: rec("poller.stop") },
    inbox: { fail: rec("inbox.fail"), abandon: rec("inbox.abandon"), teardown: rec("inbox.teardown"), dropUnread: rec("inbox.dropUnread") },
    rndv: { fail: rec("rndv.fail"), teardown: rec("rndv.teardown"), outstanding: 0, settled: () => Promise.resolve(true as const) },
    memory: { fail: rec("memory.fail"), teardown: rec("memory.teardown") },
    live: { stop: rec("live.stop") },
    bounce: { release: rec("bounce.release") },
    dropQueued: (op, parts, err) => {
      log.push("dropQueued");
      dropped.push({ op, parts: parts.length, err });
      const { reject } = ops.end(op);
      reject?.(err);
    },
    sendClose: () => {
      log.push("sendClose");
      return new Promise<void>((resolve, reject) => (closeSent = (ok) => (ok ? resolve() : reject(new Error("flushed")))));
    },
    onClosed: rec("onClosed"),
  };
  const life = new Lifecycle(host);
  return { life, host, log, ops, dropped, answerClose: (ok: boolean) => closeSent?.(ok) };
}

const closed = (): RdmaError => new RdmaError("CONNECTION_CLOSED", "test");

/** Buffers posted to the QP and CQ (receive buffers, control headers, bounce memory) and what holds them. */
const FREES = ["recvs.release", "headers.release", "bounce.release", "inbox.teardown", "memory.teardown", "rndv.teardown"];

function assertQueuesFirst(log: string[]): void {
  const qp = log.indexOf("qp.destroy");
  const cq = log.indexOf("cq.destroy");
  assert.ok(qp >= 0 && cq >= 0, `the QP and CQ are destroyed (${log.join(", ")})`);
  for (const f of FREES) {
    const i = log.indexOf(f);
    assert.ok(i >= 0, `${f} runs`);
    assert.ok(i > qp && i > cq, `${f} runs after the QP and CQ are destroyed (${log.join(", ")})`);
  }
}

describe("connection lifecycle (agent/lifecycle.ts)", () => {
  it("issue 20: teardown destroys the QP and CQ before freeing the buffers posted to them, then tells its owner once", () => {
    const s = recording();
    s.life.fail(closed());
    assert.equal(s.life.closed, true, "nothing posted: torn down at once");
    assertQueuesFirst(s.log);
    assert.equal(s.log.filter((l) => l === "onClosed").length, 1);
    assert.ok(s.log.indexOf("onClosed") > s.log.indexOf("recvs.release"), "the owner hears of it once everything is freed");
  });

  it("issue 20: abandon (setup failed) destroys the QP and CQ before freeing, once", () => {
    const s = recording();
    s.life.abandon(closed());
    assertQueuesFirst(s.log);
    const n = s.log.length;
    s.life.abandon(closed());
    s.life.fail(closed());
    assert.equal(s.log.length, n, "a second abandon or a fail after it does nothing");
  });

  it("issue 20: fail is idempotent: the first failure is the connection's, and the parts fail once", () => {
    const s = recording({ outstanding: 1 });
    const first = new RdmaError("PROTOCOL", "first");
    s.life.fail(first);
    s.life.fail(new RdmaError("DEVICE", "second"));
    s.life.protocolError("third");
    assert.equal(s.life.failure, first);
    for (const part of ["memory.fail", "rndv.fail", "inbox.fail", "qp.setError", "lanes.takeAll"]) assert.equal(s.log.filter((l) => l === part).length, 1, `${part} once`);
    assert.equal(s.life.closed, false, "a posted work request keeps the connection until its flush completion");
    s.life.abandon(closed()); // (ends the drain deadline's timer)
  });

  it("issue 20: every operation settles once: queued work is dropped, a partly posted op waits for its completions, a lost completion is rejected at teardown", async () => {
    const unposted = newOp("msg");
    const partly = newOp("write");
    partly.posted = true;
    partly.parts = 3; // one posted, two still queued
    const lost = newOp("read");
    const queued: Pending[] = [
      { wr: { wrId: 0, opcode: 0, flags: 0, sgList: [] }, op: unposted, credit: 2, hdr: null },
      { wr: { wrId: 0, opcode: 0, flags: 0, sgList: [] }, op: partly, credit: 0, hdr: null },
      { wr: { wrId: 0, opcode: 0, flags: 0, sgList: [] }, op: partly, credit: 0, hdr: { release() {} } as unknown as LocalMemory },
    ];
    const s = recording({ outstanding: 2, queued });
    const pUnposted = s.ops.track(unposted, undefined);
    const pPartly = s.ops.track(partly, undefined);
    const pLost = s.ops.track(lost, undefined);
    s.ops.slot(partly);
    s.ops.slot(lost);
    const err = closed();
    s.life.fail(err);
    assert.deepEqual(
      s.dropped.map((d) => [d.op, d.parts]),
      [[unposted, 1]],
      "only the op none of whose work requests was posted is dropped now, with its parts",
    );
    await assert.rejects(pUnposted, (e) => e === err);
    assert.equal(partly.parts, 1, "the partly posted op waits for its one posted work request");
    assert.equal(s.log.filter((l) => l === "headers.put").length, 1, "the queued parts' headers are recycled");
    const rejected: unknown[] = [];
    pPartly.catch((e: unknown) => rejected.push(["partly", e]));
    pLost.catch((e: unknown) => rejected.push(["lost", e]));
    // The flush completions never come: the drain deadline (or a close's wait) tears down.
    s.life.abandon(err);
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(rejected, [["partly", err], ["lost", err]], "each posted op whose completion never came is rejected with the failure, once");
    assert.deepEqual(s.ops.drain(), [], "nothing left unsettled");
  });

  it("issue 20: close refuses new operations at once, sends CLOSE, and ends cleanly when it leaves", async () => {
    const s = recording();
    const closing = s.life.close(5000);
    assert.equal(s.life.closing, true);
    assert.throws(() => s.life.checkOpen("send"), (e: unknown) => e instanceof RdmaError && e.code === "CONNECTION_CLOSED");
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(s.log, ["sendClose"], "nothing torn down before the CLOSE left");
    s.answerClose(true);
    assert.equal(await closing, null);
    assert.equal(s.life.endedCleanly, true);
    assert.equal(s.life.closeFailure, null);
    assertQueuesFirst(s.log);
  });

  it("issue 20: a flushing close whose CLOSE does not leave reports why (closeFailure) and does not end cleanly", async () => {
    const s = recording();
    const closing = s.life.close(5000, true);
    await new Promise((r) => setImmediate(r));
    const cause = new RdmaError("RETRY_EXCEEDED", "the peer stopped");
    s.life.fail(cause);
    s.answerClose(false);
    const why = await closing;
    assert.ok(why instanceof RdmaError && why.code === "RETRY_EXCEEDED" && why.cause === cause);
    assert.equal(s.life.closeFailure, why);
    assert.equal(s.life.endedCleanly, false);
  });

  it("issue 20: the peer's CLOSE before any failure ends the connection cleanly, and nothing after it is delivered", () => {
    const s = recording();
    s.life.onPeerClose();
    assert.equal(s.life.peerClosed, true);
    assert.equal(s.life.endedCleanly, true);
    assert.equal(s.life.failure?.code, "CONNECTION_CLOSED");
    const t = recording();
    t.life.fail(new RdmaError("DEVICE", "first"));
    t.life.onPeerClose();
    assert.equal(t.life.endedCleanly, false, "a CLOSE after a failure does not make the end clean");
  });
});
