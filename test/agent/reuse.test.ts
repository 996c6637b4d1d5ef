/**
 * Issue 21 point 1: the message path allocates nothing per message in steady
 * state, so it reuses its records: SEND work requests and their
 * scatter/gather elements (send-lanes.ts), receive work requests
 * (recv-ring.ts), eager messages' inbox records (inbox.ts), the posted list.
 * A record reused while still in use would send one message's bytes, length
 * or wrId for another, settle the wrong operation, or deliver a message
 * twice: these tests fail then.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { SendFlags, type MemoryRegion, type SendWr } from "../../src/transport/types.js";
import { LocalMemory, LocalMr } from "../../src/memory/mr.js";
import { Inbox } from "../../src/agent/inbox.js";
import { Credits, NEED } from "../../src/agent/credits.js";
import { OpTable, newOp } from "../../src/agent/ops.js";
import { SendLanes, type SendRecord } from "../../src/agent/send-lanes.js";
import { Traffic } from "../../src/agent/stats.js";
import { PROVIDER, pattern, withApiPair } from "../support/api.js";
import { rng } from "../support/rng.js";

/** A lanes host whose post() checks the list it is lent, and may run code inside the post (a re-entrant flush). */
function lanesWith(peerDepth: number, inPost: (batch: SendWr[]) => void) {
  const ops = new OpTable(() => {});
  const cr = new Credits(peerDepth, 64);
  const posted: { wrId: number; addr: number; length: number; flags: number }[][] = [];
  const lanes: SendLanes = new SendLanes(
    {
      failure: null,
      slot: (op) => ops.slot(op),
      dropQueued: () => {},
      post: (batch) => {
        posted.push(batch.map((w) => ({ wrId: w.wrId, addr: w.sgList![0]!.addr, length: w.sgList![0]!.length, flags: w.flags ?? 0 })));
        inPost(batch);
      },
      sendCredits: () => {},
    },
    cr,
    128,
    new Traffic(),
  );
  return { lanes, cr, posted };
}

/** Fills a record as Connection.send does: a header element at `addr`. */
function fill(lanes: SendLanes, addr: number): SendRecord {
  const r = lanes.record();
  const h = r.one[0]!;
  h.addr = addr;
  h.length = 24;
  h.lkey = 1;
  r.wr.sgList = r.one;
  r.wr.flags = 0;
  r.op = newOp("msg");
  r.credit = 2;
  r.hdr = null;
  return r;
}

/** A one-byte message `tag` (memory of no pool). */
function tagged(tag: number): LocalMr {
  const buffer = new ArrayBuffer(1);
  new Uint8Array(buffer)[0] = tag;
  const mr = { pd: null, buffer, offset: 0, addr: 0, length: 1, lkey: 0, rkey: 0, access: 0, deregistered: false, deregister() {} } as unknown as MemoryRegion;
  return new LocalMr(new LocalMemory(null, { mr, addr: 0, length: 1, buffer, bufOffset: 0, mrBufOffset: 0 }), 0, 1);
}

describe("issue 21 point 1: reused records never carry one message's data or wrId into another", () => {
  it("a SEND record is not handed out again while it waits in a lane or while its list is being posted; it is once posted", () => {
    let inside: SendRecord[] = [];
    let lent: SendRecord[] = [];
    const { lanes, cr, posted } = lanesWith(NEED.data, (batch) => {
      // Inside the post (where a synchronous poll may enqueue and flush again) the list's
      // records are still lent to the provider: record() must hand out others.
      assert.equal(batch.length, lent.length);
      for (let i = 0; i < 4; i++) inside.push(lanes.record());
    });
    // Only one data message has credits: the second waits in the data lane.
    const a = fill(lanes, 0x1000);
    const b = fill(lanes, 0x2000);
    lent = [a];
    lanes.enqueue(a);
    lanes.enqueue(b);
    lanes.flush();
    assert.deepEqual(posted[0]!.map((w) => w.addr), [0x1000], "one message posted, with its own element");
    for (const r of inside) assert.ok(r !== a && r !== b, "a record being posted or still queued was handed out inside the post");
    // Once its list is posted a record is free again (so the reuse is real), but not one still queued.
    const after = [lanes.record(), lanes.record(), lanes.record(), lanes.record(), lanes.record(), lanes.record()];
    assert.ok(after.includes(a), "a posted record came back to the free list");
    assert.ok(!after.includes(b), "the record still queued was handed out");
    // b is posted with its own values when credits come back, whatever was made meanwhile.
    inside = [];
    lent = [b];
    cr.returned(NEED.data);
    lanes.flush();
    const last = posted.at(-1)!;
    assert.deepEqual(last.map((w) => [w.addr, w.length]), [[0x2000, 24]], "the queued record kept its element");
    assert.ok((last[0]!.flags & SendFlags.SIGNALED) !== 0, "the list's last work request is signalled");
    assert.notEqual(last[0]!.wrId, posted[0]![0]!.wrId, "each posted work request has its own wrId while the first is outstanding");
    for (const r of inside) assert.ok(r !== b, "the record being posted was handed out inside its post");
  });

  it("an operation is reused only once it settled, and only one taken for reuse (an eager SEND without a signal)", async () => {
    const ops = new OpTable(() => {});
    const a = ops.reusableOp();
    const p = ops.track<void>(a, undefined);
    ops.reuse(a); // still in flight: refused
    const b = ops.reusableOp();
    assert.notEqual(b, a, "an operation in flight was handed out again");
    const { resolve } = ops.end(a);
    resolve?.(undefined);
    await p;
    ops.reuse(a);
    assert.equal(ops.reusableOp(), a, "a settled operation comes back (the reuse is real)");
    const c = newOp("msg"); // made for a send with a signal, or any other operation
    ops.track<void>(c, new AbortController().signal).catch(() => {});
    ops.end(c).resolve?.(undefined);
    ops.reuse(c);
    assert.notEqual(ops.reusableOp(), c, "an operation not taken for reuse was reused");
  });

  it("concurrent receives: each waiter gets its own message, in order, round after round (inbox records reused)", async () => {
    const inbox = new Inbox({ repostRecv: () => {}, failed: () => null }, 16);
    let tag = 0;
    for (let round = 0; round < 4; round++) {
      // 12 receives wait at once (both kinds), then 12 messages arrive, then 4 more wait for messages already there.
      const waits = Array.from({ length: 12 }, (_, i) => (i % 2 === 0 ? inbox.receiveMr().then((mr) => ({ mr, imm: -1 })) : inbox.receive()));
      const first = tag;
      for (let i = 0; i < 16; i++) inbox.pushMessage(tagged(++tag), i % 3 === 0 ? tag : undefined);
      const got = await Promise.all([...waits, ...Array.from({ length: 4 }, () => inbox.receive())]);
      got.forEach(({ mr, imm }, i) => {
        const t = first + i + 1;
        assert.equal(mr.bytes[0], t & 0xff, `round ${round}, receive ${i}: its own message`);
        if (imm !== -1) assert.equal(imm, (t - first - 1) % 3 === 0 ? t : undefined, `round ${round}, receive ${i}: its own immediate`);
        mr.dispose();
      });
    }
  });

  it(`many concurrent sends of random sizes, kinds and immediates, both ways at once: each arrives whole, once, in order, and each eager send settles in order [${PROVIDER}]`, () =>
    withApiPair(async ({ server, client }) => {
      const N = 1500;
      const eager = client.peerEagerThreshold;
      const plan = (seed: number) => {
        const r = rng(seed);
        return Array.from({ length: N }, (_, i) => {
          const x = r();
          // Mostly eager (0 .. eagerMax, the edge included), some rendezvous, some with an immediate.
          const size = x < 0.02 ? eager + 1 + Math.floor(r() * 3 * eager) : x < 0.05 ? eager : x < 0.1 ? 0 : Math.floor(r() * eager);
          return { size, imm: r() < 0.4 ? (i * 2654435761) >>> 0 : undefined, staged: r() < 0.5, seed: seed * 100_000 + i + 1 };
        });
      };
      const run = async (from: typeof client, to: typeof server, seed: number) => {
        const msgs = plan(seed);
        const mrs = msgs.map((m) => {
          if (m.staged || m.size === 0) return null;
          const lmr = from.allocLocalMr(m.size);
          lmr.bytes.set(pattern(m.size, m.seed));
          return lmr;
        });
        const settled: number[] = [];
        const sends = msgs.map((m, i) => {
          const data = mrs[i] ?? pattern(m.size, m.seed);
          // Some with a signal (their operations are not reused), never aborted.
          const opts = i % 7 === 0 ? { signal: new AbortController().signal } : undefined;
          const p = m.imm === undefined ? from.send(data, opts) : from.sendWithImm(data, m.imm, opts);
          return p.then(() => void settled.push(i));
        });
        for (let i = 0; i < N; i++) {
          const m = msgs[i]!;
          // Both ways of receiving (the inbox's records serve both).
          if (i % 3 === 0) {
            using got = await to.receive();
            assert.equal(got.length, m.size, `message ${i}: length`);
            assert.deepEqual(got.bytes, pattern(m.size, m.seed), `message ${i}: bytes`);
          } else {
            const { mr, imm } = await to.receiveWithImm();
            using got = mr;
            assert.equal(got.length, m.size, `message ${i}: length`);
            assert.equal(imm, m.imm, `message ${i}: immediate`);
            assert.deepEqual(got.bytes, pattern(m.size, m.seed), `message ${i}: bytes`);
          }
        }
        await Promise.all(sends);
        for (const m of mrs) m?.dispose();
        // Eager sends complete in post order: a completion settling another send's operation would break it.
        const eagerOrder = settled.filter((i) => msgs[i]!.size <= eager);
        assert.deepEqual(eagerOrder, [...eagerOrder].sort((a, b) => a - b), "eager sends settle in the order they were posted");
        assert.equal(settled.length, N, "every send settled once");
      };
      await Promise.all([run(client, server, 7), run(server, client, 11)]);
    }));
});
