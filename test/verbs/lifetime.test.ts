/**
 * Lifetimes at the seam, on the provider under test (ASYNC_RDMA_PROVIDER):
 * releasing in every wrong order gives typed errors (verbs' EBUSY as
 * INVALID_STATE) and never a crash; objects dropped without release are
 * reclaimed by GC (child process with --expose-gc); garbage arguments to
 * every entry point give an RdmaError.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { RdmaError } from "../../src/errors.js";
import { Access, CompletionBuffer, QpState, SendFlags, WcStatus, WrOpcode, type Device, type MemoryRegion } from "../../src/transport/types.js";
import { isDetached } from "../../src/transport/buffers.js";
import { DEADLINE_MS, PROVIDER, SLOW, deviceNames, endpointFor, makeSide, mr, openDevice, openPair, provider, sge, waitCompletions, type Pair } from "../support/seam.js";

const TCP = PROVIDER === "tcp";

function typed(fn: () => unknown, codes?: readonly string[], what = "call"): RdmaError {
  let err: unknown;
  try {
    fn();
  } catch (e) {
    err = e;
  }
  assert.ok(err !== undefined, `${what}: expected an RdmaError, nothing was thrown`);
  assert.ok(err instanceof RdmaError, `${what}: expected an RdmaError, got ${String((err as Error)?.stack ?? err)}`);
  if (codes) assert.ok(codes.includes(err.code), `${what}: code ${err.code} not in ${codes.join("|")} (${err.message})`);
  return err;
}

/** Returns normally or throws an RdmaError: anything else (TypeError, crash) fails. */
function noCrash(fn: () => unknown, what = "call"): void {
  try {
    fn();
  } catch (e) {
    assert.ok(e instanceof RdmaError, `${what}: threw a non-RdmaError: ${String((e as Error)?.stack ?? e)}`);
  }
}

/** Calls fn on each garbage value; returns what did not throw an RdmaError (index and why). */
function rejectAll(fn: (v: unknown) => unknown, values: readonly unknown[], what: string): string[] {
  const failures: string[] = [];
  values.forEach((v, i) => {
    try {
      typed(() => fn(v), undefined, `${what} garbage #${i}`);
    } catch (e) {
      failures.push((e as Error).message.split("\n")[0]!);
    }
  });
  return failures;
}

async function withDevice(fn: (dev: Device) => Promise<void> | void): Promise<void> {
  const dev = await openDevice(deviceNames()[0]);
  try {
    await fn(dev);
  } finally {
    dev.close();
  }
}

async function withPair(fn: (p: Pair) => Promise<void>): Promise<void> {
  const p = await openPair();
  try {
    await fn(p);
  } finally {
    p.close();
  }
}

/** One SEND from a to b, checked: the pair (and the process) still works. */
async function pingPong(p: Pair): Promise<void> {
  const src = mr(p.a, 16);
  const dst = mr(p.b, 16);
  new Uint8Array(src.buffer, src.offset, 16).fill(0x5a);
  p.b.qp.postRecv([{ wrId: 1, sgList: [sge(dst)] }]);
  p.a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] }]);
  const [r] = await waitCompletions(p.b, 1);
  const [s] = await waitCompletions(p.a, 1);
  assert.equal(r!.status, WcStatus.SUCCESS);
  assert.equal(s!.status, WcStatus.SUCCESS);
  assert.ok(new Uint8Array(dst.buffer, dst.offset, 16).every((x) => x === 0x5a));
  src.deregister();
  dst.deregister();
}

const BUSY = ["INVALID_STATE"];

describe(`lifetimes: release in the wrong order [${PROVIDER}]`, () => {
  it("dealloc a PD that still has an MR: INVALID_STATE (EBUSY), and it works once the MR is gone", () =>
    withDevice((dev) => {
      const pd = dev.allocPd();
      const m = pd.registerMr(4096, Access.LOCAL_WRITE);
      const e = typed(() => pd.dealloc(), BUSY, "dealloc PD with an MR");
      assert.equal(e.errnoName, "EBUSY");
      m.deregister();
      pd.dealloc();
      pd.dealloc(); // twice: a no-op
      typed(() => pd.registerMr(64, Access.LOCAL_WRITE), BUSY, "registerMr on a deallocated PD");
    }));

  it("dealloc a PD that still has a QP, and one with a memory window: INVALID_STATE", () =>
    withDevice((dev) => {
      const pd = dev.allocPd();
      const cq = dev.createCq(16);
      const qp = pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 4, maxRecvWr: 4 });
      typed(() => pd.dealloc(), BUSY, "dealloc PD with a QP");
      qp.destroy();
      if (dev.attr.mwTypes.length > 0) {
        const mw = pd.allocMw(dev.attr.mwTypes.includes(2) ? 2 : 1);
        typed(() => pd.dealloc(), BUSY, "dealloc PD with a window");
        mw.dealloc();
        mw.dealloc(); // twice
      }
      pd.dealloc();
      cq.destroy();
    }));

  it("destroy a CQ that a QP still uses: INVALID_STATE, and it works once the QP is gone", () =>
    withDevice((dev) => {
      const pd = dev.allocPd();
      const scq = dev.createCq(16);
      const rcq = dev.createCq(16);
      const qp = pd.createQp({ sendCq: scq, recvCq: rcq, maxSendWr: 4, maxRecvWr: 4 });
      typed(() => scq.destroy(), BUSY, "destroy the send CQ");
      typed(() => rcq.destroy(), BUSY, "destroy the recv CQ");
      // The QP still works after the refused destroys.
      qp.postRecv([{ wrId: 1, sgList: [] }]);
      qp.destroy();
      scq.destroy();
      rcq.destroy();
      scq.destroy(); // twice
      pd.dealloc();
    }));

  it("deregister an MR twice: the second is a no-op; provider memory is detached", () =>
    withDevice((dev) => {
      const pd = dev.allocPd();
      const m = pd.registerMr(100, Access.LOCAL_WRITE);
      const view = new Uint8Array(m.buffer, m.offset, m.length);
      view[99] = 1;
      m.deregister();
      assert.equal(m.deregistered, true);
      assert.equal(view.length, 0, "provider-allocated memory is detached on deregister");
      m.deregister();
      // The caller's own memory is not detached.
      const own = new ArrayBuffer(256);
      const um = pd.registerMr(own, Access.LOCAL_WRITE, 16, 64);
      um.deregister();
      um.deregister();
      assert.equal(own.byteLength, 256);
      pd.dealloc();
    }));

  it(
    "use a destroyed QP: every call is INVALID_STATE",
    () =>
    withPair(async (p) => {
      const m = mr(p.a, 64);
      p.a.qp.destroy();
      p.a.qp.destroy(); // twice: a no-op
      assert.equal(p.a.qp.state, QpState.ERR);
      typed(() => p.a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, sgList: [sge(m)] }]), BUSY, "postSend");
      typed(() => p.a.qp.postRecv([{ wrId: 1, sgList: [sge(m)] }]), BUSY, "postRecv");
      typed(() => p.a.qp.connect(endpointFor(p.b.qp)), BUSY, "connect");
      typed(() => p.a.qp.setError(), BUSY, "setError");
      typed(() => p.a.qp.localEndpoint(), BUSY, "localEndpoint");
    }));

  it("use a destroyed CQ: poll and requestNotify are INVALID_STATE; a QP cannot be created on it", () =>
    withDevice((dev) => {
      const pd = dev.allocPd();
      const cq = dev.createCq(16);
      cq.destroy();
      typed(() => cq.poll(new CompletionBuffer(4)), BUSY, "poll");
      typed(() => cq.requestNotify(), BUSY, "requestNotify");
      typed(() => pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 4, maxRecvWr: 4 }), BUSY, "createQp on a destroyed CQ");
      pd.dealloc();
    }));

  it("close the device with everything live: no crash, later calls are typed, releases are no-ops", () =>
    (async () => {
      const [na, nb] = deviceNames();
      const devA = await openDevice(na);
      const devB = await openDevice(nb);
      const a = makeSide(devA);
      const b = makeSide(devB);
      const attr = { gidIndex: Number(process.env.RXE_GID_INDEX ?? 1), rnrRetry: 7, minRnrTimer: 1 };
      a.qp.connect(endpointFor(b.qp), attr);
      b.qp.connect(endpointFor(a.qp), attr);
      const ma = mr(a, 4096);
      const mb = mr(b, 4096);
      const aliasOf = (m: MemoryRegion) => (m.aliasBuffer ? m.aliasBuffer(0, 64) : null);
      const alias = aliasOf(ma);
      const mw = devA.attr.mwTypes.includes(2) ? a.pd.allocMw(2) : null;
      // Work in flight on both sides when the device goes.
      for (let i = 0; i < 8; i++) b.qp.postRecv([{ wrId: i, sgList: [sge(mb, i * 64, 64)] }]);
      a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(ma, 0, 64)] }]);
      a.cq.onNotify = () => {};
      a.cq.requestNotify();
      devA.close();
      devA.close(); // twice
      // Everything on A: typed errors, and releases after close do nothing.
      typed(() => devA.allocPd(), BUSY, "allocPd after close");
      typed(() => devA.createCq(4), BUSY, "createCq after close");
      typed(() => a.pd.registerMr(64, Access.LOCAL_WRITE), BUSY, "registerMr after close");
      const postCheck = (fn: () => unknown, what: string) => typed(fn, BUSY, what);
      postCheck(() => a.qp.postSend([{ wrId: 3, opcode: WrOpcode.SEND, sgList: [sge(ma, 0, 8)] }]), "postSend after close");
      postCheck(() => a.qp.postRecv([{ wrId: 3, sgList: [sge(ma, 0, 8)] }]), "postRecv after close");
      noCrash(() => a.cq.poll(a.buf), "poll after close");
      noCrash(() => a.cq.requestNotify(), "requestNotify after close");
      if (alias) {
        // The alias still owns a reference on the memory: touching it is safe.
        new Uint8Array(alias).fill(1);
      }
      noCrash(() => mw?.dealloc(), "mw.dealloc after close");
      noCrash(() => a.qp.destroy(), "qp.destroy after close");
      noCrash(() => a.cq.destroy(), "cq.destroy after close");
      noCrash(() => ma.deregister(), "deregister after close");
      noCrash(() => a.pd.dealloc(), "pd.dealloc after close");
      assert.equal(ma.deregistered, true);
      // B sees its peer vanish as errors (or nothing yet), never a crash; it still works locally.
      b.qp.setError();
      await waitCompletions(b, 1); // flushed receives at least
      b.qp.destroy();
      b.cq.destroy();
      mb.deregister();
      b.pd.dealloc();
      if (devB !== devA) devB.close();
      // And a new pair on the same provider works.
      await withPair(pingPong);
    })());

  it("close the device before releasing anything on it, in the worst order (PD first)", () =>
    withDevice((dev) => {
      const s = makeSide(dev);
      const m = mr(s, 64);
      dev.close();
      s.pd.dealloc();
      s.cq.destroy();
      m.deregister();
      s.qp.destroy();
    }));
});

describe(`lifetimes: GC churn [${PROVIDER}]`, () => {
  // One child process (node --expose-gc) for both tests: it prints one JSON line when done.
  let run: Promise<{ out: string; err: string; okLine: Promise<string>; exit: Promise<number | string> }> | null = null;
  const start = () =>
    (run ??= Promise.resolve().then(() => {
      const script = fileURLToPath(new URL("./lifetime-churn.js", import.meta.url));
      const child = spawn(process.execPath, ["--expose-gc", script], { stdio: ["ignore", "pipe", "pipe"], env: process.env });
      const r = { out: "", err: "", okLine: null as unknown as Promise<string>, exit: null as unknown as Promise<number | string> };
      let gotLine: (l: string) => void = () => {};
      r.okLine = new Promise((res) => (gotLine = res));
      child.stdout.on("data", (d: Buffer) => {
        r.out += d.toString();
        const line = r.out.split("\n").find((l) => l.startsWith("{"));
        if (line) gotLine(line);
      });
      child.stderr.on("data", (d: Buffer) => (r.err += d.toString()));
      r.exit = new Promise((resolve) => child.on("exit", (c, sig) => resolve(c ?? String(sig))));
      const limit = 60_000 * SLOW;
      const t = setTimeout(() => child.kill("SIGKILL"), limit);
      void r.exit.then(() => clearTimeout(t));
      void r.exit.then(() => gotLine(""));
      (r as { kill?: () => void }).kill = () => child.kill("SIGKILL");
      return r;
    }));

  it("200 sets of PD/CQ/QP/MR dropped without release, collected by forced GC: the process stays healthy", async () => {
    const r = await start();
    const line = await r.okLine;
    if (!line) assert.fail(`churn child failed (exit ${String(await r.exit)}):\n${r.out}\n${r.err}`);
    const res = JSON.parse(line) as { ok: boolean; sets: number; rssMb: number[] };
    assert.equal(res.ok, true);
    assert.equal(res.sets, 200);
    console.log(`churn: rss MB after each 50 sets + GC: ${res.rssMb.join(", ")}`);
  });

  it(
    "... and exits by itself with connected QPs and devices dropped unreleased",
    async () => {
      const r = await start();
      await r.okLine;
      // After the last line the program has nothing left to do: it must exit promptly.
      const grace = TCP ? 2_000 : 30_000 * SLOW;
      const code = await Promise.race([r.exit, new Promise<string>((res) => setTimeout(() => res(`still running ${grace} ms after its last line`), grace).unref())]);
      if (code !== 0) (r as { kill?: () => void }).kill?.();
      assert.equal(code, 0, `churn child: ${String(code)}\n${r.err}`);
    },
  );
});

describe(`garbage arguments: typed RdmaError, never a crash [${PROVIDER}]`, () => {
  const junk: unknown[] = [undefined, null, -1, 1.5, NaN, Infinity, 2 ** 53, "1", {}, [], () => 1, Symbol("x"), 10n];

  it("provider.openDevice", async () => {
    const p = await provider();
    for (const j of [123, {}, "no-such-device-xyz", Symbol("d")]) {
      try {
        const d = await p.openDevice(j as string);
        // tcp names its devices freely; a device it opens is a real one.
        d.close();
      } catch (e) {
        assert.ok(e instanceof RdmaError, `openDevice(${String(j)}): ${String(e)}`);
      }
    }
  });

  it("device.queryPort / createCq", () =>
    withDevice((dev) => {
      for (const j of junk) if (j !== undefined) typed(() => dev.queryPort(j as number), undefined, `queryPort(${String(j)})`);
      typed(() => dev.queryPort(99), undefined, "queryPort(99)");
      for (const j of [...junk, 0, 2 ** 40]) typed(() => dev.createCq(j as number), undefined, `createCq(${String(j)})`);
    }));

  it("pd.registerMr / allocMw / createQp", () =>
    withDevice((dev) => {
      const pd = dev.allocPd();
      const cq = dev.createCq(16);
      for (const j of [...junk, 0, 2 ** 60]) typed(() => pd.registerMr(j as number, Access.LOCAL_WRITE), undefined, `registerMr(${String(j)})`);
      for (const j of junk) if (j !== undefined) typed(() => pd.registerMr(64, j as number), undefined, `registerMr(64, access ${String(j)})`);
      typed(() => pd.registerMr(64, 64), undefined, "registerMr(64, access 64)");
      typed(() => pd.registerMr(64, Access.REMOTE_WRITE), undefined, "remote write without local write");
      const ab = new ArrayBuffer(64);
      for (const [o, l] of [[-1, 8], [0, 0], [60, 8], [65, 1], [1.5, 4], [0, NaN], ["0", 4], [0, 65]] as const) {
        typed(() => pd.registerMr(ab, Access.LOCAL_WRITE, o as number, l as number), undefined, `registerMr(ab, ${String(o)}, ${String(l)})`);
      }
      typed(() => pd.registerMr(new Uint8Array(8) as unknown as ArrayBuffer, Access.LOCAL_WRITE), undefined, "registerMr(Uint8Array)");
      // A SharedArrayBuffer registers (issue 22 point 3); a growable one cannot (it could grow past the registration).
      typed(() => pd.registerMr(new (SharedArrayBuffer as unknown as new (n: number, o: { maxByteLength: number }) => SharedArrayBuffer)(8, { maxByteLength: 16 }), Access.LOCAL_WRITE), undefined, "registerMr(growable SharedArrayBuffer)");
      const detached = new ArrayBuffer(8);
      structuredClone(detached, { transfer: [detached] });
      typed(() => pd.registerMr(detached, Access.LOCAL_WRITE), undefined, "registerMr(detached)");
      for (const j of [0, 3, "2", null, 2.5]) typed(() => pd.allocMw(j as 2), undefined, `allocMw(${String(j)})`);
      const base = { sendCq: cq, recvCq: cq, maxSendWr: 4, maxRecvWr: 4 };
      const bad: unknown[] = [
        undefined,
        null,
        42,
        {},
        { ...base, sendCq: {} },
        { ...base, recvCq: null },
        { ...base, sendCq: "cq" },
        { ...base, maxSendWr: -1 },
        { ...base, maxSendWr: 0 },
        { ...base, maxRecvWr: NaN },
        { ...base, maxRecvWr: 2 ** 40 },
        { ...base, maxSendSge: 0 },
        { ...base, maxRecvSge: 1e9 },
        { ...base, maxInlineData: -5 },
        { ...base, maxInlineData: 1 << 30 },
        { ...base, portNum: 0 },
        { ...base, portNum: 200 },
        { ...base, access: 1 << 10 },
        { ...base, access: "all" },
      ];
      for (const init of bad) typed(() => pd.createQp(init as never), undefined, `createQp(${JSON.stringify(init, (_k, v) => (typeof v === "object" && v !== null && "poll" in v ? "<cq>" : v))})`);
      // A CQ of another device.
      cq.destroy();
      pd.dealloc();
    }));

  it("mr.aliasBuffer (native memory only)", () =>
    withDevice((dev) => {
      const pd = dev.allocPd();
      const m = pd.registerMr(4096, Access.LOCAL_WRITE);
      if (!m.aliasBuffer) {
        m.deregister();
        pd.dealloc();
        return;
      }
      for (const [o, l] of [[-1, 8], [0, 0], [4090, 8], [4096, 1], [1.5, 4], [0, NaN], ["0", 4], [undefined, 4], [0, 2 ** 60]] as const) {
        typed(() => m.aliasBuffer!(o as number, l as number), undefined, `aliasBuffer(${String(o)}, ${String(l)})`);
      }
      const ab = m.aliasBuffer(4000, 96);
      assert.equal(ab.byteLength, 96);
      const own = pd.registerMr(new ArrayBuffer(64), Access.LOCAL_WRITE);
      typed(() => own.aliasBuffer!(0, 8), undefined, "aliasBuffer of the caller's memory");
      m.deregister();
      assert.ok(isDetached(ab), "deregister detaches the alias");
      typed(() => m.aliasBuffer!(0, 8), ["INVALID_STATE"], "aliasBuffer after deregister");
      own.deregister();
      pd.dealloc();
    }));

  it("cq.poll", () =>
    withDevice((dev) => {
      const cq = dev.createCq(16);
      for (const j of [undefined, null, 42, {}, { capacity: 4 }, new Float64Array(4)]) typed(() => cq.poll(j as CompletionBuffer), undefined, `poll(${String(j)})`);
      for (const j of [-1, NaN, "4", {}]) typed(() => cq.poll(new CompletionBuffer(4), j as number), undefined, `poll(buf, ${String(j)})`);
      cq.destroy();
    }));

  it("qp.localEndpoint", () =>
    withPair(async (p) => {
      for (const j of [{ portNum: 0 }, { portNum: 99 }, { gidIndex: -1 }, { gidIndex: "1" }]) typed(() => p.a.qp.localEndpoint(j as never), undefined, `localEndpoint(${JSON.stringify(j)})`);
    }));

  it("qp.connect / postSend / postRecv", () =>
    withPair(async (p) => {
      const qp = p.a.qp;
      const m = mr(p.a, 4096);
      for (const j of [undefined, null, 42, {}, { provider: "ib" }]) typed(() => qp.connect(j as never), undefined, `connect(${String(j)})`);
      // postSend: not an array, bad records. WRs before a bad one are posted (verbs' bad_wr),
      // so each list here starts with the bad record.
      const good = sge(m, 0, 8);
      const sends: unknown[] = [
        null,
        42,
        "wr",
        {},
        [null],
        [42],
        [{}],
        [{ wrId: "1", opcode: WrOpcode.SEND }],
        [{ wrId: 1, opcode: 99 }],
        [{ wrId: 1, opcode: -1 }],
        [{ wrId: 1, opcode: "SEND" }],
        [{ wrId: 1, opcode: WrOpcode.SEND, sgList: "x" }],
        [{ wrId: 1, opcode: WrOpcode.SEND, sgList: [null] }],
        [{ wrId: 1, opcode: WrOpcode.SEND, sgList: [{ addr: good.addr, length: -8, lkey: m.lkey }] }],
        [{ wrId: 1, opcode: WrOpcode.SEND, sgList: [{ addr: good.addr, length: 8, lkey: "k" }] }],
        [{ wrId: 1, opcode: WrOpcode.SEND, sgList: Array.from({ length: 99 }, () => good) }],
        [{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.INLINE, sgList: [{ addr: 0x1000, length: 8, lkey: m.lkey }] }],
        [{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.INLINE, sgList: [{ addr: good.addr, length: 8, lkey: 0xdead }] }],
        [{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, sgList: [good], remoteAddr: -5, rkey: 1 }],
        [{ wrId: 1, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, sgList: [good], remoteAddr: 0, rkey: 1, compareAdd: 1 }],
        [{ wrId: 1, opcode: WrOpcode.ATOMIC_CMP_AND_SWP, sgList: [sge(m, 0, 4)], remoteAddr: 0, rkey: 1, compareAdd: 1n, swap: 2n }],
        [{ wrId: 1, opcode: WrOpcode.BIND_MW }],
      ];
      assert.deepEqual(rejectAll((l) => qp.postSend(l as never), sends, "postSend"), []);
      const recvs: unknown[] = [null, 7, {}, [null], [{}], [{ wrId: "a" }], [{ wrId: 1, sgList: 5 }], [{ wrId: 1, sgList: [{ addr: "x", length: 1, lkey: 1 }] }], [{ wrId: 1, sgList: Array.from({ length: 99 }, () => good) }]];
      assert.deepEqual(rejectAll((l) => p.b.qp.postRecv(l as never), recvs, "postRecv"), []);
      m.deregister();
      // After all that, the pair still carries data.
      await pingPong(p);
    }));

  it(
    "qp.postSend: out-of-range fields are refused at post",
    () =>
      withPair(async (p) => {
        const m = mr(p.a, 64);
        const good = sge(m, 0, 8);
        const sends: unknown[] = [
          [{ wrId: 1, opcode: WrOpcode.SEND, flags: 1 << 8, sgList: [good] }],
          [{ wrId: 1, opcode: WrOpcode.SEND, sgList: [{ addr: -1, length: 8, lkey: m.lkey }] }],
          [{ wrId: 1, opcode: WrOpcode.SEND_WITH_IMM, imm: -(2 ** 40), sgList: [good] }],
          [{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, sgList: [good] }],
          [{ wrId: 1, opcode: WrOpcode.RDMA_READ, sgList: [good], remoteAddr: 0, rkey: "r" }],
          [{ wrId: 1, opcode: WrOpcode.BIND_MW, mw: {}, bindRkey: 1, bind: { mr: m, addr: m.addr, length: 8, access: 0 } }],
          [{ wrId: 1, opcode: WrOpcode.LOCAL_INV, invalidateRkey: "x" }],
        ];
        // Each on a fresh QP state would be ideal; a rejected post leaves the QP as it was,
        // so one pair suffices when the provider rejects them all.
        assert.deepEqual(rejectAll((l) => p.a.qp.postSend(l as never), sends, "postSend"), []);
      }),
  );
});
