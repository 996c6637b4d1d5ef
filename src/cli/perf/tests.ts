/**
 * The tests of `async-rdma perf`: the bandwidth pump, and each test's client and server sides per message size.
 */
import { type BwRow, type LatRow, bwStats, latStats } from "./stats.js";
import { CTRL_IMM, LEASE_MS, type PerfOptions, TIMEOUT_MS, isAtomic } from "./options.js";
import { type Ctrl, immediate, num, progress, recvCtrl, sendCtrl, trace } from "./control.js";
import { type Rdma, RdmaError, type RemoteMr } from "../../index.js";

/** A growable array of timestamps (ms) without per-sample allocation. */
export class Stamps {
  a: Float64Array;
  n = 0;
  constructor(cap: number) {
    this.a = new Float64Array(Math.max(16, cap));
  }
  push(t: number): void {
    if (this.n === this.a.length) {
      const b = new Float64Array(this.a.length * 2);
      b.set(this.a);
      this.a = b;
    }
    this.a[this.n++] = t;
  }
}

/**
 * Keeps `depth` operations in flight per connection until `perConn` have
 * been issued on each (or `durationMs` has passed), recording every
 * completion time. `op(c)` posts one operation on connection c.
 */
export function pump(qps: number, depth: number, perConn: number, durationMs: number | null, op: (c: number) => Promise<unknown>, stamps: Stamps | null): Promise<{ start: number; count: number }> {
  return new Promise((resolve, reject) => {
    const posted = new Array<number>(qps).fill(0);
    const inflight = new Array<number>(qps).fill(0);
    let count = 0;
    let stop = false;
    let failed = false;
    const start = performance.now();
    const deadline = durationMs === null ? Infinity : start + durationMs;
    const fail = (e: unknown): void => {
      if (failed) return;
      failed = true;
      stop = true;
      reject(e);
    };
    const fill = (c: number): void => {
      while (!stop && inflight[c]! < depth && posted[c]! < perConn) {
        posted[c]!++;
        inflight[c]!++;
        progress.posted++;
        op(c).then(oks[c], fail);
      }
    };
    const finish = (): void => {
      for (let c = 0; c < qps; c++) if (inflight[c]! > 0 || (!stop && posted[c]! < perConn)) return;
      if (!failed) resolve({ start, count });
    };
    const oks = Array.from({ length: qps }, (_, c) => (): void => {
      const t = performance.now();
      stamps?.push(t);
      count++;
      progress.completed++;
      inflight[c]!--;
      if (t >= deadline) stop = true;
      fill(c);
      if (inflight[c] === 0) finish();
    });
    for (let c = 0; c < qps; c++) fill(c);
    if (perConn === 0) finish();
  });
}


export interface SizeResult {
  row: BwRow | LatRow;
  note?: string;
}

export interface Session {
  o: PerfOptions;
  conns: Rdma[];
  role: "client" | "server";
  txDepth: number;
  writeImm: boolean;
}

/** Client side of one size of a bandwidth test. */
export async function clientBw(s: Session, size: number, warm: number, iters: number): Promise<SizeResult> {
  const { o, conns } = s;
  const c0 = conns[0]!;
  const q = conns.length;
  const opSize = isAtomic(o.test) ? 8 : size;
  const lmr = c0.allocLocalMr(opSize);
  const rmrs: RemoteMr[] = [];
  try {
    if (o.test !== "send_bw") for (const c of conns) rmrs.push(await c.requestRemoteMr(opSize, { timeoutMs: TIMEOUT_MS, leaseMs: LEASE_MS }));
    let op: (c: number) => Promise<unknown>;
    switch (o.test) {
      case "write_bw":
        op = (c) => conns[c]!.write(lmr, rmrs[c]!);
        break;
      case "read_bw":
        op = (c) => conns[c]!.read(lmr, rmrs[c]!);
        break;
      case "atomic_bw":
        op = (c) => conns[c]!.fetchAndAdd(rmrs[c]!, 1n);
        break;
      default:
        op = (c) => conns[c]!.send(lmr);
    }
    const depth = s.txDepth;
    const perConnWarm = Math.ceil(warm / q);
    trace(`size ${size}: warm-up (${warm})`);
    await pump(q, depth, perConnWarm, null, op, null);
    // send_bw: each connection's receiver learns where warm-up ends; otherwise only connection 0 carries control.
    for (const c of o.test === "send_bw" ? conns : [c0]) await sendCtrl(c, { type: "measure", iters });
    const stamps = new Stamps(o.duration === null ? iters * q : 1 << 16);
    trace(`size ${size}: measure (${iters})`);
    const r = await pump(q, depth, o.duration === null ? iters : Number.MAX_SAFE_INTEGER, o.duration === null ? null : o.duration * 1000, op, stamps);
    const row = bwStats(size, r.count, r.start, stamps.a, depth * q, o.gbits);
    if (o.test === "send_bw") for (const c of conns) await sendCtrl(c, { type: "phase_end" });
    return { row };
  } finally {
    for (const r of rmrs) r.dispose();
    lmr.dispose();
  }
}

/** Server side of send_bw for one size: receive everything, measure the receive rate. */
export async function serverSendBw(s: Session, size: number): Promise<SizeResult> {
  const { o, conns } = s;
  const stamps = new Stamps(1 << 16);
  let measureStart = Infinity;
  await Promise.all(
    conns.map(async (c) => {
      // warm-up data until "measure", then measured data until "phase_end"
      for (let phase = 0; phase < 2; ) {
        const { mr, imm } = await c.receiveWithImm();
        if (imm === CTRL_IMM) {
          const m = JSON.parse(Buffer.from(mr.bytes).toString("utf8")) as Ctrl;
          mr.dispose();
          if (m.type === "measure") measureStart = Math.min(measureStart, performance.now());
          phase++;
          continue;
        }
        if (phase === 1) stamps.push(performance.now());
        mr.dispose();
      }
    }),
  );
  const row = bwStats(size, stamps.n, measureStart === Infinity ? performance.now() : measureStart, stamps.a, s.txDepth * conns.length, o.gbits);
  return { row, note: "receive side" };
}

/** One latency sample per iteration; for -D, iterations are sized from the warm-up rate. */
export async function clientLat(s: Session, size: number, warm: number, iters: number): Promise<SizeResult> {
  const { o } = s;
  const rdma = s.conns[0]!;
  const ctx = await latSetup(s, size);
  try {
    const t0 = performance.now();
    trace(`size ${size}: warm-up (${warm})`);
    for (let i = 0; i < warm; i++) await ctx.iter(i);
    trace(`size ${size}: measure`);
    const per = (performance.now() - t0) / Math.max(1, warm);
    const n = o.duration === null ? iters : Math.max(5, Math.ceil((o.duration * 1000) / Math.max(per, 1e-3)));
    await sendCtrl(rdma, { type: "measure", iters: n });
    const samples = new Float64Array(n);
    const half = ctx.pingPong ? 2 : 1;
    for (let i = 0; i < n; i++) {
      const a = performance.now();
      await ctx.iter(warm + i);
      samples[i] = ((performance.now() - a) * 1000) / half;
    }
    return { row: latStats(size, samples, n), ...(ctx.note ? { note: ctx.note } : {}) };
  } finally {
    await ctx.done();
  }
}

export async function serverLat(s: Session, size: number, warm: number): Promise<void> {
  const rdma = s.conns[0]!;
  const ctx = await latSetup(s, size);
  try {
    for (let i = 0; i < warm; i++) await ctx.iter(i);
    const n = num(await recvCtrl(rdma, "measure"), "iters");
    for (let i = 0; i < n; i++) await ctx.iter(warm + i);
  } finally {
    await ctx.done();
  }
}

export interface LatCtx {
  /** One iteration (client: the timed operation; server: its half of the ping-pong, nothing for one-sided tests). */
  iter: (i: number) => Promise<void>;
  pingPong: boolean;
  note?: string;
  done: () => Promise<void>;
}

/** Stamp for iteration i in the last byte of a ping-pong buffer: 1..255, never the initial 0. */
export const stamp = (i: number): number => (i % 255) + 1;

export async function latSetup(s: Session, size: number): Promise<LatCtx> {
  const { o, role } = s;
  const rdma = s.conns[0]!;
  const client = role === "client";
  switch (o.test) {
    case "read_lat":
    case "atomic_lat": {
      if (!client) return { iter: () => Promise.resolve(), pingPong: false, done: () => Promise.resolve() };
      const opSize = o.test === "atomic_lat" ? 8 : size;
      const lmr = rdma.allocLocalMr(opSize);
      const rmr = await rdma.requestRemoteMr(opSize, { timeoutMs: TIMEOUT_MS, leaseMs: LEASE_MS });
      const iter = o.test === "read_lat" ? async (): Promise<void> => void (await rdma.read(lmr, rmr)) : async (): Promise<void> => void (await rdma.fetchAndAdd(rmr, 1n));
      return {
        iter,
        pingPong: false,
        done: async () => {
          rmr.dispose();
          lmr.dispose();
        },
      };
    }
    case "send_lat": {
      const lmr = rdma.allocLocalMr(size);
      const iter = client
        ? async (): Promise<void> => {
            const p = rdma.send(lmr);
            const m = await rdma.receive();
            m.dispose();
            await p;
          }
        : async (): Promise<void> => {
            const m = await rdma.receive();
            m.dispose();
            await rdma.send(lmr);
          };
      return { iter, pingPong: true, done: async () => lmr.dispose() };
    }
    case "write_lat":
      return s.writeImm ? writeLatImm(s, size) : writeLatPoll(s, size);
    default:
      throw new Error(`not a latency test: ${o.test}`);
  }
}

/**
 * write_lat as an async-rdma application would write it: RDMA WRITE with
 * immediate into memory from requestRemoteMr; the peer learns of the data
 * from receiveWriteImm() and answers the same way.
 */
export async function writeLatImm(s: Session, size: number): Promise<LatCtx> {
  const rdma = s.conns[0]!;
  const lmr = rdma.allocLocalMr(size);
  const rmr = await rdma.requestRemoteMr(size, { timeoutMs: TIMEOUT_MS, leaseMs: LEASE_MS });
  // Both sides hold the other's memory before the first write.
  if (s.role === "client") await recvCtrl(rdma, "ready");
  else await sendCtrl(rdma, { type: "ready" });
  const iter =
    s.role === "client"
      ? async (i: number): Promise<void> => {
          const p = rdma.writeWithImm(lmr, rmr, i >>> 0);
          await rdma.receiveWriteImm();
          await p;
        }
      : async (i: number): Promise<void> => {
          await rdma.receiveWriteImm();
          await rdma.writeWithImm(lmr, rmr, i >>> 0);
        };
  return {
    iter,
    pingPong: true,
    note: "write with imm",
    done: async () => {
      rmr.dispose();
      lmr.dispose();
    },
  };
}

/**
 * write_lat as perftest does it: each side RDMA-WRITEs into the other's
 * buffer and polls the last byte of its own buffer for the iteration's
 * stamp. The polled buffer must be memory the poller owns and the peer may
 * write: each side registers its own ArrayBuffer (registerMr) and lends it
 * with sendLocalMr, keeping its own view of the buffer (on verbs the NIC
 * writes it directly; on tcp the provider copies into it from the socket, so
 * polling yields to the event loop between looks). On verbs a short
 * synchronous spin comes first.
 */
export async function writeLatPoll(s: Session, size: number): Promise<LatCtx> {
  const rdma = s.conns[0]!;
  const src = rdma.allocLocalMr(size);
  const srcView = src.bytes;
  // The polled buffer is this program's own ArrayBuffer, registered and lent:
  // the library never detaches a caller's buffer (pool memory would be
  // detached while lent), so this side can keep looking at it.
  const dstBuf = new ArrayBuffer(size);
  const dstView = new Uint8Array(dstBuf);
  const dst = rdma.registerMr(dstBuf);
  await rdma.sendLocalMr(dst, { leaseMs: LEASE_MS });
  const rmr = await rdma.receiveRemoteMr();
  if (dstView.length !== size) throw new RdmaError("INVALID_STATE", "perf write_lat: this provider detaches lent memory, so its buffer cannot be polled; use --write_imm");
  const last = size - 1;
  const spin = rdma.provider === "verbs" ? 2000 : 0;
  const wait = async (v: number): Promise<void> => {
    for (;;) {
      for (let k = 0; k < spin; k++) if (Atomics.load(dstView, last) === v) return;
      if (dstView[last] === v) return;
      await immediate();
    }
  };
  let prev: Promise<void> | null = null;
  const write = (i: number): Promise<void> => {
    srcView[last] = stamp(i);
    return rdma.write(src, rmr);
  };
  const iter =
    s.role === "client"
      ? async (i: number): Promise<void> => {
          const p = write(i);
          await wait(stamp(i));
          await p;
        }
      : async (i: number): Promise<void> => {
          await wait(stamp(i));
          if (prev) await prev;
          prev = write(i);
        };
  return {
    iter,
    pingPong: true,
    done: async () => {
      if (prev) await prev;
      // Give the peer's buffer back, then learn (in order, on the same connection) that ours came back.
      rmr.dispose();
      if (s.role === "client") {
        await sendCtrl(rdma, { type: "returned" });
        await recvCtrl(rdma, "returned");
      } else {
        await recvCtrl(rdma, "returned");
        await sendCtrl(rdma, { type: "returned" });
      }
      src.dispose();
      try {
        dst.dispose();
      } catch {
        /* still lent (the peer did not return it): freed with the connection */
      }
    },
  };
}

