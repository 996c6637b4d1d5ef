/**
 * Options of `async-rdma perf`: the tests, the usage text, argument parsing, and the sizes, iterations and warm-up per size.
 */
import { type PollingMode, type ProviderChoice } from "../../index.js";
export const PERF_TESTS = ["write_bw", "read_bw", "send_bw", "atomic_bw", "write_lat", "read_lat", "send_lat", "atomic_lat"] as const;
export type PerfTest = (typeof PERF_TESTS)[number];

/** Immediate data marking a control message (test parameters, phase markers, results). */
export const CTRL_IMM = 0x70657266; // "perf"
export const PROTOCOL = 1;
export const DEFAULT_PORT = 18515;
/** perftest's default receive depth (ib_send_bw -r). */
export const DEFAULT_RX_DEPTH = 512;
export const MAX_SIZE = 1 << 26; // the default remote-memory quota per connection (64 MiB)
export const LEASE_MS = 3_600_000;
export const TIMEOUT_MS = 30_000;

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
  -r, --rx-depth N        receive buffers per connection at most (default 512, as perftest; both sides)
  -d, --ib-dev NAME       device (e.g. rxe0)
  -x, --gid-index N       GID index (verbs)
  -p, --port PORT         side-channel port (default ${DEFAULT_PORT}; 0 = any, the server prints it)
      --report_gbits      bandwidth in Gb/s instead of MB/s (MB = 2^20 bytes, as perftest)
      --provider P        tcp | verbs | auto (default auto)
      --polling MODE      event | busy | adaptive (default: the library's)
      --eager-threshold BYTES  messages up to this size come to this side in one SEND
                          (default: the library's, 4160); larger ones by rendezvous READ.
                          send_bw: give it to the server (the receiver) to compare with
                          ib_send_bw, whose receives are posted at the message size
      --write_imm         write_lat: notify by RDMA WRITE with immediate instead of buffer polling
      --json              one JSON object per line instead of tables
      --plot FILE.svg     with -a: bandwidth or latency vs size as an SVG (client side)
  -h, --help
  The client's parameters apply to both sides; the server takes only the test,
  -p, -d, -x, -r, --provider, --polling, --eager-threshold and --json.`;

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
  /** Receive depth of each side's connections (setRecvDepth): how many messages its peer may have in flight to it. */
  rxDepth: number;
  device: string | null;
  gidIndex: number | null;
  gbits: boolean;
  provider: ProviderChoice;
  polling: PollingMode | null;
  /** This side's eager threshold (setEagerThreshold; null: the library's): the largest message its peer sends it without rendezvous. */
  eager: number | null;
  writeImm: boolean;
  json: boolean;
  plot: string | null;
}

export const isBw = (t: PerfTest): boolean => t.endsWith("_bw");
export const isAtomic = (t: PerfTest): boolean => t.startsWith("atomic");

export function intArg(flag: string, v: string | undefined, min: number, max: number): number {
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
  const o: PerfOptions = { test: "write_bw", server: null, port: DEFAULT_PORT, size: null, iters: null, all: false, sizes: null, warmup: null, duration: null, qps: 1, txDepth: 128, rxDepth: DEFAULT_RX_DEPTH, device: null, gidIndex: null, gbits: false, provider: "auto", polling: null, eager: null, writeImm: false, json: false, plot: null };
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
      case "-r":
      case "--rx-depth":
        o.rxDepth = intArg(a, val(), 8, 65536);
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
      case "--eager-threshold":
        o.eager = intArg(a, val(), 0, 1 << 20);
        break;
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
    if (inline !== undefined && !["-s", "--size", "-n", "--iters", "-D", "--duration", "-q", "--qp", "-t", "--tx-depth", "-r", "--rx-depth", "-d", "--ib-dev", "-x", "--gid-index", "-p", "--port", "--provider", "--polling", "--eager-threshold", "--plot", "--sizes", "--warmup"].includes(a)) {
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


export function sizesOf(o: PerfOptions): number[] {
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
export function itersFor(o: PerfOptions, size: number): number {
  if (o.iters !== null) return o.iters;
  const def = isBw(o.test) ? 5000 : 1000;
  if (!o.all && o.sizes === null) return def;
  return Math.max(isBw(o.test) ? 64 : 100, Math.min(def, Math.floor((isBw(o.test) ? 2 ** 30 : 2 ** 28) / size)));
}

/** Warm-up operations before measuring: enough for the JIT and the window, bounded in bytes. */
export function warmFor(test: PerfTest, size: number, txDepth: number, qps: number): number {
  const byBytes = Math.max(16, Math.floor((isBw(test) ? 2 ** 28 : 2 ** 26) / size));
  return Math.min(Math.max(isBw(test) ? 2 * txDepth * qps : 200, 1000), byBytes);
}

