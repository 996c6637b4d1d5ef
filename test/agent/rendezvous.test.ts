/**
 * The rules of agent/rendezvous.ts on a scripted host (a real memory pool of
 * the tcp provider, a real inbox), one test per rule: each fails when its
 * rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { Context } from "../../src/api/context.js";
import { LocalMemory, LocalMr } from "../../src/memory/mr.js";
import type { MrPool } from "../../src/memory/pool.js";
import { peerMemory } from "../../src/memory/budget.js";
import { Bounce, BOUNCE_SLOT } from "../../src/agent/bounce.js";
import { Inbox } from "../../src/agent/inbox.js";
import { MsgType, RndvStatus, decodeMsg, newMsg, type Msg } from "../../src/agent/codec.js";
import type { CtrlMsg } from "../../src/agent/memory-protocol.js";
import type { Op } from "../../src/agent/ops.js";
import { Rendezvous } from "../../src/agent/rendezvous.js";
import { HeaderPool, type Pending } from "../../src/agent/send-lanes.js";

const EAGER = 4096;
const LARGE = BOUNCE_SLOT + 1;

function scripted(pool: MrPool, timeoutMs = 0) {
  const host = {
    failure: null as RdmaError | null,
    down: false,
    queued: [] as Pending[],
    ctrl: [] as CtrlMsg[],
    reads: [] as { op: Op; dst: LocalMr; addr: number; rkey: number }[],
    dropped: [] as Op[],
    protocolErrors: [] as string[],
    awaiting: 0,
  };
  const headers = new HeaderPool(pool, 8, () => false);
  const inbox = new Inbox({ repostRecv: () => {}, failed: () => host.failure }, 8);
  const bounce = new Bounce(pool);
  const rv = new Rendezvous(
    {
      isDown: () => host.down,
      failed: () => host.failure,
      takeHdr: () => headers.take(),
      enqueue: (p) => void host.queued.push(p),
      withdraw: (op) => {
        const mine = host.queued.filter((p) => p.op === op);
        host.queued = host.queued.filter((p) => p.op !== op);
        return mine;
      },
      dropQueued: (op, parts) => {
        for (const p of parts) if (p.hdr) headers.put(p.hdr);
        host.dropped.push(op);
      },
      watchAbort: (signal, fn) => {
        signal.addEventListener("abort", fn);
        return () => signal.removeEventListener("abort", fn);
      },
      sendCtrl: (m) => void host.ctrl.push(m),
      read: (op, dst, addr, rkey) => void host.reads.push({ op, dst, addr, rkey }),
      awaitAnswer: () => void host.awaiting++,
      protocolError: (reason) => void host.protocolErrors.push(reason),
      delivered: () => {},
    },
    pool,
    bounce,
    inbox,
    timeoutMs,
  );
  /** The announcement queued for the peer, decoded. */
  const announced = (p: Pending): Msg => {
    const a = p.hdr!.alloc;
    const m = newMsg();
    assert.equal(decodeMsg(new Uint8Array(a.buffer, a.bufOffset, a.length), p.wr.sgList![0]!.length, m), null);
    return m;
  };
  /** The lanes take the announcement for posting. */
  const post = (p: Pending): void => {
    p.op.posted = true;
    p.onPost?.();
  };
  return { rv, host, inbox, bounce, headers, announced, post };
}

async function withPool(fn: (pool: MrPool) => Promise<void>): Promise<void> {
  const ctx = await Context.open("tcp", undefined);
  try {
    await fn(ctx.pool);
  } finally {
    ctx.release();
  }
}

function bytes(pool: MrPool, n: number, fill: number): LocalMr {
  const lmr = new LocalMr(new LocalMemory(pool, pool.alloc(n)), 0, n);
  lmr.bytes.fill(fill);
  return lmr;
}

/** Settles to "pending" if `p` has not settled after the queued microtasks ran. */
async function state(p: Promise<unknown>): Promise<"pending" | "resolved" | "rejected"> {
  let s: "pending" | "resolved" | "rejected" = "pending";
  p.then(
    () => (s = "resolved"),
    () => (s = "rejected"),
  );
  for (let i = 0; i < 5; i++) await Promise.resolve();
  return s;
}

function announcement(token: number, length: number, addr = 0, rkey = 0, imm?: number) {
  return { type: MsgType.RNDV, token, length, addr, rkey, imm } as const;
}

describe("rendezvous (agent/rendezvous.ts)", () => {
  it("a sent message stays lent until the peer's RNDV_DONE; then its registration is revoked", () =>
    withPool(async (pool) => {
      const { rv, host, announced, post } = scripted(pool);
      const lmr = bytes(pool, LARGE, 7);
      const sent = rv.send(lmr, 42, EAGER);
      assert.equal(host.queued.length, 1);
      const m = announced(host.queued[0]!);
      assert.equal(m.type, MsgType.RNDV);
      assert.equal(m.a, LARGE);
      assert.equal(m.imm, 42);
      assert.equal(m.b, 1, "the immediate is flagged");
      post(host.queued[0]!);
      assert.equal(await state(sent), "pending", "not done before the peer's answer");
      assert.equal(rv.outstanding, 1);
      assert.ok(lmr.mem.inflight > 0, "the user's bytes stay pinned while lent");
      rv.onDone(m.token, RndvStatus.DELIVERED);
      await sent;
      assert.equal(rv.outstanding, 0);
      assert.equal(lmr.mem.inflight, 0, "unpinned once the peer has them");
      assert.equal(host.protocolErrors.length, 0);
      lmr.mem.release();
    }));

  it("mid sizes go through bounce memory, copied only when the announcement is posted", () =>
    withPool(async (pool) => {
      const { rv, host, bounce, announced, post } = scripted(pool);
      const lmr = bytes(pool, EAGER + 1, 9);
      const sent = rv.send(lmr, undefined, EAGER);
      const m = announced(host.queued[0]!);
      assert.equal(m.rkey, bounce.mr.rkey, "announced in the bounce memory");
      const slotBytes = (): Uint8Array => {
        const r = bounce.mr;
        return new Uint8Array(r.buffer, r.offset + (m.addr - r.addr), EAGER + 1);
      };
      assert.equal(slotBytes()[0], 0, "nothing copied while queued");
      post(host.queued[0]!);
      assert.equal(slotBytes()[EAGER], 9, "copied when posted");
      rv.onDone(m.token, RndvStatus.DELIVERED);
      await sent;
      bounce.release();
      lmr.mem.release();
    }));

  it("an abort while the announcement is queued withdraws it: nothing reaches the wire, no cancel is sent", () =>
    withPool(async (pool) => {
      const { rv, host } = scripted(pool);
      const lmr = bytes(pool, LARGE, 1);
      const ac = new AbortController();
      const sent = rv.send(lmr, undefined, EAGER, ac.signal);
      ac.abort();
      await assert.rejects(sent, (e: RdmaError) => e.code === "ABORTED");
      assert.equal(host.queued.length, 0, "withdrawn from the lane");
      assert.equal(host.dropped.length, 1);
      assert.deepEqual(host.ctrl, [], "no RNDV_CANCEL for a message the peer never saw");
      assert.equal(rv.outstanding, 0);
      assert.equal(lmr.mem.inflight, 0);
      lmr.mem.release();
    }));

  it("an abort once posted cancels with the peer, and the peer's answer decides: cancelled rejects, delivered resolves", () =>
    withPool(async (pool) => {
      const { rv, host, announced, post } = scripted(pool);
      for (const answer of [RndvStatus.CANCELLED, RndvStatus.DELIVERED]) {
        host.queued = [];
        host.ctrl = [];
        const lmr = bytes(pool, LARGE, 1);
        const ac = new AbortController();
        const sent = rv.send(lmr, undefined, EAGER, ac.signal);
        const m = announced(host.queued[0]!);
        post(host.queued[0]!);
        ac.abort();
        assert.deepEqual(host.ctrl, [{ type: MsgType.RNDV_CANCEL, token: m.token }]);
        assert.ok(host.awaiting > 0, "the answer is awaited under the peer timeout");
        assert.equal(await state(sent), "pending", "the peer may be reading: the bytes stay lent");
        assert.ok(lmr.mem.inflight > 0);
        rv.onDone(m.token, answer);
        if (answer === RndvStatus.CANCELLED) await assert.rejects(sent, (e: RdmaError) => e.code === "ABORTED");
        else await sent;
        assert.equal(lmr.mem.inflight, 0);
        lmr.mem.release();
      }
    }));

  it("the deadline withdraws a message queued for credits (TIMEOUT), and cancels one posted", () =>
    withPool(async (pool) => {
      const { rv, host, announced, post } = scripted(pool, 20);
      // The deadline's timer does not hold the event loop (unref): this test does while it waits.
      const keep = setInterval(() => {}, 1000);
      const queued = bytes(pool, LARGE, 1);
      await assert.rejects(rv.send(queued, undefined, EAGER), (e: RdmaError) => e.code === "TIMEOUT");
      assert.deepEqual(host.ctrl, []);
      const posted = bytes(pool, LARGE, 1);
      const sent = rv.send(posted, undefined, EAGER);
      const m = announced(host.queued[host.queued.length - 1]!);
      post(host.queued[host.queued.length - 1]!);
      const deadline = Date.now() + 30_000;
      while (host.ctrl.length === 0 && Date.now() < deadline) await new Promise((r) => setImmediate(r));
      assert.deepEqual(host.ctrl, [{ type: MsgType.RNDV_CANCEL, token: m.token }]);
      rv.onDone(m.token, RndvStatus.CANCELLED);
      await assert.rejects(sent, (e: RdmaError) => e.code === "TIMEOUT");
      clearInterval(keep);
      queued.mem.release();
      posted.mem.release();
    }));

  it("an RNDV_DONE the peer had no reason to send is a protocol error", () =>
    withPool(async (pool) => {
      const { rv, host, announced, post } = scripted(pool);
      rv.onDone(12345, RndvStatus.DELIVERED);
      assert.equal(host.protocolErrors.length, 1, "unknown token");
      const lmr = bytes(pool, LARGE, 1);
      const sent = rv.send(lmr, undefined, EAGER);
      const m = announced(host.queued[0]!);
      post(host.queued[0]!);
      rv.onDone(m.token, RndvStatus.CANCELLED);
      assert.equal(host.protocolErrors.length, 2, "cancelled though never cancelled");
      rv.fail(new RdmaError("PROTOCOL", "x"));
      await assert.rejects(sent, (e: RdmaError) => e.code === "PROTOCOL");
      lmr.mem.release();
    }));

  it("a received announcement is READ into own memory and answered once (delivered), in arrival order", () =>
    withPool(async (pool) => {
      const { rv, host, inbox } = scripted(pool);
      const before = peerMemory.used;
      const ann = announcement(5, 100, 0x1000, 77, 3);
      rv.onAnnounce(ann);
      assert.equal(host.reads.length, 1);
      const rd = host.reads[0]!;
      assert.deepEqual([rd.dst.length, rd.addr, rd.rkey], [100, 0x1000, 77]);
      assert.equal(peerMemory.used, before + 100, "charged to the process-wide peer memory budget");
      rd.op.then!(true);
      assert.deepEqual(host.ctrl, [{ type: MsgType.RNDV_DONE, token: 5, status: RndvStatus.DELIVERED }]);
      const got = await inbox.receive();
      assert.equal(got.mr.length, 100);
      assert.equal(got.imm, 3);
      got.mr.mem.release();
      assert.equal(peerMemory.used, before, "the budget comes back with the memory");
    }));

  it("the peer's cancel: before the READ started it is answered at once; after, by the READ's completion; once either way", () =>
    withPool(async (pool) => {
      const { rv, host, inbox } = scripted(pool);
      const before = peerMemory.used;
      const limit = peerMemory.limit;
      peerMemory.limit = peerMemory.used; // nothing fits: announcements wait for the budget
      try {
        rv.onAnnounce(announcement(1, 10));
        assert.equal(host.reads.length, 0, "waits for the budget");
        rv.onCancel(1);
        assert.deepEqual(host.ctrl, [{ type: MsgType.RNDV_DONE, token: 1, status: RndvStatus.CANCELLED }]);
        rv.onCancel(1);
        assert.equal(host.ctrl.length, 1, "answered once");
      } finally {
        peerMemory.limit = limit;
        peerMemory.give(0);
      }
      host.ctrl = [];
      rv.onAnnounce(announcement(2, 10));
      assert.equal(host.reads.length, 1, "started");
      rv.onCancel(2);
      assert.deepEqual(host.ctrl, [], "the READ's completion answers");
      host.reads[0]!.op.then!(true);
      assert.deepEqual(host.ctrl, [{ type: MsgType.RNDV_DONE, token: 2, status: RndvStatus.CANCELLED }]);
      assert.equal(inbox.held(), 0, "a cancelled message is not delivered");
      assert.equal(peerMemory.used, before, "and its memory is freed");
    }));

  it("a failed READ frees its memory and budget; fail() rejects our messages with the cause and stops waiting reads", () =>
    withPool(async (pool) => {
      const { rv, host } = scripted(pool);
      const before = peerMemory.used;
      rv.onAnnounce(announcement(3, 64));
      host.reads[0]!.op.then!(false);
      assert.equal(peerMemory.used, before);
      const limit = peerMemory.limit;
      peerMemory.limit = peerMemory.used;
      try {
        rv.onAnnounce(announcement(4, 64));
        const lmr = bytes(pool, LARGE, 1);
        const sent = rv.send(lmr, undefined, EAGER);
        const err = new RdmaError("RETRY_EXCEEDED", "peer gone");
        host.down = true;
        rv.fail(err);
        await assert.rejects(sent, (e) => e === err);
        peerMemory.limit = limit;
        peerMemory.give(0);
        assert.equal(host.reads.length, 1, "no READ starts after the failure");
        lmr.mem.release();
      } finally {
        peerMemory.limit = limit;
      }
    }));
});
