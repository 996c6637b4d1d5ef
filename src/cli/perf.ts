/**
 * `async-rdma perf <test> [server]`: perftest's tests and columns on the
 * public async-rdma API.
 *
 * Roles as in perftest: without an address this is the server (it waits for
 * one client, runs the test, exits); with one it is the client. The client
 * drives: it sends the test configuration over the library's own connection
 * (a SEND with immediate data CTRL_IMM, which the server takes from
 * receiveWithImm()), then per message size a "size" message, a warm-up, a
 * "measure" message and a "result" message, and finally "end". Target memory
 * comes from requestRemoteMr (write/read/atomic), except write_lat's
 * perftest-style buffer polling, which needs memory the polling side owns and
 * so lends it with sendLocalMr (see runWriteLat).
 *
 * Only the public API is used (../index.js): what this measures is what an
 * application gets.
 */
import { writeFileSync } from "node:fs";
import { progressLine } from "./progress.js";
import { RdmaBuilder, RdmaError, type LocalMr, type PollingMode, type ProviderChoice, type Rdma, type RdmaListener, type RemoteMr } from "../index.js";

export const PERF_TESTS = ["write_bw", "read_bw", "send_bw", "atomic_bw", "write_lat", "read_lat", "send_lat", "atomic_lat"] as const;
export type PerfTest = (typeof PERF_TESTS)[number];

/** Immediate data marking a control message (test parameters, phase markers, results). */
const CTRL_IMM = 0x70657266; // "perf"
const PROTOCOL = 1;
const DEFAULT_PORT = 18515;
const MAX_SIZE = 1 << 26; // the default remote-memory quota per connection (64 MiB)
const LEASE_MS = 3_600_000;
const TIMEOUT_MS = 30_000;

export const PERF_USAGE = `usage: async-rdma perf <test> [server-address] [options]
  tests: ${PERF_TESTS.join(", ")}
  server: no address (waits for one client); client: the server's address
  -s, --size BYTES        message size (default 65536 for bandwidth, 2 for latency; atomics: 8)
  -n, --iters N           iterations (default 5000 for bandwidth, 1000 for latency)
  -a, --all               all sizes 2 .. 2^23 (atomics: 8 only)
      --sizes A,B,...     these sizes in this order (repeats allowed: one process pair, several runs)
      --warmup N          warm-up operations per size (default: enough for the JIT, see docs/performance.md)
  -D, --duration SECONDS  run for this long instead of -n iterations
  -q, --qp N              connections (bandwidth tests; default 1)
  -t, --tx-depth N        operations in flight per connection (bandwidth; default 128)
  -d, --ib-dev NAME       device (e.g. rxe0)
  -x, --gid-index N       GID index (verbs)
  -p, --port PORT         side-channel port (default ${DEFAULT_PORT}; 0 = any, the server prints it)
      --report_gbits      bandwidth in Gb/s instead of MB/s (MB = 2^20 bytes, as perftest)
      --provider P        tcp | verbs | auto (default auto)
      --polling MODE      event | busy | adaptive (default: the library's)
      --write_imm         write_lat: notify by RDMA WRITE with immediate instead of buffer polling
      --json              one JSON object per line instead of tables
      --plot FILE.svg     with -a: bandwidth or latency vs size as an SVG (client side)
  -h, --help
  The client's parameters apply to both sides; the server takes only the test,
  -p, -d, -x, --provider, --polling and --json.`;

export class PerfUsageError extends Error {}

export interface PerfOptions {
  test: PerfTest;
  server: string | null;
  port: number;
  size: number | null;
  iters: number | null;
  all: boolean;
  sizes: number[] | null;
  warmup: number | null;
  duration: number | null;
  qps: number;
  txDepth: number;
  device: string | null;
  gidIndex: number | null;
  gbits: boolean;
  provider: ProviderChoice;
  polling: PollingMode | null;
  writeImm: boolean;
  json: boolean;
  plot: string | null;
}

const isBw = (t: PerfTest): boolean => t.endsWith("_bw");
const isAtomic = (t: PerfTest): boolean => t.startsWith("atomic");

function intArg(flag: string, v: string | undefined, min: number, max: number): number {
  if (v === undefined) throw new PerfUsageError(`${flag} needs a value`);
  const m = /^(\d+)([kKmMgG]?)$/.exec(v);
  if (!m) throw new PerfUsageError(`${flag}: not a non-negative integer: ${v}`);
  const mult = { "": 1, k: 1024, m: 1 << 20, g: 1 << 30 }[m[2]!.toLowerCase() as "" | "k" | "m" | "g"];
  const n = Number(m[1]) * mult;
  if (!Number.isSafeInteger(n) || n < min || n > max) throw new PerfUsageError(`${flag} must be between ${min} and ${max}, got ${v}`);
  return n;
}

/** Parses perftest-style arguments; throws PerfUsageError on anything wrong. */
export function parsePerfArgs(argv: string[]): PerfOptions {
  const o: PerfOptions = { test: "write_bw", server: null, port: DEFAULT_PORT, size: null, iters: null, all: false, sizes: null, warmup: null, duration: null, qps: 1, txDepth: 128, device: null, gidIndex: null, gbits: false, provider: "auto", polling: null, writeImm: false, json: false, plot: null };
  const pos: string[] = [];
  let durationSet = false;
  for (let i = 0; i < argv.length; i++) {
    let a = argv[i]!;
    let inline: string | undefined;
    const eq = a.startsWith("--") ? a.indexOf("=") : -1;
    if (eq > 0) {
      inline = a.slice(eq + 1);
      a = a.slice(0, eq);
    }
    const val = (): string | undefined => inline ?? argv[++i];
    switch (a) {
      case "-h":
      case "--help":
        throw new PerfUsageError("");
      case "-s":
      case "--size":
        o.size = intArg(a, val(), 1, MAX_SIZE);
        break;
      case "-n":
      case "--iters":
        o.iters = intArg(a, val(), 5, 100_000_000);
        break;
      case "-a":
      case "--all":
        o.all = true;
        break;
      case "--sizes": {
        const v = val();
        if (!v) throw new PerfUsageError("--sizes needs a comma-separated list of sizes");
        o.sizes = v.split(",").map((x) => intArg("--sizes", x.trim(), 1, MAX_SIZE));
        break;
      }
      case "--warmup":
        o.warmup = intArg(a, val(), 0, 100_000_000);
        break;
      case "-D":
      case "--duration":
        o.duration = intArg(a, val(), 1, 86_400);
        durationSet = true;
        break;
      case "-q":
      case "--qp":
        o.qps = intArg(a, val(), 1, 1024);
        break;
      case "-t":
      case "--tx-depth":
        o.txDepth = intArg(a, val(), 1, 16384);
        break;
      case "-d":
      case "--ib-dev": {
        const v = val();
        if (!v) throw new PerfUsageError(`${a} needs a device name`);
        o.device = v;
        break;
      }
      case "-x":
      case "--gid-index":
        o.gidIndex = intArg(a, val(), 0, 255);
        break;
      case "-p":
      case "--port":
        o.port = intArg(a, val(), 0, 65535);
        break;
      case "--report_gbits":
      case "--report-gbits":
        o.gbits = true;
        break;
      case "--provider": {
        const v = val();
        if (v !== "tcp" && v !== "verbs" && v !== "auto") throw new PerfUsageError(`--provider must be tcp, verbs or auto, got ${v ?? "nothing"}`);
        o.provider = v;
        break;
      }
      case "--polling": {
        const v = val();
        if (v !== "event" && v !== "busy" && v !== "adaptive") throw new PerfUsageError(`--polling must be event, busy or adaptive, got ${v ?? "nothing"}`);
        o.polling = v;
        break;
      }
      case "--write_imm":
      case "--write-imm":
        o.writeImm = true;
        break;
      case "--json":
        o.json = true;
        break;
      case "--plot": {
        const v = val();
        if (!v) throw new PerfUsageError("--plot needs a file name");
        o.plot = v;
        break;
      }
      default:
        if (a.startsWith("-")) throw new PerfUsageError(`unknown option ${a}`);
        pos.push(a);
    }
    if (inline !== undefined && !["-s", "--size", "-n", "--iters", "-D", "--duration", "-q", "--qp", "-t", "--tx-depth", "-d", "--ib-dev", "-x", "--gid-index", "-p", "--port", "--provider", "--polling", "--plot", "--sizes", "--warmup"].includes(a)) {
      throw new PerfUsageError(`${a} takes no value`);
    }
  }
  if (pos.length === 0) throw new PerfUsageError("which test? (one of " + PERF_TESTS.join(", ") + ")");
  if (pos.length > 2) throw new PerfUsageError(`unexpected argument ${pos[2]}`);
  if (!(PERF_TESTS as readonly string[]).includes(pos[0]!)) throw new PerfUsageError(`unknown test ${pos[0]} (one of ${PERF_TESTS.join(", ")})`);
  o.test = pos[0] as PerfTest;
  o.server = pos[1] ?? null;
  if ([o.all, o.size !== null, o.sizes !== null].filter(Boolean).length > 1) throw new PerfUsageError("-a, -s and --sizes exclude each other");
  if (isAtomic(o.test) && o.sizes !== null && o.sizes.some((x) => x !== 8)) throw new PerfUsageError("atomic tests operate on 8 bytes; --sizes may only list 8");
  if (durationSet && o.iters !== null) throw new PerfUsageError("-D and -n exclude each other");
  if (isAtomic(o.test) && o.size !== null && o.size !== 8) throw new PerfUsageError("atomic tests operate on 8 bytes; -s must be 8 or absent");
  if (!isBw(o.test) && o.qps !== 1) throw new PerfUsageError("-q applies to bandwidth tests only (latency tests use one connection, as perftest)");
  if (o.writeImm && o.test !== "write_lat") throw new PerfUsageError("--write_imm applies to write_lat only");
  if (o.plot !== null && !o.all && o.sizes === null) throw new PerfUsageError("--plot draws a size sweep: use it with -a (or --sizes)");
  if (o.plot !== null && !o.plot.endsWith(".svg")) throw new PerfUsageError("--plot writes SVG: give a file name ending in .svg");
  return o;
}

// ------------------------------------------------------------------ sizes

function sizesOf(o: PerfOptions): number[] {
  if (o.sizes !== null) return o.sizes;
  if (isAtomic(o.test)) return [8];
  if (o.all) return Array.from({ length: 23 }, (_, i) => 2 << i);
  return [o.size ?? (isBw(o.test) ? 65536 : 2)];
}

/**
 * Iterations for one size. perftest keeps -n fixed across -a; on a software
 * transport 5000 × 8 MiB would take minutes, so without an explicit -n a
 * sweep (-a or --sizes) caps each size at 1 GiB (bandwidth) or 256 MiB
 * (latency) moved.
 */
function itersFor(o: PerfOptions, size: number): number {
  if (o.iters !== null) return o.iters;
  const def = isBw(o.test) ? 5000 : 1000;
  if (!o.all && o.sizes === null) return def;
  return Math.max(isBw(o.test) ? 64 : 100, Math.min(def, Math.floor((isBw(o.test) ? 2 ** 30 : 2 ** 28) / size)));
}

/** Warm-up operations before measuring: enough for the JIT and the window, bounded in bytes. */
function warmFor(test: PerfTest, size: number, txDepth: number, qps: number): number {
  const byBytes = Math.max(16, Math.floor((isBw(test) ? 2 ** 28 : 2 ** 26) / size));
  return Math.min(Math.max(isBw(test) ? 2 * txDepth * qps : 200, 1000), byBytes);
}

// ------------------------------------------------------------- statistics

export interface BwRow {
  bytes: number;
  iterations: number;
  bwPeak: number;
  bwAvg: number;
  msgRate: number;
  unit: "MB/sec" | "Gb/sec";
  seconds: number;
}

export interface LatRow {
  bytes: number;
  iterations: number;
  tMin: number;
  tMax: number;
  tTypical: number;
  tAvg: number;
  tStdev: number;
  p99: number;
  p999: number;
}

/** perftest's units: MB = 2^20 bytes; Gb = 10^9 bits. */
function bwUnit(bytesPerSec: number, gbits: boolean): number {
  return gbits ? (bytesPerSec * 8) / 1e9 : bytesPerSec / 1048576;
}

/**
 * Average: bytes over first post → last completion. Peak: the best rate over
 * any stretch of max(k, 10 % of the run) consecutive completions (k = the
 * operations in flight): completions arrive in bursts (one ACK covers many
 * writes), so shorter stretches would report bursts, not bandwidth. A run no
 * longer than that reports peak = average.
 * perftest's peak is a best-case figure too.
 */
export function bwStats(size: number, count: number, start: number, done: Float64Array, k: number, gbits: boolean): BwRow {
  const end = count > 0 ? done[count - 1]! : start;
  const sec = Math.max(1e-9, (end - start) / 1000);
  const avg = (size * count) / sec;
  let peak = avg;
  // With no more completions than the window, every operation was in flight at once: no stretch to judge a peak by.
  const w = Math.max(1, k, Math.ceil(count / 10));
  if (count > w) {
    let best = Infinity;
    for (let j = w; j < count; j++) {
      const dt = done[j]! - done[j - w]!;
      if (dt > 0 && dt < best) best = dt;
    }
    if (best !== Infinity) peak = Math.max(avg, (size * w) / (best / 1000));
  }
  return { bytes: size, iterations: count, bwPeak: bwUnit(peak, gbits), bwAvg: bwUnit(avg, gbits), msgRate: count / sec / 1e6, unit: gbits ? "Gb/sec" : "MB/sec", seconds: sec };
}

/** Latency statistics in µs over `n` samples; typical = median (as perftest). */
export function latStats(size: number, samples: Float64Array, n: number): LatRow {
  const s = samples.slice(0, n).sort();
  let sum = 0;
  for (let i = 0; i < n; i++) sum += s[i]!;
  const avg = sum / n;
  let sq = 0;
  for (let i = 0; i < n; i++) sq += (s[i]! - avg) ** 2;
  const pct = (p: number): number => s[Math.min(n - 1, Math.max(0, Math.ceil(p * n) - 1))]!;
  return { bytes: size, iterations: n, tMin: s[0]!, tMax: s[n - 1]!, tTypical: s[Math.floor(n / 2)]!, tAvg: avg, tStdev: Math.sqrt(sq / n), p99: pct(0.99), p999: pct(0.999) };
}

// ---------------------------------------------------------------- output

const RULE = "-".repeat(87);

const TITLES: Record<PerfTest, string> = {
  write_bw: "RDMA_Write BW Test",
  read_bw: "RDMA_Read BW Test",
  send_bw: "Send BW Test",
  atomic_bw: "Atomic FETCH_AND_ADD BW Test",
  write_lat: "RDMA_Write Latency Test",
  read_lat: "RDMA_Read Latency Test",
  send_lat: "Send Latency Test",
  atomic_lat: "Atomic FETCH_AND_ADD Latency Test",
};

function out(line: string): void {
  process.stdout.write(line + "\n");
}

function json(o: Record<string, unknown>): void {
  out(JSON.stringify(o));
}

function header(o: PerfOptions, role: string, rdma: Rdma, qps: number, txDepth: number, extra: string): void {
  if (o.json) return;
  const lat = !isBw(o.test);
  out(RULE);
  out(`                    ${TITLES[o.test]}`);
  out(` Provider        : ${rdma.provider.padEnd(14)} Device         : ${rdma.deviceName}`);
  out(` Number of qps   : ${String(qps).padEnd(14)} Transport type : RC (async-rdma)`);
  out(` Role            : ${role.padEnd(14)} ${lat ? "Iteration" : "TX depth      "} : ${lat ? "one operation at a time" : txDepth}`);
  out(` Memory          : ${extra}`);
  out(RULE);
  if (lat) out(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ");
  else {
    const u = o.gbits ? "Gb/sec" : "MB/sec";
    out(` #bytes     #iterations    BW peak[${u}]    BW average[${u}]   MsgRate[Mpps]`);
  }
}

function printRow(o: PerfOptions, role: string, provider: string, row: BwRow | LatRow, note?: string): void {
  if (o.json) {
    json({ type: "result", test: o.test, role, provider, ...row, ...(note ? { note } : {}) });
    return;
  }
  if ("bwAvg" in row) {
    out(` ${String(row.bytes).padEnd(10)} ${String(row.iterations).padEnd(14)} ${row.bwPeak.toFixed(2).padStart(12)}       ${row.bwAvg.toFixed(2).padStart(12)}          ${row.msgRate.toFixed(6)}${note ? `   (${note})` : ""}`);
  } else {
    const f = (v: number): string => v.toFixed(2).padEnd(14);
    out(` ${String(row.bytes).padEnd(7)} ${String(row.iterations).padEnd(12)} ${f(row.tMin)} ${f(row.tMax)} ${f(row.tTypical)}   ${f(row.tAvg)}   ${f(row.tStdev)}   ${f(row.p99)}         ${f(row.p999)}${note ? `  (${note})` : ""}`);
  }
}

// --------------------------------------------------------------- control

type Ctrl = Record<string, unknown> & { type: string };

async function sendCtrl(rdma: Rdma, msg: Ctrl): Promise<void> {
  const bytes = Buffer.from(JSON.stringify(msg));
  const lmr = rdma.allocLocalMr(bytes.length);
  try {
    lmr.bytes.set(bytes);
    await rdma.sendWithImm(lmr, CTRL_IMM);
  } finally {
    lmr.dispose();
  }
}

async function recvCtrl(rdma: Rdma, expect?: string): Promise<Ctrl> {
  const { mr, imm } = await rdma.receiveWithImm();
  try {
    if (imm !== CTRL_IMM) throw new RdmaError("PROTOCOL", `perf: expected a control message${expect ? ` (${expect})` : ""}, got a ${mr.length}-byte data message`);
    const msg = JSON.parse(Buffer.from(mr.bytes).toString("utf8")) as Ctrl;
    if (msg.type === "error") throw new RdmaError("PROTOCOL", `perf: the peer says: ${String(msg.message)}`);
    if (expect !== undefined && msg.type !== expect) throw new RdmaError("PROTOCOL", `perf: expected "${expect}", got "${msg.type}"`);
    return msg;
  } finally {
    mr.dispose();
  }
}

function num(m: Ctrl, k: string): number {
  const v = m[k];
  if (typeof v !== "number" || !Number.isFinite(v)) throw new RdmaError("PROTOCOL", `perf: control message "${m.type}" lacks a numeric ${k}`);
  return v;
}

const immediate = (): Promise<void> => new Promise((r) => setImmediate(r));

/**
 * ASYNC_RDMA_PERF_TRACE=1: phases on stderr with timestamps, and on SIGTERM
 * (e.g. from `timeout`) where the run stood — for diagnosing a stuck run.
 */
const TRACE = !!process.env.ASYNC_RDMA_PERF_TRACE;
const progress = { phase: "start", posted: 0, completed: 0 };
function trace(phase: string): void {
  progress.phase = phase;
  if (TRACE) process.stderr.write(`[perf ${(performance.now() / 1000).toFixed(3)} s] ${phase}\n`);
}
if (TRACE) {
  process.on("SIGTERM", () => {
    process.stderr.write(`[perf] SIGTERM in phase "${progress.phase}": ${progress.posted} operations posted, ${progress.completed} completed\n`);
    process.exit(143);
  });
}

// --------------------------------------------------------- bandwidth core

/** A growable array of timestamps (ms) without per-sample allocation. */
class Stamps {
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
function pump(qps: number, depth: number, perConn: number, durationMs: number | null, op: (c: number) => Promise<unknown>, stamps: Stamps | null): Promise<{ start: number; count: number }> {
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

// ------------------------------------------------------------ the runner

interface SizeResult {
  row: BwRow | LatRow;
  note?: string;
}

interface Session {
  o: PerfOptions;
  conns: Rdma[];
  role: "client" | "server";
  txDepth: number;
  writeImm: boolean;
}

/** Client side of one size of a bandwidth test. */
async function clientBw(s: Session, size: number, warm: number, iters: number): Promise<SizeResult> {
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
async function serverSendBw(s: Session, size: number): Promise<SizeResult> {
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
async function clientLat(s: Session, size: number, warm: number, iters: number): Promise<SizeResult> {
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

async function serverLat(s: Session, size: number, warm: number): Promise<void> {
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

interface LatCtx {
  /** One iteration (client: the timed operation; server: its half of the ping-pong, nothing for one-sided tests). */
  iter: (i: number) => Promise<void>;
  pingPong: boolean;
  note?: string;
  done: () => Promise<void>;
}

/** Stamp for iteration i in the last byte of a ping-pong buffer: 1..255, never the initial 0. */
const stamp = (i: number): number => (i % 255) + 1;

async function latSetup(s: Session, size: number): Promise<LatCtx> {
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
async function writeLatImm(s: Session, size: number): Promise<LatCtx> {
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
async function writeLatPoll(s: Session, size: number): Promise<LatCtx> {
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

// ------------------------------------------------------------ the roles

function builderFor(o: PerfOptions): RdmaBuilder {
  const b = new RdmaBuilder().setProvider(o.provider);
  if (o.device !== null) b.setDevice(o.device);
  if (o.gidIndex !== null) b.setGidIndex(o.gidIndex);
  if (o.polling !== null) b.setPolling(o.polling);
  if (o.txDepth > 256) b.setQpCaps({ maxSendWr: o.txDepth + 16 });
  return b;
}

async function runServer(opts: PerfOptions): Promise<void> {
  let o = opts;
  const listener: RdmaListener = await builderFor(o).bind({ host: "0.0.0.0", port: o.port });
  const conns: Rdma[] = [];
  try {
    const port = listener.port;
    if (o.json) json({ type: "listening", port, test: o.test });
    else out(` Waiting for client to connect... (port ${port}, test ${o.test})`);
    const c0 = await listener.accept();
    conns.push(c0);
    trace("accepted");
    const hello = await recvCtrl(c0, "hello");
    const problems: string[] = [];
    if (hello.protocol !== PROTOCOL) problems.push(`protocol ${String(hello.protocol)} (server ${PROTOCOL})`);
    if (hello.test !== o.test) problems.push(`test ${String(hello.test)} (server ${o.test})`);
    if (problems.length) {
      await sendCtrl(c0, { type: "error", message: `mismatch: client asks for ${problems.join(", ")}` }).catch(() => {});
      throw new RdmaError("PROTOCOL", `perf: the client asks for ${problems.join(", ")}`);
    }
    const qps = num(hello, "qps");
    o = { ...o, gbits: hello.gbits === true, qps };
    await sendCtrl(c0, { type: "hello_ok", provider: c0.provider });
    for (let i = 1; i < qps; i++) conns.push(await listener.accept({ timeoutMs: TIMEOUT_MS }));
    const s: Session = { o, conns, role: "server", txDepth: num(hello, "txDepth"), writeImm: hello.writeImm === true };
    header(o, "server", c0, qps, s.txDepth, o.test === "write_lat" && !s.writeImm ? "lends its buffer (sendLocalMr) and polls it" : "granted to the client (requestRemoteMr)");
    for (;;) {
      const m = await recvCtrl(c0);
      if (m.type === "end") break;
      if (m.type !== "size") throw new RdmaError("PROTOCOL", `perf: unexpected "${m.type}"`);
      const size = num(m, "size");
      const warm = num(m, "warm");
      trace(`size ${size}`);
      let own: SizeResult | null = null;
      if (o.test === "send_bw") own = await serverSendBw(s, size);
      else if (isBw(o.test)) await recvCtrl(c0, "measure");
      else await serverLat(s, size, warm);
      const res = await recvCtrl(c0, "result");
      if (own) printRow(o, "server", c0.provider, own.row, own.note);
      else printRow(o, "server", c0.provider, res.row as unknown as BwRow | LatRow, typeof res.note === "string" ? `${res.note}, measured by the client` : "measured by the client");
    }
    if (!o.json) out(RULE);
  } finally {
    await Promise.all(conns.map((c) => c.close().catch(() => {})));
    await listener.close();
  }
}

async function runClient(o: PerfOptions): Promise<void> {
  const b = builderFor(o);
  trace("connect");
  const c0 = await b.connect({ host: o.server!, port: o.port || DEFAULT_PORT });
  trace("connected");
  const conns: Rdma[] = [c0];
  const bar = progressLine();
  try {
    await sendCtrl(c0, { type: "hello", protocol: PROTOCOL, test: o.test, qps: o.qps, txDepth: o.txDepth, writeImm: o.writeImm, gbits: o.gbits });
    await recvCtrl(c0, "hello_ok");
    for (let i = 1; i < o.qps; i++) conns.push(await c0.newConnection());
    const s: Session = { o, conns, role: "client", txDepth: o.txDepth, writeImm: o.writeImm };
    header(o, "client", c0, o.qps, o.txDepth, o.test === "write_lat" && !o.writeImm ? "lends its buffer (sendLocalMr) and polls it" : o.test === "send_bw" || o.test === "send_lat" ? "posted receives (two-sided)" : "requestRemoteMr on the server");
    const rows: (BwRow | LatRow)[] = [];
    const sizes = sizesOf(o);
    for (const [k, size] of sizes.entries()) {
      if (sizes.length > 1) bar.update(`perf ${o.test}: ${size} bytes (${k + 1}/${sizes.length})`);
      const iters = itersFor(o, size);
      // -D on a latency test sizes its iterations from the warm-up rate, so it needs some warm-up
      const warm = Math.max(o.duration !== null && !isBw(o.test) ? 10 : 0, o.warmup ?? warmFor(o.test, size, o.txDepth, o.qps));
      await sendCtrl(c0, { type: "size", size, warm });
      const r = isBw(o.test) ? await clientBw(s, size, warm, iters) : await clientLat(s, size, warm, iters);
      rows.push(r.row);
      bar.clear();
      printRow(o, "client", c0.provider, r.row, r.note);
      await sendCtrl(c0, { type: "result", row: r.row as unknown as Record<string, unknown>, ...(r.note ? { note: r.note } : {}) });
    }
    await sendCtrl(c0, { type: "end" });
    if (!o.json) out(RULE);
    if (o.plot !== null) {
      writeFileSync(o.plot, renderPlot(o, c0.provider, rows));
      if (o.json) json({ type: "plot", file: o.plot });
      else out(` plot written to ${o.plot}`);
    }
  } finally {
    bar.clear();
    await Promise.all(conns.map((c) => c.close().catch(() => {})));
  }
}

/** Entry point: `async-rdma perf …`. Usage errors exit with status 2. */
export async function perf(argv: string[]): Promise<void> {
  let o: PerfOptions;
  try {
    o = parsePerfArgs(argv);
  } catch (e) {
    if (e instanceof PerfUsageError) {
      if (!e.message) {
        console.log(PERF_USAGE); // --help: usage on stdout, success
        process.exit(0);
      }
      console.error(`async-rdma perf: ${e.message}`);
      console.error(PERF_USAGE);
      process.exit(2);
    }
    throw e;
  }
  if (o.server === null) await runServer(o);
  else await runClient(o);
}

// ------------------------------------------------------------------- plot

const esc = (s: string): string => s.replace(/[<>&"]/g, (c) => ({ "<": "&lt;", ">": "&gt;", "&": "&amp;", '"': "&quot;" })[c]!);

function sizeLabel(n: number): string {
  if (n >= 1 << 20) return `${n / (1 << 20)}M`;
  if (n >= 1024) return `${n / 1024}K`;
  return String(n);
}

/** A log-log line chart (size on x, bandwidth or latency on y), self-contained SVG. */
export function renderPlot(o: PerfOptions, provider: string, rows: (BwRow | LatRow)[]): string {
  const W = 760;
  const H = 460;
  const L = 78;
  const R = 170;
  const T = 44;
  const B = 58;
  const bw = rows.length > 0 && "bwAvg" in rows[0]!;
  const series: { name: string; color: string; pts: [number, number][] }[] = bw
    ? [
        { name: "BW average", color: "#1f77b4", pts: (rows as BwRow[]).map((r) => [r.bytes, r.bwAvg]) },
        { name: "BW peak", color: "#ff7f0e", pts: (rows as BwRow[]).map((r) => [r.bytes, r.bwPeak]) },
      ]
    : [
        { name: "t_typical", color: "#1f77b4", pts: (rows as LatRow[]).map((r) => [r.bytes, r.tTypical]) },
        { name: "t_avg", color: "#2ca02c", pts: (rows as LatRow[]).map((r) => [r.bytes, r.tAvg]) },
        { name: "99%", color: "#d62728", pts: (rows as LatRow[]).map((r) => [r.bytes, r.p99]) },
      ];
  const xs = rows.map((r) => r.bytes);
  const ys = series.flatMap((s) => s.pts.map((p) => p[1])).filter((v) => v > 0);
  const x0 = Math.log2(Math.min(...xs, 2));
  const x1 = Math.max(x0 + 1, Math.log2(Math.max(...xs, 4)));
  const y0 = Math.floor(Math.log10(Math.min(...ys, 1)));
  const y1 = Math.max(y0 + 1, Math.ceil(Math.log10(Math.max(...ys, 1))));
  const r1 = (v: number): number => Math.round(v * 10) / 10;
  const px = (x: number): number => r1(L + ((Math.log2(x) - x0) / (x1 - x0)) * (W - L - R));
  const py = (y: number): number => r1(T + (1 - (Math.log10(Math.max(y, 10 ** y0)) - y0) / (y1 - y0)) * (H - T - B));
  const unit = bw ? (o.gbits ? "Gb/sec" : "MB/sec") : "usec";
  const parts: string[] = [];
  parts.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`);
  parts.push(`<rect width="${W}" height="${H}" fill="white"/>`);
  parts.push(`<text x="${W / 2}" y="22" text-anchor="middle" font-size="15">${esc(`async-rdma perf ${o.test} (${provider}${o.qps > 1 ? `, ${o.qps} qps` : ""})`)}</text>`);
  for (let e = y0; e <= y1; e++) {
    const y = py(10 ** e);
    parts.push(`<line x1="${L}" x2="${W - R}" y1="${y}" y2="${y}" stroke="#ddd"/>`);
    parts.push(`<text x="${L - 6}" y="${y + 4}" text-anchor="end">${10 ** e >= 1 ? String(10 ** e) : (10 ** e).toFixed(-e)}</text>`);
  }
  for (let e = Math.ceil(x0); e <= x1; e += 2) {
    const x = px(2 ** e);
    parts.push(`<line x1="${x}" x2="${x}" y1="${T}" y2="${H - B}" stroke="#eee"/>`);
    parts.push(`<text x="${x}" y="${H - B + 16}" text-anchor="middle">${sizeLabel(2 ** e)}</text>`);
  }
  parts.push(`<rect x="${L}" y="${T}" width="${W - L - R}" height="${H - T - B}" fill="none" stroke="#333"/>`);
  parts.push(`<text x="${(L + W - R) / 2}" y="${H - 14}" text-anchor="middle">message size [bytes]</text>`);
  parts.push(`<text transform="translate(18 ${(T + H - B) / 2}) rotate(-90)" text-anchor="middle">${bw ? `bandwidth [${unit}]` : `latency [${unit}]`}</text>`);
  series.forEach((s, k) => {
    const d = s.pts.filter((p) => p[1] > 0).map((p, i) => `${i ? "L" : "M"}${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
    parts.push(`<path d="${d}" fill="none" stroke="${s.color}" stroke-width="2"/>`);
    for (const p of s.pts) if (p[1] > 0) parts.push(`<circle cx="${px(p[0]).toFixed(1)}" cy="${py(p[1]).toFixed(1)}" r="2.5" fill="${s.color}"><title>${sizeLabel(p[0])}: ${p[1].toFixed(2)} ${unit}</title></circle>`);
    const ly = T + 10 + k * 20;
    parts.push(`<line x1="${W - R + 12}" x2="${W - R + 36}" y1="${ly}" y2="${ly}" stroke="${s.color}" stroke-width="2"/>`);
    parts.push(`<text x="${W - R + 42}" y="${ly + 4}">${esc(s.name)}</text>`);
  });
  parts.push(`</svg>`);
  return parts.join("\n") + "\n";
}
