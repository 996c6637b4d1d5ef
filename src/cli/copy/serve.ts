/**
 * async-rdma serve [dir] [-p port] [--bind addr] [--writable] [--keep-setid] [--auth-key-file f] [--provider p]
 *
 * Serves one directory tree to `async-rdma cp`. Every path a client names is
 * confined to the tree (copy/paths.ts); each connection gets its own ring of
 * registered chunk buffers, shared with that connection only, and whatever it
 * holds (open files, the ring) is released when it ends, however it ends.
 * Uploads land under temporary names until complete and verified.
 */
import { lstat, realpath } from "node:fs/promises";
import { dirname, relative } from "node:path";
import { RpcServer, type RpcHandler } from "../../rpc/index.js";
import type { LocalMr, Rdma, RemoteMr, SharedMr } from "../../index.js";
import { builderFor, DEFAULT_BIND, DEFAULT_PORT, parseIntArg } from "./common.js";
import { checkLinkTarget, checkRel, CopyError, inside, resolveInside, resolveInsideSync, withPath } from "./paths.js";
import { readSmallInto, writeBatch, type BatchFile } from "./batch.js";
import { allocRing, chunkLen, FileSink, FileSource, sameSecond, StateBudget } from "./files.js";
import { makeDir, makeLink, mapLimit, peerMode, setTimes, walk } from "./tree.js";
import { arr, decodeGet, decodePut, failure, fromJson, int, num, smallFiles, str, toJson, VERSION, type Result, type SmallResult } from "./protocol.js";

/** Connections one client address may hold at once (--max-per-source). */
const DEFAULT_PER_SOURCE = 32;

export const USAGE = `usage: async-rdma serve [dir] [options]
Serves the directory tree \`dir\` (default: the current directory) to \`async-rdma cp\`.
Nothing outside it is readable or writable. By default the tree is served
read-only, on this machine only (127.0.0.1): --bind and --writable say otherwise.

  -p, --port <n>          port to listen on (default ${DEFAULT_PORT}; 0 picks a free one)
      --bind <addr>       address to listen on (default ${DEFAULT_BIND}; 0.0.0.0: every interface)
      --writable          accept uploads, new directories and links
      --read-only         refuse uploads and every change to the tree (the default)
      --keep-setid        keep the setuid/setgid bits of uploaded files and directories
                          (by default they are dropped)
      --auth-key-file <f> accept only clients that have this key (16 bytes or more)
      --max-per-source <n> connections one client address may hold at once (default ${DEFAULT_PER_SOURCE})
      --provider <p>      tcp, verbs or auto (default auto)
  -h, --help              this help
`;

function loopback(addr: string): boolean {
  return addr === "localhost" || addr === "::1" || /^127\./.test(addr) || /^::ffff:127\./i.test(addr);
}

/** Limits a client may ask for. */
const MAX_CHUNK = 16 * 1024 * 1024;
const MIN_CHUNK = 4096;
const MAX_DEPTH = 64;
const MAX_RING = 256 * 1024 * 1024;
/** Ring bytes of all connections together: past it a hello is refused (EBUSY), the client may retry later. */
const MAX_TOTAL_RING = 1024 * 1024 * 1024;
let ringBytes = 0;

/**
 * Fair shares per client address, as sshd's MaxStartups: one address holds
 * at most half of the ring budget, so clients from elsewhere always find
 * room for a ring (the largest is a quarter of the budget).
 */
export class SourceShares {
  private readonly held = new Map<string, number>();
  constructor(readonly total: number) {}

  /** Whether `source` may take `n` more bytes. */
  fits(source: string, n: number): boolean {
    return (this.held.get(source) ?? 0) + n <= this.total / 2;
  }

  heldBy(source: string): number {
    return this.held.get(source) ?? 0;
  }

  take(source: string, n: number): void {
    this.held.set(source, (this.held.get(source) ?? 0) + n);
  }

  give(source: string, n: number): void {
    const left = (this.held.get(source) ?? 0) - n;
    if (left > 0) this.held.set(source, left);
    else this.held.delete(source);
  }
}
const ringShares = new SourceShares(MAX_TOTAL_RING);
/**
 * A hello that does not fit ends connections that hold a ring and have had
 * no call in flight for this long, longest idle first, so connections that
 * sit idle cannot lock others out (a copy in progress always has a call in
 * flight). It waits at most this long for such a connection to become idle
 * enough; past that, EBUSY.
 */
const IDLE_EVICT_MS = 2_000;
/** Every session that holds or may hold a ring. */
const sessions = new Set<Session>();
const MAX_OPEN = 256;
/**
 * Per-chunk state of uploads in progress (a CRC and a bit per chunk: 4.1
 * bytes per chunk; with 1 MiB chunks 64 MiB covers 16 TiB of files, with
 * the smallest chunks 64 GiB), per connection and for all together.
 */
const MAX_STATE = 64 * 1024 * 1024;
const MAX_TOTAL_STATE = 256 * 1024 * 1024;
const stateBudget = new StateBudget(MAX_TOTAL_STATE);
const MAX_BATCH_FILES = 10_000;

interface Options {
  root: string;
  readOnly: boolean;
  /** Uploaded modes keep their setuid/setgid bits (--keep-setid). */
  keepSetid: boolean;
}

/** One client's state: its ring and the files it has open. */
class Session {
  ring: LocalMr | null = null;
  /** The client's ring, when it asked the server to pull uploads with RDMA READ. */
  peerRing: RemoteMr | null = null;
  bytes: Uint8Array | null = null;
  share: SharedMr | null = null;
  chunk = 0;
  depth = 0;
  verify = true;
  /** The ring is aligned for O_DIRECT writes (FileSink). */
  direct = false;
  /** Calls in flight, and when the last one ended (performance.now()). */
  calls = 0;
  lastCall = performance.now();
  ended = false;
  greeted = false;
  /** Ring bytes this session counts in ringBytes. */
  counted = 0;
  private readonly busy = new Set<number>();
  /** Per-chunk state of this connection's uploads. */
  readonly state = new StateBudget(MAX_STATE, stateBudget);
  readonly sinks = new Map<number, { sink: FileSink; rel: string }>();
  readonly sources = new Map<number, { src: FileSource; rel: string }>();
  private nextId = 1;

  constructor(
    readonly rdma: Rdma,
    readonly opts: Options,
  ) {}

  id(): number {
    if (this.sinks.size + this.sources.size >= MAX_OPEN) throw new CopyError("EMFILE", `at most ${MAX_OPEN} files open per connection`);
    const id = this.nextId;
    this.nextId = (this.nextId % 0x7fffffff) + 1;
    return id;
  }

  writable(): void {
    if (this.opts.readOnly) throw new CopyError("EROFS", "the server is read-only (--read-only)");
  }

  /** Slot `slot` for the length of one call; a slot in use by another call is refused. */
  async withSlot<T>(slot: number, len: number, fn: (view: Uint8Array) => Promise<T>): Promise<T> {
    if (!this.bytes) throw new CopyError("PROTOCOL", "hello first");
    if (slot >= this.depth || len > this.chunk || len === 0) throw new CopyError("PROTOCOL", `slot ${slot} length ${len} is outside the ring (${this.depth} × ${this.chunk})`);
    if (this.busy.has(slot)) throw new CopyError("PROTOCOL", `slot ${slot} is in use`);
    this.busy.add(slot);
    try {
      return await fn(this.bytes.subarray(slot * this.chunk, slot * this.chunk + len));
    } finally {
      this.busy.delete(slot);
    }
  }

  /** Ended to make room for another connection's ring (it was idle). */
  async evict(): Promise<void> {
    console.error(`async-rdma serve: ended an idle connection from ${this.rdma.peer.address} to make room for another`);
    void this.rdma.close().catch(() => {});
    await this.end();
  }

  async end(): Promise<void> {
    if (this.ended) return;
    this.ended = true;
    sessions.delete(this);
    for (const { sink } of this.sinks.values()) await sink.abort();
    for (const { src } of this.sources.values()) await src.close();
    this.sinks.clear();
    this.sources.clear();
    // The session is over: no opener is left to wait for (and the ring is freed next).
    void this.share?.revoke({ timeoutMs: 0 });
    ringBytes -= this.counted;
    ringShares.give(this.rdma.peer.address, this.counted);
    this.counted = 0;
    try {
      this.ring?.dispose();
    } catch {
      /* released with the connection */
    }
  }
}

/**
 * Makes room for `need` more ring bytes by ending idle connections (see
 * IDLE_EVICT_MS); returns when there is room, or when there cannot be.
 */
async function makeRoom(need: number, me: Session): Promise<void> {
  const from = me.rdma.peer.address;
  // Room in the whole budget and in this address's half of it.
  const fits = (): boolean => ringBytes + need <= MAX_TOTAL_RING && ringShares.fits(from, need);
  const deadline = performance.now() + IDLE_EVICT_MS;
  for (;;) {
    if (fits()) return;
    // Over its address's share, only that address's idle connections can make room.
    const sameSource = !ringShares.fits(from, need);
    const idle = [...sessions].filter((x) => x !== me && x.counted > 0 && x.calls === 0 && (!sameSource || x.rdma.peer.address === from)).sort((a, b) => a.lastCall - b.lastCall);
    // when ending every idle connection would not make room, waiting is pointless
    const freed = idle.reduce((a, x) => a + x.counted, 0);
    if (sameSource ? ringShares.heldBy(from) - freed + need > MAX_TOTAL_RING / 2 : ringBytes - freed + need > MAX_TOTAL_RING) return;
    const now = performance.now();
    let later = Infinity;
    for (const x of idle) {
      if (fits()) return;
      if (now - x.lastCall >= IDLE_EVICT_MS) {
        if (x.calls === 0) await x.evict(); // (still idle: the awaits above let calls in)
      } else later = Math.min(later, x.lastCall + IDLE_EVICT_MS);
    }
    if (fits() || now >= deadline) return;
    // wait for the next connection to become idle long enough (bounded by the deadline)
    await new Promise((r) => setTimeout(r, Math.max(1, Math.min(later, deadline) - now + 1)));
  }
}

async function where(s: Session, path: unknown): Promise<{ rel: string; abs: string }> {
  const rel = checkRel(path);
  return { rel, abs: await resolveInside(s.opts.root, rel) };
}

function handlers(s: Session): Record<string, RpcHandler> {
  const { root } = s.opts;
  /** Runs a handler; fs errors come back with the client's path, never the server's. */
  const h =
    (fn: (p: Uint8Array) => Promise<Uint8Array | void>): RpcHandler =>
    async (p) => {
      s.calls++;
      try {
        return await fn(p);
      } catch (e) {
        throw withPath(e, "");
      } finally {
        s.calls--;
        s.lastCall = performance.now();
      }
    };
  const json =
    (fn: (o: Record<string, unknown>) => Promise<unknown>): RpcHandler =>
    h(async (p) => toJson(await fn(fromJson(p))));
  const sinkOf = (o: Record<string, unknown>) => {
    const e = s.sinks.get(int(o, "id"));
    if (!e) throw new CopyError("PROTOCOL", "no such open file");
    return e;
  };
  const each = async <T>(items: T[], fn: (t: T) => Promise<Result | void>): Promise<Result[]> =>
    mapLimit(items, 1, async (t) => {
      try {
        return (await fn(t)) ?? { ok: true };
      } catch (e) {
        return failure(withPath(e, String((t as { path?: unknown }).path ?? "")));
      }
    });
  return {
    hello: json(async (o) => {
      if (s.greeted || s.ended) throw new CopyError("PROTOCOL", "hello twice, or on an ended connection");
      s.greeted = true;
      const chunk = int(o, "chunk", MIN_CHUNK, MAX_CHUNK);
      const depth = Math.min(int(o, "depth", 1, 1024), MAX_DEPTH, Math.floor(MAX_RING / chunk));
      if (ringBytes + chunk * depth > MAX_TOTAL_RING || !ringShares.fits(s.rdma.peer.address, chunk * depth)) await makeRoom(chunk * depth, s);
      if (ringBytes + chunk * depth > MAX_TOTAL_RING) throw new CopyError("EBUSY", `the server is busy: its connections hold ${ringBytes >> 20} MiB of buffers (at most ${MAX_TOTAL_RING >> 20} MiB); retry later or ask for a smaller --chunk/--depth`);
      const from = s.rdma.peer.address;
      if (!ringShares.fits(from, chunk * depth)) throw new CopyError("EBUSY", `the server is busy for ${from}: connections from this address hold ${ringShares.heldBy(from) >> 20} MiB of buffers (one address may hold at most half of ${MAX_TOTAL_RING >> 20} MiB); retry later or ask for a smaller --chunk/--depth`);
      if (s.ended) throw new CopyError("PROTOCOL", "the connection ended");
      ringBytes += chunk * depth;
      ringShares.take(from, chunk * depth);
      s.counted = chunk * depth;
      s.chunk = chunk;
      s.depth = depth;
      s.verify = o.verify !== false;
      const r = allocRing(s.rdma, chunk * depth, chunk, s.opts.readOnly ? null : s.opts.root);
      s.ring = r.ring;
      s.direct = r.direct;
      s.bytes = s.ring.bytes;
      // exactly the ring, to this connection only; read-only servers never let a client write
      s.share = s.rdma.share("cp-ring", s.ring, { access: s.opts.readOnly ? "read" : "write" });
      if (o.pull === true) s.peerRing = await s.rdma.openSharedMr("cp-client-ring");
      return { version: VERSION, chunk, depth, ring: "cp-ring", readOnly: s.opts.readOnly };
    }),
    stat: json(async (o) => {
      const { rel, abs } = await where(s, o.path);
      try {
        const st = await lstat(abs);
        const type = st.isSymbolicLink() ? "symlink" : st.isDirectory() ? "dir" : st.isFile() ? "file" : "other";
        return { type, size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs };
      } catch (e) {
        if ((e as { code?: unknown }).code === "ENOENT") return { type: "none" };
        throw withPath(e, rel);
      }
    }),
    list: json(async (o) => {
      let { rel, abs } = await where(s, o.path);
      // follow: a link named on cp's command line is followed, to where it leads inside the tree
      if (o.follow === true && rel !== "" && (await lstat(abs).catch(() => null))?.isSymbolicLink() === true) {
        let real: string;
        try {
          real = await realpath(abs);
        } catch (e) {
          throw withPath(e, rel);
        }
        if (!inside(root, real)) throw new CopyError("ESCAPE", `${JSON.stringify(rel)} is a link that leads outside the served directory: refused`);
        abs = real;
        rel = relative(root, real);
      }
      try {
        return { entries: await walk(abs), path: rel };
      } catch (e) {
        throw withPath(e, rel);
      }
    }),
    check: json(async (o) => {
      const same: boolean[] = [];
      for (const f of arr(o, "files", 1_000_000)) {
        const { abs } = await where(s, f.path);
        const st = await lstat(abs).catch(() => null);
        same.push(st !== null && st.isFile() && st.size === num(f, "size") && sameSecond(st.mtimeMs, num(f, "mtimeMs", -1e15, 1e15)));
      }
      return { same };
    }),
    mkdirs: json(async (o) => {
      s.writable();
      const times = o.times === true;
      return {
        results: await each(arr(o, "dirs", 1_000_000), async (d) => {
          const { abs } = await where(s, d.path);
          const mode = peerMode(int(d, "mode", 0, 0o7777), s.opts.keepSetid);
          if (times) await setTimes(abs, mode, num(d, "mtimeMs", -1e15, 1e15));
          else await makeDir(abs, mode | 0o700);
        }),
      };
    }),
    symlinks: json(async (o) => {
      s.writable();
      return {
        results: await each(arr(o, "links", 1_000_000), async (l) => {
          const { rel, abs } = await where(s, l.path);
          const target = str(l, "target");
          // judged from the link's real directory (abs's parent is a realpath), as the kernel will resolve it
          checkLinkTarget(rel, target, root, dirname(abs));
          await makeLink(abs, target);
        }),
      };
    }),
    open: json(async (o) => {
      s.writable();
      const { rel, abs } = await where(s, o.path);
      if (rel === "") throw new CopyError("EISDIR", "the destination is the served directory, a file is expected");
      if (!s.bytes || s.ended) throw new CopyError("PROTOCOL", "hello first");
      const meta = { size: int(o, "size"), mode: peerMode(int(o, "mode", 0, 0o7777), s.opts.keepSetid), mtimeMs: num(o, "mtimeMs", -1e15, 1e15) };
      const id = s.id();
      try {
        const sink = await FileSink.open(abs, meta, s.chunk, o.resume === true, s.verify, s.direct, s.state);
        s.sinks.set(id, { sink, rel });
        return { id, existing: sink.existing };
      } catch (e) {
        throw withPath(e, rel);
      }
    }),
    accept: json(async (o) => {
      const { sink } = sinkOf(o);
      return { bytes: sink.accept(int(o, "chunks")) };
    }),
    put: h(async (p) => {
      const m = decodePut(p);
      const e = s.sinks.get(m.id);
      if (!e) throw new CopyError("PROTOCOL", "put: no such open file");
      await s.withSlot(m.slot, m.len, async (view) => {
        try {
          await e.sink.write(m.off, view, m.crc);
        } catch (err) {
          throw withPath(err, e.rel);
        }
      });
    }),
    // the alternative upload data path (measured against put: docs/performance.md):
    // the server RDMA READs the chunk from the client's slot into its own
    pull: h(async (p) => {
      const m = decodePut(p);
      const e = s.sinks.get(m.id);
      const peer = s.peerRing;
      if (!e || !peer || !s.ring) throw new CopyError("PROTOCOL", "pull: no such open file, or no client ring");
      await s.withSlot(m.slot, m.len, async (view) => {
        const at = m.slot * s.chunk;
        await s.rdma.read(s.ring!.slice(at, at + m.len), peer.slice(at, at + m.len));
        try {
          await e.sink.write(m.off, view, m.crc);
        } catch (err) {
          throw withPath(err, e.rel);
        }
      });
    }),
    finish: json(async (o) => {
      const e = sinkOf(o);
      s.sinks.delete(int(o, "id"));
      try {
        await e.sink.finish(str(o, "digest"));
      } catch (err) {
        await e.sink.abort();
        throw withPath(err, e.rel);
      }
      return {};
    }),
    abort: json(async (o) => {
      const e = s.sinks.get(int(o, "id"));
      s.sinks.delete(int(o, "id"));
      await e?.sink.abort();
      return {};
    }),
    putSmall: json(async (o) => {
      s.writable();
      const slot = int(o, "slot", 0, 0xffffffff);
      const files = smallFiles(o, "files", s.chunk, MAX_BATCH_FILES).map((f) => ("crc" in f ? { ...f, mode: peerMode(f.mode, s.opts.keepSetid) } : f));
      const parents = new Map<string, string>();
      const results: Result[] = files.map(() => ({ ok: true }));
      // the bytes are in our slot (the client WROTE them before this call, on the same QP)
      await s.withSlot(slot, s.chunk, async (view) => {
        const todo: { k: number; b: BatchFile }[] = [];
        files.forEach((f, k) => {
          try {
            if (!("crc" in f)) throw new CopyError("PROTOCOL", "an upload entry without data");
            const abs = resolveInsideSync(root, checkRel(f.path), parents);
            if (abs === root) throw new CopyError("EISDIR", "the destination is the served directory");
            todo.push({ k, b: { abs, f, data: view.subarray(f.off, f.off + f.size) } });
          } catch (e) {
            results[k] = failure(withPath(e, f.path));
          }
        });
        const errs = await writeBatch(
          todo.map((t) => t.b),
          s.verify,
        );
        errs.forEach((e, j) => {
          const t = todo[j]!;
          if (e !== null) results[t.k] = failure(withPath(e, t.b.f.path));
        });
      });
      return { results };
    }),
    openRead: json(async (o) => {
      const { rel, abs } = await where(s, o.path);
      const id = s.id();
      try {
        const src = await FileSource.open(abs);
        s.sources.set(id, { src, rel });
        return { id, ...src.meta };
      } catch (e) {
        throw withPath(e, rel);
      }
    }),
    sums: json(async (o) => {
      const e = s.sources.get(int(o, "id"));
      if (!e) throw new CopyError("PROTOCOL", "no such open file");
      return { crcs: await e.src.prefixCrcs(s.chunk, int(o, "count", 0, 1 << 30)) };
    }),
    get: h(async (p) => {
      const m = decodeGet(p);
      const e = s.sources.get(m.id);
      if (!e) throw new CopyError("PROTOCOL", "get: no such open file");
      const i = m.off / s.chunk;
      if (!Number.isInteger(i) || m.len !== chunkLen(e.src.st.size, s.chunk, i)) throw new CopyError("PROTOCOL", `get: offset ${m.off} length ${m.len} is not a chunk of the file`);
      const crc = await s.withSlot(m.slot, m.len, async (view) => {
        try {
          return await e.src.readChunk(i, s.chunk, view, s.verify);
        } catch (err) {
          throw withPath(err, e.rel);
        }
      });
      const out = new Uint8Array(4);
      new DataView(out.buffer).setUint32(0, crc);
      return out;
    }),
    closeRead: json(async (o) => {
      const id = int(o, "id");
      const e = s.sources.get(id);
      if (!e) throw new CopyError("PROTOCOL", "no such open file");
      s.sources.delete(id);
      try {
        return { changed: await e.src.changed(), digest: e.src.digest() };
      } finally {
        await e.src.close();
      }
    }),
    getSmall: json(async (o) => {
      const slot = int(o, "slot", 0, 0xffffffff);
      const paths = o.paths;
      if (!Array.isArray(paths) || paths.length > MAX_BATCH_FILES) throw new CopyError("PROTOCOL", `getSmall: at most ${MAX_BATCH_FILES} paths`);
      const parents = new Map<string, string>();
      const files: SmallResult[] = [];
      // read into our slot, back to back; the client READs them after the answer
      await s.withSlot(slot, s.chunk, async (view) => {
        let off = 0;
        for (const path of paths) {
          let rel = String(path);
          try {
            rel = checkRel(path);
            const r = readSmallInto(resolveInsideSync(root, rel, parents), false, view.subarray(off), s.verify);
            files.push({ path: rel, ...r.meta, crc: r.crc, off });
            off += r.meta.size;
          } catch (e) {
            const f = failure(withPath(e, rel));
            files.push({ path: rel, code: f.code, message: f.message });
          }
        }
      });
      return { files };
    }),
  };
}

export async function serve(args: string[]): Promise<void> {
  let dir: string | undefined;
  let port = DEFAULT_PORT;
  let bind = DEFAULT_BIND;
  let writable: boolean | undefined;
  let keepSetid = false;
  let keyFile: string | undefined;
  let provider: string | undefined;
  let perSource = DEFAULT_PER_SOURCE;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === "-h" || a === "--help") {
      process.stdout.write(USAGE);
      return;
    } else if (a === "-p" || a === "--port") port = parseIntArg(args[++i], a, 0, 65535);
    else if (a === "--bind") bind = args[++i] ?? "";
    else if (a === "--read-only" || a === "--writable") {
      if (writable !== undefined && writable !== (a === "--writable")) throw new CopyError("USAGE", "--read-only and --writable contradict each other");
      writable = a === "--writable";
    }
    else if (a === "--keep-setid") keepSetid = true;
    else if (a === "--auth-key-file") keyFile = args[++i];
    else if (a === "--provider") provider = args[++i];
    else if (a === "--max-per-source") perSource = parseIntArg(args[++i], a, 1, 65535);
    else if (a.startsWith("-")) throw new CopyError("USAGE", `unknown option ${a} (async-rdma serve --help)`);
    else if (dir === undefined) dir = a;
    else throw new CopyError("USAGE", `one directory only (got ${JSON.stringify(dir)} and ${JSON.stringify(a)})`);
  }
  let root: string;
  try {
    root = await realpath(dir ?? ".");
    if (!(await lstat(root)).isDirectory()) throw new CopyError("ENOTDIR", `${dir}: not a directory`);
  } catch (e) {
    throw e instanceof CopyError ? e : new CopyError((e as { code?: string }).code ?? "ERROR", `${dir ?? "."}: ${(e as Error).message}`);
  }
  const readOnly = writable !== true;
  const listener = await builderFor(provider, keyFile).bind(`${bind}:${port}`);
  // what is exposed, said once at start
  console.log(`async-rdma serve: serving ${root} on ${bind}:${listener.port}`);
  console.log(`  ${readOnly ? "read-only (--writable accepts uploads)" : "writable: clients may upload files and create directories and links"}; authentication ${keyFile !== undefined ? "on" : "off (--auth-key-file)"}; ${loopback(bind) ? "this machine only" : "reachable from the network"}`);
  if (!readOnly && keyFile === undefined && !loopback(bind)) console.error(`async-rdma serve: warning: anyone who can reach ${bind}:${listener.port} can write into ${root} (no --auth-key-file)`);
  const stop = (): void => void listener.close().finally(() => process.exit(0));
  process.once("SIGINT", stop);
  process.once("SIGTERM", stop);
  const perAddress = new Map<string, number>();
  for await (const rdma of listener) {
    // One client address holds at most --max-per-source connections: past it, a new one is closed at once.
    const from = rdma.peer.address;
    const n = perAddress.get(from) ?? 0;
    if (n >= perSource) {
      console.error(`async-rdma serve: refused a connection from ${from}: it holds ${n} already (--max-per-source ${perSource})`);
      void rdma.close();
      continue;
    }
    perAddress.set(from, n + 1);
    const session = new Session(rdma, { root, readOnly, keepSetid });
    sessions.add(session);
    // A copy keeps at most its depth (≤ MAX_DEPTH) of chunk calls and a few file calls in flight;
    // more calls wait (back-pressure). The bound also caps what queued replies (a large `list`)
    // can pin per connection: maxQueuedBytes + maxInFlight replies.
    void new RpcServer(handlers(session), { maxInFlight: MAX_DEPTH + 32 })
      .serve(rdma)
      .catch((e: unknown) => console.error(`async-rdma serve: a connection from ${rdma.peer.address} failed: ${(e as Error).message}`))
      .finally(() => {
        const left = (perAddress.get(from) ?? 1) - 1;
        if (left > 0) perAddress.set(from, left);
        else perAddress.delete(from);
        return session.end();
      });
  }
}
