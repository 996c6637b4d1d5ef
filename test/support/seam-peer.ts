/**
 * A peer program for tests that need the other side of a QP in another
 * process (peer death) or on another host (two network namespaces).
 * Compiled to dist/test/support/seam-peer.js; run with node:
 *
 *   node seam-peer.js serve  [--host H] [--bytes N] [--ctl stdio | --ctl-listen H:PORT]
 *   node seam-peer.js client --server H:PORT [--host H] [--bytes N] [--chunk C]
 *
 * Endpoints are exchanged out of band as JSON lines on a control channel
 * (stdin/stdout, or a side TCP socket as real RDMA applications do):
 *
 *   serve → {type:"ready", endpoint, regions, bytes, srcSha}
 *   peer  → {type:"connect", endpoint, regions, attr?, chunk?}   (server connects, posts receives)
 *   serve → {type:"connected"}
 *   peer  → {type:"send", wrId, offset, length}                  (one SEND from the server's src)
 *   serve → {type:"sent", wrId, status}
 *   peer  → {type:"run", chunk, notify?} (the server moves its src to the peer: SEND, WRITE, READ back)
 *   serve → {type:"running"}           (only with notify: the WRs are posted)
 *   serve → {type:"ran", ok, ms, statuses}
 *   peer  → {type:"block", ms}         (the server blocks its event loop for ms, busy)
 *   serve → {type:"blocking"}, then {type:"unblocked"} when it is over
 *   peer  → {type:"verify", srcSha}    (after the peer's own traffic completed)
 *   serve → {type:"verified", recv, write, read, ...}
 *   peer  → {type:"exit"}
 *
 * Each side owns four regions of N bytes: `src` (seeded pattern, also the
 * target of the peer's READs), `recv` (the peer's SENDs land here), `write`
 * (the peer's RDMA WRITEs land here) and `read` (its own READs of the peer's
 * src land here). Every landing region must end with the peer's src sha256.
 */
import net from "node:net";
import { createHash } from "node:crypto";
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";
import { tcpProvider } from "../../src/transport/tcp/index.js";
import {
  Access,
  CompletionBuffer,
  SendFlags,
  WcOpcode,
  WcStatus,
  WrOpcode,
  wcStatusName,
  type CompletionQueue,
  type Device,
  type Endpoint,
  type MemoryRegion,
  type ProtectionDomain,
  type QpConnectAttr,
  type QueuePair,
  type SendWr,
} from "../../src/transport/types.js";

export interface RegionInfo {
  addr: number;
  rkey: number;
  length: number;
}
export interface Regions {
  src: RegionInfo;
  write: RegionInfo;
}

const ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ;
export const DEFAULT_ATTR: QpConnectAttr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
/** Upper bound of every step (control replies, traffic, receives): nothing waits forever. */
const STEP_MS = Number(process.env.SEAM_PEER_STEP_MS ?? 45_000);

/** Deterministic bytes from a seed (xorshift32), so each side can be checked by sha256. */
export function pattern(view: Uint8Array, seed: number): void {
  let x = seed >>> 0 || 0x9e3779b9;
  let i = 0;
  for (; i + 4 <= view.length; i += 4) {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    view[i] = x & 0xff;
    view[i + 1] = (x >>> 8) & 0xff;
    view[i + 2] = (x >>> 16) & 0xff;
    view[i + 3] = x >>> 24;
  }
  for (; i < view.length; i++) view[i] = (i * 31) & 0xff;
}

export function sha256(view: Uint8Array): string {
  return createHash("sha256").update(view).digest("hex");
}

function bytesOf(m: MemoryRegion): Uint8Array {
  return new Uint8Array(m.buffer, m.offset, m.length);
}

/** A JSON-lines control channel over a readable and a writable stream. */
export class Channel {
  private queue: Record<string, unknown>[] = [];
  private waiters: ((m: Record<string, unknown> | null) => void)[] = [];
  closed = false;

  constructor(
    input: NodeJS.ReadableStream,
    private readonly output: NodeJS.WritableStream,
  ) {
    const rl = createInterface({ input, crlfDelay: Infinity });
    rl.on("line", (line) => {
      if (line.trim() === "") return;
      let m: Record<string, unknown>;
      try {
        m = JSON.parse(line) as Record<string, unknown>;
      } catch {
        log(`control: ignoring a line that is not JSON: ${line.slice(0, 200)}`);
        return;
      }
      const w = this.waiters.shift();
      if (w) w(m);
      else this.queue.push(m);
    });
    rl.on("close", () => {
      this.closed = true;
      for (const w of this.waiters.splice(0)) w(null);
    });
  }

  send(m: Record<string, unknown>): void {
    this.output.write(JSON.stringify(m) + "\n");
  }

  /** The next message (null once the channel closed), optionally of one type; rejects after `ms`. */
  async next(type?: string, ms = 60_000): Promise<Record<string, unknown> | null> {
    const m = await new Promise<Record<string, unknown> | null>((resolve, reject) => {
      const q = this.queue.shift();
      if (q !== undefined) return resolve(q);
      if (this.closed) return resolve(null);
      const t = setTimeout(() => {
        const i = this.waiters.indexOf(w);
        if (i >= 0) this.waiters.splice(i, 1);
        reject(new Error(`control: no ${type ?? "message"} within ${ms} ms`));
      }, ms);
      const w = (x: Record<string, unknown> | null): void => {
        clearTimeout(t);
        resolve(x);
      };
      this.waiters.push(w);
    });
    if (m !== null && type !== undefined && m.type !== type) throw new Error(`control: expected ${type}, got ${JSON.stringify(m)}`);
    return m;
  }
}

let logPrefix = "[seam-peer]";
function log(msg: string): void {
  process.stderr.write(`${logPrefix} ${msg}\n`);
}

/** One side: device, QP, four regions, and a completion pump dispatching send and receive completions. */
export class PeerSide {
  readonly pd: ProtectionDomain;
  readonly cq: CompletionQueue;
  readonly qp: QueuePair;
  readonly src: MemoryRegion;
  readonly recv: MemoryRegion;
  readonly write: MemoryRegion;
  readonly read: MemoryRegion;
  readonly srcSha: string;
  private readonly buf = new CompletionBuffer(256);
  private sendWaiters = new Map<number, (status: number) => void>();
  recvPosted = 0;
  recvDone = 0;
  recvErrors: string[] = [];
  private recvWaiter: (() => void) | null = null;
  events: string[] = [];

  constructor(
    readonly dev: Device,
    readonly bytes: number,
    seed: number,
  ) {
    this.pd = dev.allocPd();
    this.cq = dev.createCq(8192);
    this.qp = this.pd.createQp({ sendCq: this.cq, recvCq: this.cq, maxSendWr: 2048, maxRecvWr: 2048, maxSendSge: 1, maxRecvSge: 1 });
    this.qp.onEvent = (e) => {
      this.events.push(`${e.type}: ${e.reason}`);
      log(`QP event ${e.type}: ${e.reason}`);
    };
    this.src = this.pd.registerMr(bytes, ACCESS);
    this.recv = this.pd.registerMr(bytes, ACCESS);
    this.write = this.pd.registerMr(bytes, ACCESS);
    this.read = this.pd.registerMr(bytes, ACCESS);
    pattern(bytesOf(this.src), seed);
    this.srcSha = sha256(bytesOf(this.src));
    this.cq.onNotify = () => this.drain();
    this.cq.requestNotify();
  }

  regions(): Regions {
    return {
      src: { addr: this.src.addr, rkey: this.src.rkey, length: this.src.length },
      write: { addr: this.write.addr, rkey: this.write.rkey, length: this.write.length },
    };
  }

  private drain(): void {
    for (;;) {
      let n = this.cq.poll(this.buf);
      if (n === 0) {
        this.cq.requestNotify();
        n = this.cq.poll(this.buf);
        if (n === 0) return;
      }
      for (let i = 0; i < n; i++) {
        const op = this.buf.opcode[i]!;
        const status = this.buf.status[i]!;
        const wrId = this.buf.wrId[i]!;
        if (op === WcOpcode.RECV || op === WcOpcode.RECV_RDMA_WITH_IMM) {
          this.recvDone++;
          if (status !== WcStatus.SUCCESS) this.recvErrors.push(`${wrId}:${wcStatusName(status)}`);
          if (this.recvWaiter && this.recvDone >= this.recvPosted) this.recvWaiter();
        } else {
          const w = this.sendWaiters.get(wrId);
          this.sendWaiters.delete(wrId);
          w?.(status);
        }
      }
    }
  }

  /** Posts receives covering the whole recv region in `chunk`-byte pieces. */
  postReceives(chunk: number): void {
    const wrs = [];
    for (let off = 0; off < this.bytes; off += chunk) {
      wrs.push({ wrId: 1_000_000 + wrs.length, sgList: [{ addr: this.recv.addr + off, length: Math.min(chunk, this.bytes - off), lkey: this.recv.lkey }] });
    }
    this.qp.postRecv(wrs);
    this.recvPosted += wrs.length;
  }

  /** Resolves once every posted receive completed (successfully or not). */
  receivesDone(ms: number): Promise<void> {
    if (this.recvDone >= this.recvPosted) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`${this.recvPosted - this.recvDone} receives still pending after ${ms} ms`)), ms);
      this.recvWaiter = () => {
        clearTimeout(t);
        this.recvWaiter = null;
        resolve();
      };
    });
  }

  /** Posts one signaled WR; resolves with its completion status. */
  post(wr: SendWr): Promise<number> {
    return new Promise((resolve) => {
      this.sendWaiters.set(wr.wrId, resolve);
      this.qp.postSend([{ ...wr, flags: (wr.flags ?? 0) | SendFlags.SIGNALED }]);
    });
  }

  /**
   * Moves this side's src to the peer three ways: SEND into its receives,
   * RDMA WRITE into its write region, and RDMA READ of its src into our read
   * region. At most `window` WRs outstanding. Resolves with per-status counts.
   */
  async traffic(remote: Regions, chunk: number, window = 512, deadlineMs = STEP_MS): Promise<{ ok: boolean; ms: number; statuses: Record<string, number>; stuck?: string }> {
    const t0 = performance.now();
    const wrs: SendWr[] = [];
    let id = 1;
    for (let off = 0; off < this.bytes; off += chunk) {
      const len = Math.min(chunk, this.bytes - off);
      const local = { addr: this.src.addr + off, length: len, lkey: this.src.lkey };
      wrs.push({ wrId: id++, opcode: WrOpcode.SEND, sgList: [local] });
      wrs.push({ wrId: id++, opcode: WrOpcode.RDMA_WRITE, sgList: [local], remoteAddr: remote.write.addr + off, rkey: remote.write.rkey });
      wrs.push({
        wrId: id++,
        opcode: WrOpcode.RDMA_READ,
        sgList: [{ addr: this.read.addr + off, length: len, lkey: this.read.lkey }],
        remoteAddr: remote.src.addr + off,
        rkey: remote.src.rkey,
      });
    }
    const statuses: Record<string, number> = {};
    let next = 0;
    let inflight = 0;
    let stuck: string | undefined;
    let timer: NodeJS.Timeout | undefined;
    await new Promise<void>((resolve) => {
      // Never hang: report what is still outstanding instead.
      timer = setTimeout(() => {
        stuck = `after ${deadlineMs} ms: ${inflight} WRs without completion, ${wrs.length - next} not posted, QP state ${this.qp.state}, receives ${this.recvDone}/${this.recvPosted}, events ${JSON.stringify(this.events)}`;
        log(`traffic stuck ${stuck}`);
        resolve();
      }, deadlineMs);
      const launch = (): void => {
        while (inflight < window && next < wrs.length) {
          const wr = wrs[next++]!;
          inflight++;
          this.post(wr).then((s) => {
            inflight--;
            const k = wcStatusName(s);
            statuses[k] = (statuses[k] ?? 0) + 1;
            if (s !== WcStatus.SUCCESS) next = wrs.length; // stop posting; the rest of the queue flushes
            if (inflight === 0 && next >= wrs.length) resolve();
            else launch();
          });
        }
      };
      launch();
    });
    clearTimeout(timer);
    const total = Object.values(statuses).reduce((a, b) => a + b, 0);
    const ms = performance.now() - t0;
    log(`traffic: ${wrs.length} WRs in ${ms.toFixed(0)} ms ${JSON.stringify(statuses)}`);
    return { ok: stuck === undefined && (statuses.SUCCESS ?? 0) === wrs.length && total === wrs.length, ms, statuses, ...(stuck !== undefined ? { stuck } : {}) };
  }

  /** Whether each landing region holds the peer's src. */
  verify(peerSrcSha: string): { recv: boolean; write: boolean; read: boolean; shas: Record<string, string> } {
    const shas = { recv: sha256(bytesOf(this.recv)), write: sha256(bytesOf(this.write)), read: sha256(bytesOf(this.read)) };
    return { recv: shas.recv === peerSrcSha, write: shas.write === peerSrcSha, read: shas.read === peerSrcSha, shas };
  }
}

interface Args {
  mode: string;
  host: string;
  bytes: number;
  chunk: number;
  ctl: string;
  ctlListen: string;
  server: string;
  seed: number;
}

function parseArgs(argv: string[]): Args {
  const a: Args = { mode: argv[0] ?? "serve", host: "127.0.0.1", bytes: 1 << 20, chunk: 0, ctl: "stdio", ctlListen: "", server: "", seed: 0 };
  for (let i = 1; i < argv.length; i++) {
    const k = argv[i]!;
    const v = argv[++i];
    if (v === undefined) throw new Error(`missing value for ${k}`);
    if (k === "--host") a.host = v;
    else if (k === "--bytes") a.bytes = Number(v);
    else if (k === "--chunk") a.chunk = Number(v);
    else if (k === "--ctl") a.ctl = v;
    else if (k === "--ctl-listen") a.ctlListen = v;
    else if (k === "--server") a.server = v;
    else if (k === "--seed") a.seed = Number(v);
    else throw new Error(`unknown option ${k}`);
  }
  if (!Number.isInteger(a.bytes) || a.bytes < 1) throw new Error(`--bytes must be a positive integer`);
  return a;
}

/** The chunk both sides use: at least 64 KiB, and at most 1024 pieces (receive queue depth). */
export function chunkFor(bytes: number, asked = 0): number {
  return asked > 0 ? asked : Math.max(64 * 1024, Math.ceil(bytes / 1024));
}

function splitHostPort(s: string): { host: string; port: number } {
  const i = s.lastIndexOf(":");
  return { host: s.slice(0, i), port: Number(s.slice(i + 1)) };
}

async function serve(a: Args): Promise<void> {
  logPrefix = "[seam-peer serve]";
  let ch: Channel;
  let server: net.Server | null = null;
  if (a.ctlListen) {
    const { host, port } = splitHostPort(a.ctlListen);
    server = net.createServer();
    await new Promise<void>((resolve, reject) => {
      server!.once("error", reject);
      server!.listen(port, host, resolve);
    });
    const addr = server.address() as net.AddressInfo;
    // The launcher waits for this line before it starts the client.
    process.stdout.write(JSON.stringify({ type: "listening", ctl: `${addr.address}:${addr.port}` }) + "\n");
    const sock = await new Promise<net.Socket>((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`no control connection within ${STEP_MS} ms`)), STEP_MS);
      server!.once("connection", (s) => {
        clearTimeout(t);
        resolve(s);
      });
    });
    log(`control connection from ${sock.remoteAddress}:${sock.remotePort}`);
    sock.setNoDelay(true);
    ch = new Channel(sock, sock);
  } else {
    ch = new Channel(process.stdin, process.stdout);
  }
  const dev = await tcpProvider.openDevice("tcp0", { host: a.host });
  const side = new PeerSide(dev, a.bytes, a.seed || 0x5e1f);
  ch.send({ type: "ready", endpoint: side.qp.localEndpoint(), regions: side.regions(), bytes: a.bytes, srcSha: side.srcSha, pid: process.pid });
  let remote: Regions | null = null;
  let running: Promise<{ ok: boolean; ms: number; statuses: Record<string, number> }> | null = null;
  for (;;) {
    const m = await ch.next(undefined, 24 * 3600_000);
    if (m === null || m.type === "exit") break;
    switch (m.type) {
      case "connect": {
        remote = m.regions as Regions;
        side.postReceives(chunkFor(a.bytes, Number(m.chunk ?? 0)));
        side.qp.connect(m.endpoint as Endpoint, { ...DEFAULT_ATTR, ...(m.attr as QpConnectAttr | undefined) });
        ch.send({ type: "connected" });
        break;
      }
      case "send": {
        const wrId = Number(m.wrId);
        side
          .post({ wrId, opcode: WrOpcode.SEND, sgList: [{ addr: side.src.addr + Number(m.offset), length: Number(m.length), lkey: side.src.lkey }] })
          .then((s) => ch.send({ type: "sent", wrId, status: wcStatusName(s) }));
        break;
      }
      case "run": {
        if (!remote) throw new Error("run before connect");
        running = side.traffic(remote, chunkFor(a.bytes, Number(m.chunk ?? 0)));
        // On request, say that the WRs are posted (the traffic is under way) before "ran".
        if (m.notify === true) ch.send({ type: "running" });
        running.then((r) => ch.send({ ...r, type: "ran" }));
        break;
      }
      case "block": {
        // A blocked event loop (synchronous work, or a long GC pause): no I/O, no timers, no ACKs for `ms`.
        // Writes to a pipe are synchronous on Linux, so "blocking" is out before the loop stops.
        const ms = Number(m.ms);
        ch.send({ type: "blocking" });
        const end = performance.now() + ms;
        while (performance.now() < end) {
          /* busy */
        }
        ch.send({ type: "unblocked" });
        break;
      }
      case "verify": {
        const ran = running ? await running : null;
        let recvError: string | null = null;
        await side.receivesDone(STEP_MS).catch((e: Error) => (recvError = e.message));
        const v = side.verify(String(m.srcSha));
        ch.send({ type: "verified", ...v, ran, recvError, recvErrors: side.recvErrors.slice(0, 10), events: side.events, srcSha: side.srcSha });
        break;
      }
      default:
        log(`unknown command ${JSON.stringify(m)}`);
    }
  }
  dev.close();
  server?.close();
  process.exit(0);
}

async function client(a: Args): Promise<void> {
  logPrefix = "[seam-peer client]";
  const { host, port } = splitHostPort(a.server);
  const sock = await new Promise<net.Socket>((resolve, reject) => {
    const s = net.connect({ host, port, noDelay: true, timeout: STEP_MS });
    s.once("connect", () => {
      s.setTimeout(0);
      resolve(s);
    });
    s.once("timeout", () => reject(new Error(`control connect to ${host}:${port} timed out`)));
    s.once("error", reject);
  });
  const ch = new Channel(sock, sock);
  log(`control connected to ${host}:${port}`);
  const ready = (await ch.next("ready", STEP_MS))!;
  const bytes = Number(ready.bytes);
  if (bytes !== a.bytes) throw new Error(`server moves ${bytes} bytes, client was told ${a.bytes}`);
  const chunk = chunkFor(bytes, a.chunk);
  const dev = await tcpProvider.openDevice("tcp0", { host: a.host });
  const side = new PeerSide(dev, bytes, (a.seed || 0xc11e) ^ 0x5a5a);
  side.postReceives(chunk);
  side.qp.connect(ready.endpoint as Endpoint, DEFAULT_ATTR);
  ch.send({ type: "connect", endpoint: side.qp.localEndpoint(), regions: side.regions(), chunk });
  await ch.next("connected", STEP_MS);
  log("QPs connected");
  const t0 = performance.now();
  ch.send({ type: "run", chunk });
  const [mine, theirs] = await Promise.all([side.traffic(ready.regions as Regions, chunk), ch.next("ran", STEP_MS * 2)]);
  ch.send({ type: "verify", srcSha: side.srcSha });
  const verified = (await ch.next("verified", STEP_MS * 2))!;
  let recvError: string | null = null;
  await side.receivesDone(STEP_MS).catch((e: Error) => (recvError = e.message));
  const ms = performance.now() - t0;
  const v = side.verify(String(ready.srcSha));
  const ok = mine.ok && theirs!.ok === true && v.recv && v.write && v.read && verified.recv === true && verified.write === true && verified.read === true && recvError === null;
  const moved = bytes * 3 * 2;
  const summary = {
    type: "summary",
    ok,
    bytes,
    chunk,
    ms: Math.round(ms),
    mibPerSec: Math.round((moved / (1 << 20) / (ms / 1000)) * 10) / 10,
    client: { host: a.host, traffic: mine, verify: { recv: v.recv, write: v.write, read: v.read }, recvError, events: side.events },
    server: { traffic: { ok: theirs!.ok, ms: theirs!.ms, statuses: theirs!.statuses, stuck: theirs!.stuck }, verify: { recv: verified.recv, write: verified.write, read: verified.read }, recvError: verified.recvError, events: verified.events },
    srcSha: { client: side.srcSha, server: ready.srcSha },
  };
  process.stdout.write(JSON.stringify(summary) + "\n");
  ch.send({ type: "exit" });
  sock.end();
  dev.close();
  process.exit(ok ? 0 : 1);
}

async function main(): Promise<void> {
  const a = parseArgs(process.argv.slice(2));
  if (a.mode === "serve") await serve(a);
  else if (a.mode === "client") {
    if (!a.server) throw new Error("client mode needs --server HOST:PORT");
    await client(a);
  } else throw new Error(`unknown mode ${a.mode} (serve | client)`);
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  // Never outlive the test that started us: a closed stdin (parent gone) ends a stdio-controlled peer.
  main().catch((e: Error) => {
    log(`fatal: ${e.stack ?? e.message}`);
    process.exit(2);
  });
}
