/**
 * The rules of agent/send-lanes.ts and agent/ops.ts on a scripted host (real
 * credits), one test per rule: each fails when its rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { SendFlags, WrOpcode, type SendWr } from "../../src/transport/types.js";
import type { RemoteLease } from "../../src/memory/mr.js";
import { Credits, NEED } from "../../src/agent/credits.js";
import { OpTable, newOp, type Op } from "../../src/agent/ops.js";
import { SIGNAL_EVERY, SendLanes, type Pending } from "../../src/agent/send-lanes.js";
import { Traffic } from "../../src/agent/stats.js";

function scripted(peerDepth = 64, sendDepth = 128) {
  const host = {
    failure: null as RdmaError | null,
    posts: [] as SendWr[][],
    dropped: [] as { op: Op; err: unknown }[],
    creditsSent: 0,
  };
  const ops = new OpTable(() => {});
  const cr = new Credits(peerDepth, 64);
  const traffic = new Traffic();
  const lanes: SendLanes = new SendLanes(
    {
      get failure() {
        return host.failure;
      },
      slot: (op) => ops.slot(op),
      dropQueued: (op, _parts, err) => void host.dropped.push({ op, err }),
      // The list is lent for the call only (send-lanes.ts reuses it): keep a copy.
      post: (batch) => void host.posts.push([...batch]),
      sendCredits: () => {
        host.creditsSent++;
        lanes.enqueue(work(3, "credit"));
      },
    },
    cr,
    sendDepth,
    traffic,
  );
  return { lanes, host, cr, ops, traffic };
}

/** A work request tagged by its rkey field, in lane `credit` (0 one-sided, 1 ctrl, 2 data, 3 credit). */
function work(credit: number, tag: string, extra: Partial<Pending> = {}): Pending {
  const wr: SendWr = { wrId: 0, opcode: credit === 0 ? WrOpcode.RDMA_WRITE : WrOpcode.SEND, flags: 0, sgList: [] };
  (wr as unknown as { tag: string }).tag = tag;
  return { wr, op: newOp("msg"), credit, hdr: null, ...extra };
}

const tags = (batch: SendWr[] | undefined): string[] => (batch ?? []).map((w) => (w as unknown as { tag: string }).tag);
const turn = (): Promise<void> => new Promise((r) => setImmediate(r));

describe("send lanes (agent/send-lanes.ts)", () => {
  it("one postSend list per turn, lanes in order: credit, internal, control, data", async () => {
    const { lanes, host } = scripted();
    lanes.enqueue(work(2, "data1"));
    lanes.enqueue(work(1, "ctrl"));
    lanes.enqueue(work(0, "internal", { internal: true }));
    lanes.enqueue(work(2, "data2"));
    lanes.enqueue(work(3, "credit"));
    lanes.enqueue(work(1, "ordered", { ordered: true }));
    await turn();
    assert.equal(host.posts.length, 1, "one list");
    assert.deepEqual(tags(host.posts[0]), ["credit", "internal", "ctrl", "data1", "data2", "ordered"]);
    assert.equal(lanes.outstanding, 6);
  });

  it("nothing is posted without its credits; the internal READ lane never waits behind messages that do", async () => {
    const { lanes, host, cr, traffic } = scripted(NEED.data);
    lanes.enqueue(work(2, "data1"));
    lanes.enqueue(work(2, "data2"));
    lanes.enqueue(work(0, "read", { internal: true }));
    await turn();
    assert.deepEqual(tags(host.posts[0]), ["read", "data1"], "one data message fits the peer's receives");
    assert.equal(traffic.creditStalls, 1, "the wait for credits is counted once");
    assert.equal(cr.credits, NEED.data - 1);
    cr.returned(1);
    lanes.flush();
    assert.deepEqual(tags(host.posts[1]), ["data2"], "the next when a credit came back");
  });

  it("a stall that ends by an abort (the waiting message removed) is over: the next wait for credits counts again", async () => {
    const { lanes, host, cr, traffic } = scripted(NEED.data);
    lanes.enqueue(work(2, "data1"));
    const stuck = work(2, "data2");
    lanes.enqueue(stuck);
    await turn();
    assert.equal(traffic.creditStalls, 1);
    lanes.remove(stuck.op); // aborted while it waited: the data lane is empty, the stall is over
    lanes.enqueue(work(2, "data3")); // still no credits: a new wait
    await turn();
    assert.deepEqual(host.posts.map(tags).flat(), ["data1"]);
    assert.equal(traffic.creditStalls, 2, "the second wait is a second stall");
    cr.returned(1);
    lanes.flush();
    assert.deepEqual(host.posts.map(tags).flat(), ["data1", "data3"]);
  });

  it("never beyond the send queue's depth; the rest waits for completions", async () => {
    const { lanes, host } = scripted(64, 3);
    for (let i = 0; i < 5; i++) lanes.enqueue(work(0, `w${i}`));
    await turn();
    assert.deepEqual(tags(host.posts[0]), ["w0", "w1", "w2"]);
    lanes.outstanding -= 2; // two completed
    lanes.flush();
    assert.deepEqual(tags(host.posts[1]), ["w3", "w4"]);
  });

  it("selective signalling: the last request of each list and at least every SIGNAL_EVERY-th are signalled", async () => {
    const { lanes, host } = scripted(64, 1000);
    const n = SIGNAL_EVERY * 2 + 5;
    for (let i = 0; i < n; i++) lanes.enqueue(work(0, `w${i}`));
    await turn();
    const batch = host.posts[0]!;
    const signalled = batch.map((w, i) => ((w.flags ?? 0) & SendFlags.SIGNALED ? i : -1)).filter((i) => i >= 0);
    assert.deepEqual(signalled, [SIGNAL_EVERY - 1, 2 * SIGNAL_EVERY - 1, n - 1]);
  });

  it("a signalled completion completes every unsignalled request posted before it, in post order", async () => {
    const { lanes, host } = scripted(64, 1000);
    for (let i = 0; i < 4; i++) lanes.enqueue(work(0, `w${i}`));
    await turn();
    const ids = host.posts[0]!.map((w) => w.wrId);
    const before: number[] = [];
    for (let sid = lanes.unsignaledBefore(ids[3]!); sid >= 0; sid = lanes.unsignaledBefore(ids[3]!)) before.push(sid);
    assert.deepEqual(before, ids.slice(0, 3));
    assert.equal(lanes.unsignaledBefore(ids[3]!), -1, "nothing left");
  });

  it("a one-sided operation whose region was revoked while queued is dropped locally (REMOTE_ACCESS), never posted", async () => {
    const { lanes, host } = scripted();
    const lease = { revoked: false } as unknown as RemoteLease;
    const p = work(0, "write", { lease });
    lanes.enqueue(p);
    lanes.enqueue(work(0, "other"));
    (lease as unknown as { revoked: boolean }).revoked = true;
    await turn();
    assert.deepEqual(tags(host.posts[0]), ["other"]);
    assert.equal(host.dropped.length, 1);
    assert.equal(host.dropped[0]!.op, p.op);
    assert.equal((host.dropped[0]!.err as RdmaError).code, "REMOTE_ACCESS");
  });

  it("after a failure nothing more is posted: new work is dropped with the failure", async () => {
    const { lanes, host } = scripted();
    host.failure = new RdmaError("RETRY_EXCEEDED", "gone");
    lanes.enqueue(work(1, "pong"));
    await turn();
    assert.equal(host.posts.length, 0);
    assert.equal(host.dropped[0]!.err, host.failure);
  });

  it("remove() takes an operation out of every lane (an abort while queued); takeAll() empties them", async () => {
    const { lanes } = scripted(0);
    const a = work(2, "a");
    lanes.enqueue(a);
    lanes.enqueue({ ...work(0, "a2"), op: a.op });
    lanes.enqueue(work(1, "b"));
    assert.deepEqual(
      lanes.remove(a.op).map((p) => tags([p.wr])[0]),
      ["a2", "a"],
    );
    assert.equal(lanes.takeAll().length, 1);
    assert.equal(lanes.waiting, false);
    await turn();
  });
});

describe("operations (agent/ops.ts)", () => {
  it("wrIds come from a free list: a settled operation's id is reused", () => {
    const ops = new OpTable(() => {});
    const a = ops.slot(newOp("msg"));
    const b = ops.slot(newOp("msg"));
    assert.notEqual(a, b);
    ops.take(a);
    assert.equal(ops.slot(newOp("msg")), a);
  });

  it("an operation settles exactly once: a second completion for its id finds nothing", async () => {
    const ops = new OpTable(() => {});
    const op = newOp("write");
    const p = ops.track<void>(op, undefined);
    const id = ops.slot(op);
    const first = ops.take(id)!;
    ops.end(first).resolve?.(undefined);
    await p;
    assert.equal(ops.take(id), null, "the slot is free");
    const again = ops.end(op);
    assert.deepEqual([again.resolve, again.reject, again.then], [null, null, null], "no continuation twice");
  });

  it("an abort reaches the queue owner only while nothing was posted, and the watch ends with the operation", async () => {
    const aborted: Op[] = [];
    const ops = new OpTable((op) => aborted.push(op));
    const ac = new AbortController();
    const queued = newOp("msg");
    const posted = newOp("msg");
    const ended = newOp("msg");
    void ops.track(queued, ac.signal);
    void ops.track(posted, ac.signal);
    void ops.track(ended, ac.signal).catch(() => {});
    posted.posted = true;
    ops.end(ended);
    ac.abort();
    assert.deepEqual(aborted, [queued]);
  });

  it("drain() hands back every operation still in the table (completions that never came)", () => {
    const ops = new OpTable(() => {});
    const a = newOp("msg");
    const b = newOp("read");
    ops.slot(a);
    ops.take(ops.slot(newOp("msg")));
    ops.slot(b);
    assert.deepEqual(ops.drain(), [a, b]);
    assert.deepEqual(ops.drain(), []);
  });
});
