/**
 * Checks before posting and registering (src/transport/validate.ts), on the
 * provider under test: every provider refuses these work requests at post
 * with INVALID_ARGUMENT naming the bad WR, posts nothing for it (the next
 * valid WR is the first to complete, with SUCCESS), and leaves the QP usable;
 * and refuses these registrations and QP caps. Runs on tcp in `npm test` and
 * on verbs in the guest (ASYNC_RDMA_PROVIDER=verbs).
 *
 * Each case would be visible if it were posted: bad WRs are signaled, so a
 * WR that reached the device would complete (or fail) before the valid one.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import { Access, QpState, SendFlags, WcStatus, WrOpcode, wcStatusName, type MemoryRegion, type MemoryWindow, type RecvWr, type SendWr } from "../../src/transport/types.js";
import { RdmaError } from "../../src/errors.js";
import { ALL_REMOTE, PROVIDER, deviceNames, mr, openDevice, openPair, sge, waitCompletions, type Pair } from "../support/seam.js";

const S = SendFlags.SIGNALED;

interface Ctx {
  p: Pair;
  /** Local memory at A (sources, atomic landing), remote target at B, receive buffers at B. */
  l: MemoryRegion;
  r: MemoryRegion;
  dst: MemoryRegion;
  /** A type-2 window at A and an MR it may bind to (null: the device has no type-2 windows). */
  mw: MemoryWindow | null;
  bindable: MemoryRegion;
}

// One pair for the whole file, replaced whenever a case fails (a WR the provider wrongly accepted
// may have moved the QP to ERR or left a completion behind).
let shared: Ctx | null = null;

async function ctx(): Promise<Ctx> {
  if (shared) return shared;
  const p = await openPair();
  const inl = p.a.qp.caps.maxInlineData;
  let mw: MemoryWindow | null = null;
  try {
    mw = p.a.pd.allocMw(2);
  } catch {
    mw = null;
  }
  shared = {
    p,
    l: mr(p.a, Math.max(4096, inl + 64)),
    r: mr(p.b, 4096),
    dst: mr(p.b, 64),
    mw,
    bindable: mr(p.a, 4096, Access.LOCAL_WRITE | Access.REMOTE_READ | Access.MW_BIND),
  };
  return shared;
}

function drop(): void {
  try {
    shared?.p.close();
  } finally {
    shared = null;
  }
}

after(drop);

/** Runs a case on the shared pair; a failure retires the pair. */
async function onPair(fn: (c: Ctx) => Promise<void>): Promise<void> {
  const c = await ctx();
  try {
    await fn(c);
  } catch (e) {
    drop();
    throw e;
  }
}

function refused(fn: () => void, index: string, what: string): RdmaError {
  let err: unknown = null;
  try {
    fn();
  } catch (e) {
    err = e;
  }
  assert.ok(err !== null, `${what}: accepted at post (the rule says INVALID_ARGUMENT)`);
  assert.ok(err instanceof RdmaError, `${what}: threw ${String(err)}`);
  assert.equal(err.code, "INVALID_ARGUMENT", `${what}: ${err.message}`);
  assert.match(err.message, new RegExp(`${index}\\b`), `${what}: the error names the WR (${err.message})`);
  return err;
}

/** After a refusal: the QP is in RTS and a valid signaled WRITE is the first thing to complete, with SUCCESS. */
async function nothingPosted(c: Ctx, wrId: number): Promise<void> {
  const { a } = c.p;
  assert.equal(a.qp.state, QpState.RTS, "a refused WR leaves the QP in RTS");
  a.qp.postSend([{ wrId, opcode: WrOpcode.RDMA_WRITE, flags: S, sgList: [sge(c.l, 0, 8)], remoteAddr: c.r.addr, rkey: c.r.rkey }]);
  const [wc] = await waitCompletions(a, 1);
  assert.deepEqual([wc!.wrId, wcStatusName(wc!.status)], [wrId, "SUCCESS"], "the first completion after the refusal is the next valid WR's");
}

type SendCase = { name: string; wr: (c: Ctx) => SendWr; needsMw?: boolean };

const write = (c: Ctx, over: Partial<SendWr> = {}): SendWr => ({ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: S, sgList: [sge(c.l, 0, 8)], remoteAddr: c.r.addr, rkey: c.r.rkey, ...over });
const send = (c: Ctx, over: Partial<SendWr> = {}): SendWr => ({ wrId: 1, opcode: WrOpcode.SEND, flags: S, sgList: [sge(c.l, 0, 8)], ...over });
const fadd = (c: Ctx, over: Partial<SendWr> = {}): SendWr => ({ wrId: 1, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: S, sgList: [sge(c.l, 0, 8)], remoteAddr: c.r.addr, rkey: c.r.rkey, compareAdd: 1n, ...over });
const bind = (c: Ctx, over: Partial<SendWr> = {}, b: Record<string, unknown> = {}): SendWr =>
  ({ wrId: 1, opcode: WrOpcode.BIND_MW, flags: S, mw: c.mw!, bindRkey: c.mw!.nextRkey(), bind: { mr: c.bindable, addr: c.bindable.addr, length: 64, access: Access.REMOTE_READ, ...b }, ...over }) as SendWr;
const withSge = (c: Ctx, s: Record<string, unknown>): SendWr => write(c, { sgList: [{ ...sge(c.l, 0, 8), ...s } as never] });

const sendCases: SendCase[] = [
  // wr ids and opcodes
  { name: "wrId NaN", wr: (c) => write(c, { wrId: NaN }) },
  { name: "wrId Infinity", wr: (c) => write(c, { wrId: Infinity }) },
  { name: "wrId a string", wr: (c) => write(c, { wrId: "1" as never }) },
  { name: "opcode 9 (unknown)", wr: (c) => write(c, { opcode: 9 as never }) },
  { name: "opcode -1", wr: (c) => write(c, { opcode: -1 as never }) },
  { name: 'opcode "0" (a string)', wr: (c) => write(c, { opcode: "0" as never }) },
  { name: "flags with an unknown bit (16)", wr: (c) => write(c, { flags: S | 16 }) },
  { name: "flags -1", wr: (c) => write(c, { flags: -1 }) },
  // scatter/gather elements
  { name: "lkey -1 (negative, not reinterpreted)", wr: (c) => withSge(c, { lkey: -1 }) },
  { name: "lkey negative int32 (lkey | 0x80000000 | 0)", wr: (c) => withSge(c, { lkey: (c.l.lkey | 0x80000000) | 0 }) },
  { name: "lkey 2^32", wr: (c) => withSge(c, { lkey: 2 ** 32 }) },
  { name: "lkey 1.5", wr: (c) => withSge(c, { lkey: 1.5 }) },
  { name: "SGE addr -1", wr: (c) => withSge(c, { addr: -1 }) },
  { name: "SGE addr 2^53 (not a safe integer)", wr: (c) => withSge(c, { addr: 2 ** 53 }) },
  { name: "SGE addr 1.5", wr: (c) => withSge(c, { addr: c.l.addr + 0.5 }) },
  { name: "SGE length -1", wr: (c) => withSge(c, { length: -1 }) },
  { name: "SGE length 2^31 + 1", wr: (c) => withSge(c, { length: 2 ** 31 + 1 }) },
  { name: "SGE length 1.5", wr: (c) => withSge(c, { length: 1.5 }) },
  { name: "message above 2^31 (2^31 + 8 over two SGEs)", wr: (c) => write(c, { sgList: [sge(c.l, 0, 2 ** 31), sge(c.l, 0, 8)] }) },
  { name: "more SGEs than maxSendSge", wr: (c) => write(c, { sgList: Array.from({ length: c.p.a.qp.caps.maxSendSge + 1 }, () => sge(c.l, 0, 8)) }) },
  { name: "sgList not an array", wr: (c) => write(c, { sgList: "x" as never }) },
  // immediate data and keys
  { name: "imm -1 on SEND_WITH_IMM", wr: (c) => send(c, { opcode: WrOpcode.SEND_WITH_IMM, imm: -1 }) },
  { name: "imm 2^32 on RDMA_WRITE_WITH_IMM", wr: (c) => write(c, { opcode: WrOpcode.RDMA_WRITE_WITH_IMM, imm: 2 ** 32 }) },
  { name: "imm 1.5 on SEND_WITH_IMM", wr: (c) => send(c, { opcode: WrOpcode.SEND_WITH_IMM, imm: 1.5 }) },
  { name: "imm -1 on a plain SEND (present, so checked)", wr: (c) => send(c, { imm: -1 }) },
  { name: "rkey -1 on RDMA_WRITE", wr: (c) => write(c, { rkey: -1 }) },
  { name: "rkey negative int32 on RDMA_READ", wr: (c) => write(c, { opcode: WrOpcode.RDMA_READ, rkey: (c.r.rkey | 0x80000000) | 0 }) },
  { name: "rkey 2^32 on RDMA_WRITE", wr: (c) => write(c, { rkey: 2 ** 32 }) },
  { name: "rkey -1 on a SEND (present, so checked)", wr: (c) => send(c, { rkey: -1 }) },
  { name: "RDMA_WRITE without rkey", wr: (c) => write(c, { rkey: undefined as never }) },
  { name: "RDMA_READ without remoteAddr", wr: (c) => write(c, { opcode: WrOpcode.RDMA_READ, remoteAddr: undefined as never }) },
  { name: "remoteAddr -8", wr: (c) => write(c, { remoteAddr: -8 }) },
  { name: "remoteAddr 1.5", wr: (c) => write(c, { remoteAddr: c.r.addr + 0.5 }) },
  // atomics
  { name: "atomic with two 4-byte SGEs", wr: (c) => fadd(c, { sgList: [sge(c.l, 0, 4), sge(c.l, 4, 4)] }) },
  { name: "atomic with a 4-byte SGE", wr: (c) => fadd(c, { sgList: [sge(c.l, 0, 4)] }) },
  { name: "atomic with a 16-byte SGE", wr: (c) => fadd(c, { sgList: [sge(c.l, 0, 16)] }) },
  { name: "atomic operand a number", wr: (c) => fadd(c, { compareAdd: 1 as never }) },
  { name: "compare-and-swap with a number swap", wr: (c) => fadd(c, { opcode: WrOpcode.ATOMIC_CMP_AND_SWP, compareAdd: 0n, swap: 1 as never }) },
  { name: "atomic on a target not 8-byte aligned", wr: (c) => fadd(c, { remoteAddr: c.r.addr + 4 }) },
  // inline
  { name: "inline SEND of maxInlineData + 1 bytes", wr: (c) => send(c, { flags: S | SendFlags.INLINE, sgList: [sge(c.l, 0, c.p.a.qp.caps.maxInlineData + 1)] }) },
  // local operations
  { name: "LOCAL_INV without invalidateRkey", wr: () => ({ wrId: 1, opcode: WrOpcode.LOCAL_INV, flags: S }) },
  { name: "LOCAL_INV invalidateRkey -1", wr: () => ({ wrId: 1, opcode: WrOpcode.LOCAL_INV, flags: S, invalidateRkey: -1 }) },
  { name: "LOCAL_INV invalidateRkey 2^32", wr: () => ({ wrId: 1, opcode: WrOpcode.LOCAL_INV, flags: S, invalidateRkey: 2 ** 32 }) },
  { name: "BIND_MW without a window", needsMw: true, wr: (c) => bind(c, { mw: undefined as never }) },
  { name: "BIND_MW without bind", needsMw: true, wr: (c) => bind(c, { bind: undefined as never }) },
  { name: "BIND_MW bindRkey -1", needsMw: true, wr: (c) => bind(c, { bindRkey: -1 }) },
  { name: "BIND_MW bindRkey 2^32", needsMw: true, wr: (c) => bind(c, { bindRkey: 2 ** 32 }) },
  { name: "BIND_MW bind.addr -1", needsMw: true, wr: (c) => bind(c, {}, { addr: -1 }) },
  { name: "BIND_MW bind.length -1", needsMw: true, wr: (c) => bind(c, {}, { length: -1 }) },
  { name: "BIND_MW bind.access 64 (not an access flag)", needsMw: true, wr: (c) => bind(c, {}, { access: 64 }) },
];

type RecvCase = { name: string; wr: (c: Ctx) => RecvWr };
const recv = (c: Ctx, over: Partial<RecvWr> = {}): RecvWr => ({ wrId: 1, sgList: [sge(c.dst)], ...over });
const recvSge = (c: Ctx, s: Record<string, unknown>): RecvWr => recv(c, { sgList: [{ ...sge(c.dst), ...s } as never] });

const recvCases: RecvCase[] = [
  { name: "wrId NaN", wr: (c) => recv(c, { wrId: NaN }) },
  { name: "wrId a string", wr: (c) => recv(c, { wrId: "1" as never }) },
  { name: "lkey -1", wr: (c) => recvSge(c, { lkey: -1 }) },
  { name: "lkey 2^32", wr: (c) => recvSge(c, { lkey: 2 ** 32 }) },
  { name: "SGE addr -1", wr: (c) => recvSge(c, { addr: -1 }) },
  { name: "SGE length -1", wr: (c) => recvSge(c, { length: -1 }) },
  { name: "SGE length 2^31 + 1", wr: (c) => recvSge(c, { length: 2 ** 31 + 1 }) },
  { name: "more SGEs than maxRecvSge", wr: (c) => recv(c, { sgList: Array.from({ length: c.p.b.qp.caps.maxRecvSge + 1 }, () => sge(c.dst, 0, 8)) }) },
];

describe(`checks before posting (transport/validate.ts) [${PROVIDER}]`, () => {
  for (const t of sendCases) {
    it(`postSend refuses ${t.name}`, () =>
      onPair(async (c) => {
        if (t.needsMw && c.mw === null) {
          console.log(`# ${c.p.a.dev.name} has no type-2 memory windows: case not applicable`);
          return;
        }
        const wr = t.wr(c);
        refused(() => c.p.a.qp.postSend([wr]), "#0", t.name);
        await nothingPosted(c, 100);
      }));
  }

  it("postSend names the first bad WR; the WRs before it are posted, the ones after it are not", () =>
    onPair(async (c) => {
      const { a } = c.p;
      refused(() => a.qp.postSend([write(c, { wrId: 10 }), write(c, { wrId: 11, opcode: 99 as never }), write(c, { wrId: 12 })]), "#1", "second WR bad");
      const [wc] = await waitCompletions(a, 1);
      assert.deepEqual([wc!.wrId, wcStatusName(wc!.status)], [10, "SUCCESS"]);
      await nothingPosted(c, 13);
    }));

  for (const t of recvCases) {
    it(`postRecv refuses ${t.name}`, () =>
      onPair(async (c) => {
        const { a, b } = c.p;
        const wr = t.wr(c);
        refused(() => b.qp.postRecv([wr]), "#0", `receive: ${t.name}`);
        assert.equal(b.qp.state, QpState.RTS);
        // Had it been posted, the next SEND would land in it (or fail there) first.
        b.qp.postRecv([{ wrId: 200, sgList: [sge(c.dst)] }]);
        a.qp.postSend([send(c, { wrId: 201 })]);
        const [rc] = await waitCompletions(b, 1);
        assert.deepEqual([rc!.wrId, wcStatusName(rc!.status)], [200, "SUCCESS"], "the SEND landed in the next valid receive");
        const [sc] = await waitCompletions(a, 1);
        assert.deepEqual([sc!.wrId, wcStatusName(sc!.status)], [201, "SUCCESS"]);
      }));
  }

  it("accepts the edges: any finite wrId comes back unchanged, imm 0 and 2^32 - 1, maxSendSge SGEs, maxInlineData inline bytes, an aligned atomic", () =>
    onPair(async (c) => {
      const { a, b } = c.p;
      const ids = [1.5, -3, 2 ** 53, Number.MAX_VALUE];
      a.qp.postSend(ids.map((wrId) => write(c, { wrId })));
      assert.deepEqual((await waitCompletions(a, ids.length)).map((w) => [w.wrId, wcStatusName(w.status)]), ids.map((id) => [id, "SUCCESS"]));
      b.qp.postRecv([0, 1].map((i) => ({ wrId: 300 + i, sgList: [sge(c.dst)] })));
      a.qp.postSend([
        send(c, { wrId: 310, opcode: WrOpcode.SEND_WITH_IMM, imm: 0 }),
        write(c, { wrId: 311, opcode: WrOpcode.RDMA_WRITE_WITH_IMM, imm: 0xffffffff }),
      ]);
      assert.deepEqual((await waitCompletions(b, 2)).map((w) => [w.wrId, w.imm, wcStatusName(w.status)]), [
        [300, 0, "SUCCESS"],
        [301, 0xffffffff, "SUCCESS"],
      ]);
      await waitCompletions(a, 2);
      const n = a.qp.caps.maxSendSge;
      const inl = a.qp.caps.maxInlineData;
      const wrs: SendWr[] = [write(c, { wrId: 320, sgList: Array.from({ length: n }, (_, i) => sge(c.l, i * 8, 8)) })];
      if (inl > 0) wrs.push(write(c, { wrId: 321, flags: S | SendFlags.INLINE, sgList: [sge(c.l, 0, inl)] }));
      wrs.push(fadd(c, { wrId: 322, sgList: [sge(c.l, 64, 8)], remoteAddr: c.r.addr + 8 }));
      a.qp.postSend(wrs);
      const got = await waitCompletions(a, wrs.length);
      assert.deepEqual(
        got.map((w) => [w.wrId, wcStatusName(w.status)]),
        wrs.map((w) => [w.wrId, "SUCCESS"]),
      );
      assert.equal(got.at(-1)!.status, WcStatus.SUCCESS);
    }));
});

describe(`checks before registering and creating QPs (transport/validate.ts) [${PROVIDER}]`, () => {
  it("registerMr refuses bad access flags, remote write/atomic without local write, and bad ranges", async () => {
    const dev = await openDevice(deviceNames()[0]);
    try {
      const pd = dev.allocPd();
      const bad = (what: string, fn: () => unknown): void => {
        let err: unknown = null;
        try {
          const m = fn() as MemoryRegion;
          m.deregister();
        } catch (e) {
          err = e;
        }
        assert.ok(err instanceof RdmaError && err.code === "INVALID_ARGUMENT", `registerMr ${what}: ${err === null ? "accepted" : String(err)}`);
      };
      for (const acc of [32, -1, 1.5, "1" as never, Access.REMOTE_WRITE, Access.REMOTE_ATOMIC, Access.REMOTE_WRITE | Access.REMOTE_READ, Access.REMOTE_ATOMIC | Access.MW_BIND]) {
        bad(`access ${String(acc)}`, () => pd.registerMr(64, acc));
      }
      for (const len of [0, -1, 1.5, NaN, 2 ** 53]) bad(`length ${len}`, () => pd.registerMr(len, Access.LOCAL_WRITE));
      const ab = new ArrayBuffer(64);
      for (const [o, l] of [[-1, 8], [65, 1], [60, 8], [0, 0], [0, 65], [1.5, 8]] as const) bad(`ArrayBuffer offset ${o} length ${l}`, () => pd.registerMr(ab, Access.LOCAL_WRITE, o, l));
      // A SharedArrayBuffer is registered (issue 22 point 3), a growable one is not: it could grow past the registration.
      bad("growable SharedArrayBuffer", () => pd.registerMr(new (SharedArrayBuffer as unknown as new (n: number, o: { maxByteLength: number }) => SharedArrayBuffer)(64, { maxByteLength: 128 }), Access.LOCAL_WRITE));
      bad("resizable ArrayBuffer", () => pd.registerMr(new (ArrayBuffer as unknown as new (n: number, o: { maxByteLength: number }) => ArrayBuffer)(64, { maxByteLength: 128 }), Access.LOCAL_WRITE));
      const detached = new ArrayBuffer(64);
      structuredClone(detached, { transfer: [detached] });
      bad("detached ArrayBuffer", () => pd.registerMr(detached, Access.LOCAL_WRITE));
      // Allowed: remote read alone, local write with remote everything, a range of the caller's buffer (ArrayBuffer or SharedArrayBuffer).
      for (const m of [pd.registerMr(64, Access.REMOTE_READ), pd.registerMr(64, ALL_REMOTE | Access.MW_BIND), pd.registerMr(ab, Access.LOCAL_WRITE, 8, 56), pd.registerMr(new SharedArrayBuffer(64), Access.LOCAL_WRITE, 8, 56)]) m.deregister();
      pd.dealloc();
    } finally {
      dev.close();
    }
  });

  it("createQp refuses caps above the device's limits", async () => {
    const dev = await openDevice(deviceNames()[0]);
    try {
      const a = dev.attr;
      const over: Record<string, number>[] = [
        { maxSendWr: 0 },
        { maxSendWr: a.maxQpWr + 1 },
        { maxRecvWr: a.maxQpWr + 1 },
        { maxSendSge: a.maxSge + 1 },
        { maxRecvSge: a.maxSge + 1 },
        { maxInlineData: a.maxInline + 1 },
        { maxInlineData: -1 },
        { access: 32 },
      ];
      const pd = dev.allocPd();
      const cq = dev.createCq(64);
      for (const o of over) {
        assert.throws(
          () => pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 4, maxRecvWr: 4, ...o }),
          (e: unknown) => e instanceof RdmaError && e.code === "INVALID_ARGUMENT",
          `createQp ${JSON.stringify(o)}`,
        );
      }
      // The limits themselves are accepted.
      const ok = pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 4, maxRecvWr: 4, maxSendSge: a.maxSge, maxRecvSge: a.maxSge });
      ok.destroy();
      cq.destroy();
      pd.dealloc();
    } finally {
      dev.close();
    }
  });
});
