/**
 * The tcp provider recycles its per-WR records (send-queue entries, receive
 * WRs: send-queue.ts, recv-queue.ts) instead of allocating them per message.
 * A record reused while it is still in use would hand one message's data,
 * length, wrId or status to another. These tests make that visible:
 *
 * (a) three QP pairs at once, each streaming rounds of SENDs (with and
 *     without immediate data, inline or from up to three SGEs), WRITEs with
 *     immediate data and READs of random sizes (0 B to 150 KiB) and random
 *     wrIds, signaled or not, while the receiver keeps few receives posted
 *     and posts the next one from its completion handler (so receive records
 *     are recycled while messages arrive, and RNR retries resend queued
 *     entries): every completion carries its own WR's wrId, opcode, length
 *     and immediate, every byte lands where its own WR said;
 * (b) a QP taken to ERR while entries are queued flushes each of them
 *     exactly once, in order, with its own wrId (unsignaled ones included),
 *     and the peer's posted receives each complete exactly once;
 * (c) a receive whose message is arriving when the QP enters ERR is flushed
 *     with its own wrId, not lost.
 *
 * Provider-specific (the recycling is the tcp provider's): tcp only.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import { SendFlags, WcOpcode, WrOpcode, wcStatusName, type Device, type MemoryRegion, type SendWr } from "../../src/transport/types.js";
import { tcpProvider } from "../../src/transport/tcp/index.js";
import { ALL_REMOTE, DEADLINE_MS, bytes, makeSide, sge, type Side } from "../support/seam.js";
import { rng } from "../support/rng.js";

const HOST = "127.0.0.1";
/** WRs per round, and receives the receiver keeps posted at most. */
const ROUND = 48;
const RECV_POSTED = 6;
const SLOT = 160 * 1024;
const SIZES = [0, 1, 3, 8, 63, 64, 95, 96, 97, 200, 1000, 4000, 8192, 8193, 20000, 70000, 150000];

const devices: Device[] = [];
after(() => {
  for (const d of devices.splice(0)) d.close();
});

interface Pair {
  a: Side;
  b: Side;
}

async function openPair(tag: string): Promise<Pair> {
  const devA = await tcpProvider.openDevice(`tcp-reuse-${tag}-a`, { host: HOST });
  const devB = await tcpProvider.openDevice(`tcp-reuse-${tag}-b`, { host: HOST });
  devices.push(devA, devB);
  const a = makeSide(devA, { maxSendWr: 128, maxRecvWr: 128, maxSendSge: 4, maxRecvSge: 4, maxInlineData: 64 });
  const b = makeSide(devB, { maxSendWr: 128, maxRecvWr: 128, maxSendSge: 4, maxRecvSge: 4, maxInlineData: 64 });
  const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
  a.qp.connect(b.qp.localEndpoint(), attr);
  b.qp.connect(a.qp.localEndpoint(), attr);
  return { a, b };
}

/** A payload byte of message `m` at `j`: any byte of another message shows up as a mismatch. */
function pattern(m: number, j: number): number {
  return (m * 131 + j * 7 + (j >>> 8) * 3 + 1) & 0xff;
}

function fillPattern(dst: Uint8Array, m: number, n: number): void {
  for (let j = 0; j < n; j++) dst[j] = pattern(m, j);
}

function firstMismatch(got: Uint8Array, m: number, n: number): number {
  for (let j = 0; j < n; j++) if (got[j] !== pattern(m, j)) return j;
  return -1;
}

interface Wc {
  wrId: number;
  status: number;
  opcode: number;
  byteLen: number;
  imm: number;
  flags: number;
}

/**
 * Drains `side`'s CQ with verbs-exact notification (arm, then poll again),
 * calling `each` per completion, until `done()` or the deadline.
 */
function drainUntil(side: Side, each: (wc: Wc) => void, done: () => boolean, what: string, ms = DEADLINE_MS * 4): Promise<void> {
  const buf = side.buf;
  const drain = (): void => {
    let k: number;
    while (!done() && (k = side.cq.poll(buf)) > 0) {
      for (let i = 0; i < k; i++) each({ wrId: buf.wrId[i]!, status: buf.status[i]!, opcode: buf.opcode[i]!, byteLen: buf.byteLen[i]!, imm: buf.imm[i]!, flags: buf.flags[i]! });
    }
  };
  return new Promise<void>((resolve, reject) => {
    const finish = (err?: Error): void => {
      clearTimeout(timer);
      side.cq.onNotify = null;
      if (err) reject(err);
      else resolve();
    };
    const timer = setTimeout(() => finish(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
    const step = (): void => {
      try {
        drain();
        if (done()) return finish();
        side.cq.requestNotify();
        drain();
        if (done()) finish();
      } catch (e) {
        finish(e as Error);
      }
    };
    side.cq.onNotify = step;
    step();
  });
}

interface Posted {
  wrId: number;
  op: number;
  len: number;
  msg: number;
  signaled: boolean;
  imm: number;
  /** READ: where in A's landing MR, and from where in B's source MR. */
  at: number;
}

/** Splits [0, len) into 1 to 3 SGEs (some empty) over `m` starting at `off`. */
function sges(m: MemoryRegion, off: number, len: number, r: () => number): { addr: number; length: number; lkey: number }[] {
  const parts = 1 + Math.floor(r() * 3);
  const out = [];
  let o = 0;
  for (let p = 0; p < parts; p++) {
    const n = p === parts - 1 ? len - o : Math.floor(r() * (len - o + 1));
    out.push(sge(m, off + o, n));
    o += n;
  }
  return out;
}

/** One pair's run: rounds of random WRs from A, B keeping few receives posted and posting from its handler. */
async function stream(tag: string, seed: number, rounds: number): Promise<void> {
  const r = rng(seed);
  const { a, b } = await openPair(tag);
  const src = a.pd.registerMr(ROUND * SLOT, ALL_REMOTE);
  const land = a.pd.registerMr(ROUND * SLOT, ALL_REMOTE);
  const rcv = b.pd.registerMr(RECV_POSTED * 2 * SLOT, ALL_REMOTE);
  const wtarget = b.pd.registerMr(ROUND * SLOT, ALL_REMOTE);
  const rsrc = b.pd.registerMr(SLOT, ALL_REMOTE);
  fillPattern(bytes(rsrc), 999_999, SLOT);
  let msg = 0;
  let wrIds = 0;
  const nextWrId = (): number => (seed % 1000) * 1_000_000_000 + ++wrIds * 1000 + Math.floor(r() * 1000);
  for (let round = 0; round < rounds; round++) {
    const posted: Posted[] = [];
    const wrs: SendWr[] = [];
    for (let i = 0; i < ROUND; i++) {
      const k = r();
      const op = k < 0.55 ? WrOpcode.SEND : k < 0.7 ? WrOpcode.SEND_WITH_IMM : k < 0.85 ? WrOpcode.RDMA_WRITE_WITH_IMM : WrOpcode.RDMA_READ;
      let len = SIZES[Math.floor(r() * SIZES.length)]!;
      if (op === WrOpcode.RDMA_READ) len = Math.min(len, SLOT);
      const m = ++msg;
      const signaled = i === ROUND - 1 || r() < 0.6;
      const imm = Math.floor(r() * 0x100000000);
      const inline = len <= 64 && op !== WrOpcode.RDMA_READ && r() < 0.6;
      const wrId = nextWrId();
      const p: Posted = { wrId, op, len, msg: m, signaled, imm, at: i * SLOT };
      posted.push(p);
      if (op === WrOpcode.RDMA_READ) {
        const roff = Math.floor(r() * (SLOT - len + 1));
        p.imm = roff;
        wrs.push({ wrId, opcode: op, flags: signaled ? SendFlags.SIGNALED : 0, sgList: sges(land, i * SLOT, len, r), remoteAddr: rsrc.addr + roff, rkey: rsrc.rkey });
        continue;
      }
      fillPattern(bytes(src).subarray(i * SLOT), m, len);
      const wr: SendWr = { wrId, opcode: op, flags: (signaled ? SendFlags.SIGNALED : 0) | (inline ? SendFlags.INLINE : 0), sgList: sges(src, i * SLOT, len, r) };
      if (op !== WrOpcode.SEND) wr.imm = imm;
      if (op === WrOpcode.RDMA_WRITE_WITH_IMM) {
        wr.remoteAddr = wtarget.addr + i * SLOT;
        wr.rkey = wtarget.rkey;
      }
      wrs.push(wr);
    }
    // The receives A's WRs consume, in order; B posts them as it goes.
    const consumers = posted.filter((p) => p.op !== WrOpcode.RDMA_READ);
    const recvIds: number[] = [];
    const recvSlot: number[] = [];
    let recvPosted = 0;
    let slotTurn = 0;
    const postRecv = (): void => {
      if (recvPosted >= consumers.length) return;
      const wrId = nextWrId();
      const slot = slotTurn++ % (RECV_POSTED * 2);
      recvIds.push(wrId);
      recvSlot.push(slot);
      recvPosted++;
      b.qp.postRecv([{ wrId, sgList: sges(rcv, slot * SLOT, SLOT, r) }]);
    };
    for (let i = 0; i < RECV_POSTED; i++) postRecv();
    let recvDone = 0;
    const checkRecv = (wc: Wc): void => {
      const k = recvDone++;
      const p = consumers[k]!;
      const what = `${tag} round ${round}: receive #${k} (for WR ${p.wrId}, op ${p.op}, ${p.len} B)`;
      assert.equal(wcStatusName(wc.status), "SUCCESS", what);
      assert.equal(wc.wrId, recvIds[k], `${what}: the completion carries its own receive's wrId`);
      assert.equal(wc.byteLen, p.len, `${what}: byte_len`);
      if (p.op === WrOpcode.SEND) assert.equal(wc.flags & 1, 0, `${what}: no immediate`);
      else assert.equal(wc.imm, p.imm, `${what}: immediate data`);
      assert.equal(wc.opcode, p.op === WrOpcode.RDMA_WRITE_WITH_IMM ? WcOpcode.RECV_RDMA_WITH_IMM : WcOpcode.RECV, `${what}: opcode`);
      if (p.op === WrOpcode.RDMA_WRITE_WITH_IMM) {
        const bad = firstMismatch(bytes(wtarget).subarray(p.at), p.msg, p.len);
        assert.equal(bad, -1, `${what}: written byte ${bad} is another message's`);
      } else {
        const bad = firstMismatch(bytes(rcv).subarray(recvSlot[k]! * SLOT), p.msg, p.len);
        assert.equal(bad, -1, `${what}: received byte ${bad} is another message's`);
      }
      // The slot is free again (its receive completed): post the next receive from the handler.
      postRecv();
    };
    const bDone = drainUntil(b, checkRecv, () => recvDone === consumers.length, `${tag} round ${round}: ${consumers.length} receives`);
    // Post in random batches (one postSend each), as the agent does per turn.
    for (let i = 0; i < wrs.length; ) {
      const n = 1 + Math.floor(r() * 8);
      a.qp.postSend(wrs.slice(i, i + n));
      i += n;
    }
    const signaled = posted.filter((p) => p.signaled);
    let sendDone = 0;
    const aDone = drainUntil(
      a,
      (wc) => {
        const p = signaled[sendDone++]!;
        const what = `${tag} round ${round}: send completion #${sendDone - 1} (WR ${p.wrId}, op ${p.op}, ${p.len} B)`;
        assert.equal(wcStatusName(wc.status), "SUCCESS", what);
        assert.equal(wc.wrId, p.wrId, `${what}: the completion carries its own WR's wrId`);
        const want = p.op === WrOpcode.RDMA_READ ? WcOpcode.RDMA_READ : p.op === WrOpcode.RDMA_WRITE_WITH_IMM ? WcOpcode.RDMA_WRITE : WcOpcode.SEND;
        assert.equal(wc.opcode, want, `${what}: opcode`);
        assert.equal(wc.byteLen, p.op === WrOpcode.RDMA_READ ? p.len : 0, `${what}: byte_len`);
      },
      () => sendDone === signaled.length,
      `${tag} round ${round}: ${signaled.length} send completions`,
    );
    await Promise.all([aDone, bDone]);
    for (const p of posted) {
      if (p.op !== WrOpcode.RDMA_READ) continue;
      const got = bytes(land).subarray(p.at, p.at + p.len);
      const want = bytes(rsrc).subarray(p.imm, p.imm + p.len);
      assert.ok(Buffer.from(got).equals(want), `${tag} round ${round}: READ ${p.wrId} (${p.len} B) landed another read's bytes`);
    }
  }

  // (b) Entries queued when A is taken to ERR: each flushes exactly once, in order, with its own wrId.
  const flushIds: number[] = [];
  const wrs: SendWr[] = [];
  for (let i = 0; i < 100; i++) {
    const wrId = nextWrId();
    flushIds.push(wrId);
    const len = SIZES[Math.floor(r() * SIZES.length)]!;
    wrs.push({ wrId, opcode: WrOpcode.SEND, flags: r() < 0.5 ? SendFlags.SIGNALED : 0, sgList: sges(src, (i % ROUND) * SLOT, len, r) });
  }
  const bIds: number[] = [];
  for (let i = 0; i < 4; i++) {
    const wrId = nextWrId();
    bIds.push(wrId);
    b.qp.postRecv([{ wrId, sgList: [sge(rcv, i * SLOT, SLOT)] }]);
  }
  for (let i = 0; i < wrs.length; i += 10) a.qp.postSend(wrs.slice(i, i + 10));
  a.qp.setError();
  const aGot: Wc[] = [];
  await drainUntil(a, (wc) => aGot.push(wc), () => aGot.length >= flushIds.length, `${tag}: ${flushIds.length} flushed WRs`);
  assert.deepEqual(
    aGot.map((wc) => wc.wrId),
    flushIds,
    `${tag}: every queued WR completes once, in order, with its own wrId`,
  );
  for (const wc of aGot) assert.equal(wcStatusName(wc.status), "WR_FLUSH_ERR", `${tag}: WR ${wc.wrId} was queued when the QP entered ERR`);
  // B learns from the closed stream: each of its receives completes exactly once.
  const bGot: Wc[] = [];
  await drainUntil(b, (wc) => bGot.push(wc), () => bGot.length >= bIds.length, `${tag}: B's ${bIds.length} receives`);
  assert.deepEqual(
    bGot.map((wc) => wc.wrId),
    bIds,
    `${tag}: each receive completes once with its own wrId`,
  );
  const late = a.cq.poll(a.buf) + b.cq.poll(b.buf);
  assert.equal(late, 0, `${tag}: no completion twice`);
}

describe("tcp provider: recycled WR records (issue 21 point 1)", () => {
  it("issue 21 point 1: recycled send-queue entries and receive records never carry one WR's data, length, wrId or status into another (3 QP pairs at once, random sizes, RNR, flush)", async () => {
    const seed = Number(process.env.REUSE_SEED ?? Date.now() % 100000);
    try {
      await Promise.all([stream("p1", seed + 1, 6), stream("p2", seed + 2, 6), stream("p3", seed + 3, 6)]);
    } catch (e) {
      (e as Error).message += ` (REUSE_SEED=${seed})`;
      throw e;
    }
  });

  it("issue 21 point 1: a receive whose message is arriving when the QP enters ERR is flushed with its own wrId, not lost", async () => {
    const { a, b } = await openPair("mid");
    const LEN = 4 << 20;
    const src = a.pd.registerMr(LEN, ALL_REMOTE);
    const rcv = b.pd.registerMr(LEN, ALL_REMOTE);
    // A first message brings both streams up (B's reader exists once it has one).
    b.qp.postRecv([{ wrId: 11, sgList: [sge(rcv, 0, 16)] }]);
    a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 16)] }]);
    const first: Wc[] = [];
    await drainUntil(b, (wc) => first.push(wc), () => first.length === 1, "the first receive");
    assert.equal(first[0]!.wrId, 11);
    // B enters ERR from inside the read that brought the first bytes of a 4 MiB message (a read takes at most 64 KiB).
    const reader = (b.qp as unknown as { resp: { reader: { feed: (buf: Buffer, s: number, e: number) => void; payloadLeft: number } } }).resp.reader;
    const feed = reader.feed.bind(reader);
    let cut = false;
    let fedAfterErr = 0;
    reader.feed = (buf, s, e) => {
      if (cut) fedAfterErr += e - s;
      feed(buf, s, e);
      if (!cut && reader.payloadLeft > 0) {
        cut = true;
        b.qp.setError();
        // The receive is flushed: its buffer is the application's again, and it reuses it at once.
        bytes(rcv).fill(0xee);
      }
    };
    bytes(src).fill(0x5a);
    b.qp.postRecv([
      { wrId: 22, sgList: [sge(rcv, 0, LEN)] },
      { wrId: 33, sgList: [sge(rcv, 0, LEN)] },
    ]);
    a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, LEN)] }]);
    const got: Wc[] = [];
    await drainUntil(b, (wc) => got.push(wc), () => got.length >= 2, "B's two receives to flush");
    assert.ok(cut, "the QP entered ERR mid-message");
    assert.deepEqual(
      got.map((wc) => [wc.wrId, wcStatusName(wc.status)]),
      [
        [22, "WR_FLUSH_ERR"],
        [33, "WR_FLUSH_ERR"],
      ],
      "the receive the message was arriving in is flushed first, then the one behind it",
    );
    assert.equal(b.cq.poll(b.buf), 0, "no receive completes twice");
    // The rest of that read, and any read before the stream closes, lands nowhere.
    const sock = (b.qp as unknown as { sock: import("node:net").Socket | null }).sock;
    if (sock && !sock.destroyed) await onceWithin(sock, "close", "B's stream to close after ERR");
    const rb = bytes(rcv);
    let changed = 0;
    for (let j = 0; j < LEN; j++) if (rb[j] !== 0xee) changed++;
    assert.equal(changed, 0, `no byte lands in a flushed receive's buffer (${fedAfterErr} bytes were read after ERR)`);
  });

  it("issue 21 point 1: a registered buffer its owner detached fails each access with an error completion, never a throw in a socket callback", async () => {
    const detach = (ab: ArrayBuffer): void => void structuredClone(ab, { transfer: [ab] });
    const cases: [string, (a: Side, b: Side) => void, [number, string][], [number, string][]][] = [
      [
        "a READ into it",
        (a, b) => {
          const s = b.pd.registerMr(4096, ALL_REMOTE);
          const t = a.pd.registerMr(new ArrayBuffer(4096), ALL_REMOTE);
          a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(t, 0, 4096)], remoteAddr: s.addr, rkey: s.rkey }]);
          detach(t.buffer as ArrayBuffer);
        },
        [[1, "LOC_PROT_ERR"]],
        [],
      ],
      [
        "an atomic whose local buffer was deregistered",
        (a, b) => {
          const s = b.pd.registerMr(64, ALL_REMOTE);
          const t = a.pd.registerMr(64, ALL_REMOTE);
          a.qp.postSend([{ wrId: 1, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(t, 0, 8)], remoteAddr: s.addr, rkey: s.rkey, compareAdd: 1n }]);
          t.deregister();
        },
        [[1, "LOC_PROT_ERR"]],
        [],
      ],
      [
        "a remote WRITE into it",
        (a, b) => {
          const s = a.pd.registerMr(4096, ALL_REMOTE);
          const t = b.pd.registerMr(new ArrayBuffer(4096), ALL_REMOTE);
          detach(t.buffer as ArrayBuffer);
          a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(s, 0, 4096)], remoteAddr: t.addr, rkey: t.rkey }]);
        },
        [[1, "REM_ACCESS_ERR"]],
        [],
      ],
      [
        "a remote READ from it",
        (a, b) => {
          const s = b.pd.registerMr(new ArrayBuffer(4096), ALL_REMOTE);
          const t = a.pd.registerMr(4096, ALL_REMOTE);
          detach(s.buffer as ArrayBuffer);
          a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(t, 0, 4096)], remoteAddr: s.addr, rkey: s.rkey }]);
        },
        [[1, "REM_ACCESS_ERR"]],
        [],
      ],
      [
        "a SEND into a receive posted in it",
        (a, b) => {
          const s = a.pd.registerMr(4096, ALL_REMOTE);
          const t = b.pd.registerMr(new ArrayBuffer(4096), ALL_REMOTE);
          b.qp.postRecv([{ wrId: 2, sgList: [sge(t, 0, 4096)] }]);
          detach(t.buffer as ArrayBuffer);
          a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(s, 0, 4096)] }]);
        },
        [[1, "REM_OP_ERR"]],
        [[2, "LOC_PROT_ERR"]],
      ],
      [
        "a SEND from it",
        (a, b) => {
          const s = a.pd.registerMr(new ArrayBuffer(4096), ALL_REMOTE);
          const t = b.pd.registerMr(4096, ALL_REMOTE);
          b.qp.postRecv([{ wrId: 2, sgList: [sge(t, 0, 4096)] }]);
          detach(s.buffer as ArrayBuffer);
          a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(s, 0, 4096)] }]);
        },
        [[1, "LOC_PROT_ERR"]],
        [],
      ],
    ];
    for (const [k, [what, run, wantA, wantB]] of cases.entries()) {
      const { a, b } = await openPair(`detach${k}`);
      // Both streams up first (a first message each way is not needed: one SEND brings the QP's one stream up).
      const up = a.pd.registerMr(64, ALL_REMOTE);
      const upR = b.pd.registerMr(64, ALL_REMOTE);
      b.qp.postRecv([{ wrId: 900, sgList: [sge(upR, 0, 64)] }]);
      a.qp.postSend([{ wrId: 901, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(up, 0, 8)] }]);
      const upA: Wc[] = [];
      const upB: Wc[] = [];
      await Promise.all([drainUntil(a, (wc) => upA.push(wc), () => upA.length === 1, `${what}: set-up send`), drainUntil(b, (wc) => upB.push(wc), () => upB.length === 1, `${what}: set-up receive`)]);
      run(a, b);
      const gotA: Wc[] = [];
      await drainUntil(a, (wc) => gotA.push(wc), () => gotA.length >= wantA.length, `${what}: the requester's completion`);
      assert.deepEqual(gotA.map((wc) => [wc.wrId, wcStatusName(wc.status)]), wantA, `${what}: requester`);
      if (wantB.length > 0) {
        const gotB: Wc[] = [];
        await drainUntil(b, (wc) => gotB.push(wc), () => gotB.length >= wantB.length, `${what}: the responder's completion`);
        assert.deepEqual(gotB.map((wc) => [wc.wrId, wcStatusName(wc.status)]), wantB, `${what}: responder`);
      }
    }
  });
});

/** Resolves on `ev` from `em`, or fails after the deadline. */
function onceWithin(em: import("node:events").EventEmitter, ev: string, what: string, ms = DEADLINE_MS * 4): Promise<void> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
    em.once(ev, () => {
      clearTimeout(t);
      resolve();
    });
  });
}
