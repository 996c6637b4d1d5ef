/**
 * ACK piggybacking in the tcp provider (codec.ts flag ACK), between two real
 * QPs on two devices in this process:
 *
 * (a) a WRITE ping-pong both ways completes, and almost every ACK rides on the
 *     peer's next request instead of a standalone ACK frame;
 * (b) READs and atomics from A interleaved with B's WRITEs to A, whose
 *     piggybacked ACKs acknowledge past B's READ_RESP / ATOMIC_RESP: on the
 *     QP's one stream (wire version 2) they never overtake those responses,
 *     and everything completes in order, with the right data, no protocol
 *     error, many times over (an impostor that writes the ACK first is in
 *     hostile.test.ts);
 * (c) one-directional traffic (only A sends) still completes every WR, on
 *     standalone ACKs (coalesced: one per event-loop turn, or per chunk of
 *     16 or more requests).
 *
 * The frame counts come from TcpQueuePair.stats. Provider-specific: tcp only.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import { SendFlags, WcOpcode, WcStatus, WrOpcode, wcStatusName, type AsyncEvent, type Device, type MemoryRegion, type SendWr, type WorkCompletion } from "../../src/transport/types.js";
import { tcpProvider, type TcpQpStats, type TcpQueuePair } from "../../src/transport/tcp/index.js";
import { ALL_REMOTE, bytes, makeSide, sge, waitCompletions, type Side } from "../support/seam.js";

const HOST = "127.0.0.1";

interface Pair {
  a: Side;
  b: Side;
  events: AsyncEvent[];
  close(): void;
}

const devices: Device[] = [];
after(() => {
  for (const d of devices.splice(0)) d.close();
});

async function openPair(): Promise<Pair> {
  const devA = await tcpProvider.openDevice("tcp-pb-a", { host: HOST });
  const devB = await tcpProvider.openDevice("tcp-pb-b", { host: HOST });
  devices.push(devA, devB);
  const a = makeSide(devA, { maxSendWr: 256, maxRecvWr: 256 });
  const b = makeSide(devB, { maxSendWr: 256, maxRecvWr: 256 });
  const events: AsyncEvent[] = [];
  a.qp.onEvent = b.qp.onEvent = (e) => events.push(e);
  const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
  a.qp.connect(b.qp.localEndpoint(), attr);
  b.qp.connect(a.qp.localEndpoint(), attr);
  return {
    a,
    b,
    events,
    close() {
      devA.close();
      devB.close();
    },
  };
}

async function withPair(fn: (p: Pair) => Promise<void>): Promise<void> {
  const p = await openPair();
  try {
    await fn(p);
  } finally {
    p.close();
  }
}

const stats = (s: Side): TcpQpStats => (s.qp as unknown as TcpQueuePair).stats;

function describeStats(p: Pair): string {
  return `A ${JSON.stringify(stats(p.a))}, B ${JSON.stringify(stats(p.b))}`;
}

function statuses(wcs: WorkCompletion[]): string {
  return wcs.map((c) => `${c.wrId}:${wcStatusName(c.status)}`).join(" ");
}

/** Completions of one side, sorted into receives and sends as they arrive. */
class Completions {
  readonly recvs: WorkCompletion[] = [];
  readonly sends: WorkCompletion[] = [];
  constructor(private readonly side: Side) {}

  /** Waits for the next receive completion, keeping send completions that come first. */
  async nextRecv(): Promise<WorkCompletion> {
    const start = this.recvs.length;
    while (this.recvs.length === start) this.sort(await waitCompletions(this.side, 1));
    return this.recvs[start]!;
  }

  /** Waits until `n` send completions arrived in all. */
  async sendsUpTo(n: number): Promise<WorkCompletion[]> {
    while (this.sends.length < n) this.sort(await waitCompletions(this.side, 1));
    return this.sends;
  }

  private sort(wcs: WorkCompletion[]): void {
    for (const c of wcs) (c.opcode === WcOpcode.RECV || c.opcode === WcOpcode.RECV_RDMA_WITH_IMM ? this.recvs : this.sends).push(c);
  }
}

const SLOT = 8;
const SLOTS = 64;

/** Round i's 8-byte stamp (differs per side and round). */
function stamp(side: number, i: number): Uint8Array {
  const v = new Uint8Array(SLOT);
  new DataView(v.buffer).setUint32(0, i);
  new DataView(v.buffer).setUint32(4, (side * 0x01000193) ^ (i * 0x9e3779b1));
  return v;
}

function writeImm(wrId: number, src: MemoryRegion, srcOff: number, dst: MemoryRegion, dstOff: number, imm: number): SendWr {
  return { wrId, opcode: WrOpcode.RDMA_WRITE_WITH_IMM, flags: SendFlags.SIGNALED, imm, sgList: [sge(src, srcOff, SLOT)], remoteAddr: dst.addr + dstOff, rkey: dst.rkey };
}

describe("tcp ACK piggybacking", () => {
  it("(a) a WRITE_WITH_IMM ping-pong both ways completes, and nearly every ACK rides on the peer's next request", () =>
    withPair(async (p) => {
      const N = 400;
      const { a, b } = p;
      const srcA = a.pd.registerMr(SLOT * SLOTS, ALL_REMOTE);
      const dstA = a.pd.registerMr(SLOT * SLOTS, ALL_REMOTE);
      const srcB = b.pd.registerMr(SLOT * SLOTS, ALL_REMOTE);
      const dstB = b.pd.registerMr(SLOT * SLOTS, ALL_REMOTE);
      const ca = new Completions(a);
      const cb = new Completions(b);
      const recv = (s: Side, i: number): void => s.qp.postRecv([{ wrId: 10_000 + i, sgList: [] }]);
      for (let i = 0; i < 8; i++) {
        recv(a, i);
        recv(b, i);
      }
      const before = { a: stats(a), b: stats(b) };

      const pinger = async (): Promise<void> => {
        for (let i = 0; i < N; i++) {
          const off = (i % SLOTS) * SLOT;
          bytes(srcA).set(stamp(1, i), off);
          a.qp.postSend([writeImm(i, srcA, off, dstB, off, i)]);
          const rc = await ca.nextRecv();
          recv(a, i + 8);
          assert.equal(rc.status, WcStatus.SUCCESS, `A's receive ${i}: ${wcStatusName(rc.status)}`);
          assert.equal(rc.imm, i, "B answers round i with imm i");
          assert.deepEqual(bytes(dstA).subarray(off, off + SLOT), stamp(2, i), `B's WRITE of round ${i} is in place when its immediate arrives`);
        }
      };
      const ponger = async (): Promise<void> => {
        for (let i = 0; i < N; i++) {
          const rc = await cb.nextRecv();
          recv(b, i + 8);
          assert.equal(rc.status, WcStatus.SUCCESS, `B's receive ${i}: ${wcStatusName(rc.status)}`);
          assert.equal(rc.imm, i);
          const off = (i % SLOTS) * SLOT;
          assert.deepEqual(bytes(dstB).subarray(off, off + SLOT), stamp(1, i), `A's WRITE of round ${i} is in place when its immediate arrives`);
          bytes(srcB).set(stamp(2, i), off);
          b.qp.postSend([writeImm(i, srcB, off, dstA, off, i)]);
        }
      };
      await Promise.all([pinger(), ponger()]);
      const sa = await ca.sendsUpTo(N);
      const sb = await cb.sendsUpTo(N);
      for (const [name, s] of [
        ["A", sa],
        ["B", sb],
      ] as const) {
        assert.equal(s.length, N);
        s.forEach((c, i) => {
          assert.equal(c.wrId, i, `${name}'s WRITEs complete in order`);
          assert.equal(c.status, WcStatus.SUCCESS, `${name}'s WRITE ${i}: ${wcStatusName(c.status)}`);
        });
      }
      assert.deepEqual(p.events, []);

      const requests = stats(a).requests - before.a.requests + stats(b).requests - before.b.requests;
      const standalone = stats(a).acks - before.a.acks + stats(b).acks - before.b.acks;
      const carried = stats(a).piggybackedAcks - before.a.piggybackedAcks + stats(b).piggybackedAcks - before.b.piggybackedAcks;
      assert.equal(requests, 2 * N, describeStats(p));
      // Before piggybacking every request cost a standalone ACK (2N). Now only the last ACK has nothing to ride on.
      assert.ok(standalone <= requests / 20, `${standalone} standalone ACK frames for ${requests} requests: ${describeStats(p)}`);
      assert.ok(carried >= requests - 2 * standalone - 2, `only ${carried} of ${requests} requests carried an ACK: ${describeStats(p)}`);
      assert.equal(stats(a).piggybackedAcksReceived, stats(b).piggybackedAcks, "every ACK B piggybacked reached A");
      assert.equal(stats(b).piggybackedAcksReceived, stats(a).piggybackedAcks, "every ACK A piggybacked reached B");
    }));

  it("(b) READs and atomics from A interleaved with B's WRITEs to A: piggybacked ACKs past READ_RESP/ATOMIC_RESP complete everything in order, and on one stream never overtake them (issue 21 point 2)", () =>
    withPair(async (p) => {
      const ROUNDS = 20;
      const BIG = 8 << 20;
      const { a, b } = p;
      const src = a.pd.registerMr(SLOT * 4, ALL_REMOTE);
      const landing = a.pd.registerMr(BIG + 64, ALL_REMOTE);
      const fromB = a.pd.registerMr(SLOT * 4, ALL_REMOTE);
      const big = b.pd.registerMr(BIG, ALL_REMOTE);
      const counter = b.pd.registerMr(8, ALL_REMOTE);
      const toA = b.pd.registerMr(SLOT * 4, ALL_REMOTE);
      const dstB = b.pd.registerMr(SLOT * 4, ALL_REMOTE);
      const ca = new Completions(a);
      const cb = new Completions(b);
      b.qp.postRecv(Array.from({ length: 3 * ROUNDS }, (_, i) => ({ wrId: 20_000 + i, sgList: [] })));
      let bWrites = 0;
      let held = 0;

      // B answers each of A's WRITE_WITH_IMMs with a WRITE of its own, posted as soon as the receive
      // completes: that WRITE carries B's ACK for A's requests, past the READ/atomic responses B wrote before it.
      const LAST = 99_999;
      const answering = (async (): Promise<void> => {
        for (;;) {
          const rc = await cb.nextRecv();
          assert.equal(rc.status, WcStatus.SUCCESS, `B's receive: ${wcStatusName(rc.status)}`);
          if (rc.wrId === LAST) return;
          const k = rc.imm;
          bytes(toA).set(stamp(2, k), (k % 4) * SLOT);
          b.qp.postSend([{ wrId: bWrites++, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(toA, (k % 4) * SLOT, SLOT)], remoteAddr: fromB.addr + (k % 4) * SLOT, rkey: fromB.rkey }]);
        }
      })();

      let sent = 0;
      for (let r = 0; r < ROUNDS; r++) {
        // Even rounds READ 8 MiB: its response spans several event-loop turns at A (on two streams, B's
        // piggybacked ACK overtook it). Odd rounds READ 64 KiB.
        const len = r % 2 === 0 ? BIG : 65536;
        const seed = (r * 31 + 7) & 0xff;
        const bv = bytes(big);
        for (let i = 0; i < len; i += 4096) bv[i] = (seed + i / 4096) & 0xff;
        bv[len - 1] = seed;
        const heldBefore = stats(a).piggybackedAcksHeld;
        const base = r * 100;
        // W, READ 1 MiB, W, FADD, W: the WRITEs' immediates make B write back at once.
        for (let k = 0; k < 3; k++) bytes(src).set(stamp(1, r * 3 + k), k * SLOT);
        a.qp.postSend([
          writeImm(base + 1, src, 0, dstB, 0, r * 3),
          { wrId: base + 2, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(landing, 0, len)], remoteAddr: big.addr, rkey: big.rkey },
          writeImm(base + 3, src, SLOT, dstB, SLOT, r * 3 + 1),
          { wrId: base + 4, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(landing, BIG + 8, 8)], remoteAddr: counter.addr, rkey: counter.rkey, compareAdd: 1n },
          writeImm(base + 5, src, 2 * SLOT, dstB, 2 * SLOT, r * 3 + 2),
        ]);
        sent += 5;
        const wcs = (await ca.sendsUpTo(sent)).slice(sent - 5);
        assert.equal(statuses(wcs), [1, 2, 3, 4, 5].map((k) => `${base + k}:SUCCESS`).join(" "), `round ${r}: ${describeStats(p)} ${JSON.stringify(p.events)}`);
        const lv = bytes(landing);
        for (let i = 0; i < len; i += 4096) if (lv[i] !== ((seed + i / 4096) & 0xff)) assert.fail(`round ${r}: READ byte ${i} is ${lv[i]}`);
        assert.equal(lv[len - 1], seed, `round ${r}: last READ byte`);
        assert.equal(new DataView(landing.buffer, landing.offset).getBigUint64(BIG + 8, true), BigInt(r), `round ${r}: FADD returns the count so far`);
        for (let k = 0; k < 3; k++) assert.deepEqual(bytes(dstB).subarray(k * SLOT, (k + 1) * SLOT), stamp(1, r * 3 + k), `round ${r}: A's WRITE ${k}`);
        held += stats(a).piggybackedAcksHeld - heldBefore;
      }
      // Stop the answering loop with one last WRITE_WITH_IMM, into the last receive posted.
      b.qp.postRecv([{ wrId: LAST, sgList: [] }]);
      a.qp.postSend([{ wrId: LAST, opcode: WrOpcode.RDMA_WRITE_WITH_IMM, imm: 0, sgList: [sge(src, 0, SLOT)], remoteAddr: dstB.addr, rkey: dstB.rkey }]);
      await answering;
      await cb.sendsUpTo(3 * ROUNDS);
      assert.equal(cb.sends.length, 3 * ROUNDS);
      cb.sends.forEach((c, i) => {
        assert.equal(c.wrId, i);
        assert.equal(c.status, WcStatus.SUCCESS);
      });
      assert.deepEqual(p.events, [], "no protocol error on either side");
      assert.ok(stats(a).piggybackedAcksReceived > 0, `B never piggybacked an ACK: ${describeStats(p)}`);
      // One stream keeps B's order: a piggybacked ACK never arrives before a response it acknowledges past.
      assert.equal(held, 0, `a piggybacked ACK overtook a READ/atomic response on one stream: ${describeStats(p)}`);
    }));

  for (const [name, opcode, size] of [
    ["8-byte WRITEs", WrOpcode.RDMA_WRITE, 8],
    ["64 KiB WRITEs", WrOpcode.RDMA_WRITE, 65536],
    ["8-byte SENDs", WrOpcode.SEND, 8],
  ] as const) {
    it(`(c) one-directional ${name} (B never sends): every WR completes on standalone ACKs`, () =>
      withPair(async (p) => {
        const N = size > 4096 ? 300 : 3000;
        const { a, b } = p;
        const srcA = a.pd.registerMr(size, ALL_REMOTE);
        const dstB = b.pd.registerMr(size, ALL_REMOTE);
        let posted = 0;
        let recvPosted = 0;
        const done: WorkCompletion[] = [];
        const before = stats(b);
        while (done.length < N) {
          if (opcode === WrOpcode.SEND) {
            // Keep B's receive queue ahead of A (no RNR in this test).
            const want = Math.min(N, posted + 128) - recvPosted;
            if (want > 0) b.qp.postRecv(Array.from({ length: want }, (_, i) => ({ wrId: recvPosted + i, sgList: [sge(dstB)] })));
            recvPosted += Math.max(0, want);
          }
          const room = Math.min(128 - (posted - done.length), N - posted);
          if (room > 0) {
            a.qp.postSend(
              Array.from({ length: room }, (_, i) => ({ wrId: posted + i, opcode, flags: SendFlags.SIGNALED, sgList: [sge(srcA)], remoteAddr: dstB.addr, rkey: dstB.rkey })),
            );
            posted += room;
          }
          done.push(...(await waitCompletions(a, 1)));
          if (opcode === WrOpcode.SEND) {
            let k: number;
            while ((k = b.cq.poll(b.buf)) > 0) for (let i = 0; i < k; i++) assert.equal(b.buf.status[i], WcStatus.SUCCESS);
          }
        }
        done.forEach((c, i) => {
          assert.equal(c.wrId, i, "in order");
          assert.equal(c.status, WcStatus.SUCCESS, `WR ${i}: ${wcStatusName(c.status)}`);
        });
        assert.deepEqual(p.events, []);
        const acks = stats(b).acks - before.acks;
        assert.equal(stats(b).piggybackedAcks - before.piggybackedAcks, 0, "B sent no request to carry an ACK");
        assert.equal(stats(a).piggybackedAcksReceived, 0);
        assert.ok(acks >= 1, `no standalone ACK: ${describeStats(p)}`);
        // Coalesced: one per chunk of 16 or more requests, else one per event-loop turn; fewer than WRs.
        assert.ok(size > 4096 ? acks < N : acks <= N / 4, `${acks} standalone ACKs for ${N} WRs: ${describeStats(p)}`);
      }));
  }
});
