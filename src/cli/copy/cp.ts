/**
 * async-rdma cp [options] src... dest   (a remote path is host[:port]:path)
 *
 * The client of `async-rdma serve`. Data moves by one-sided RDMA between a
 * ring of registered chunk buffers on each side (slot k here ↔ slot k of the
 * ring the server shares with this connection only):
 *   upload:   read the file into slot k, RDMA WRITE it into the server's slot
 *             k and call `put` (same QP: the call arrives after the data);
 *             the server checks the chunk's CRC and writes it from its slot.
 *   download: call `get`: the server reads the chunk into its slot k and
 *             answers its CRC; we RDMA READ the slot, check, and write.
 * `depth` chunks are in flight, so disk and network overlap. Small files
 * travel the same way, many per slot and per call (a batch fills one slot).
 * `-` as the source reads stdin, as the destination writes stdout
 * (stream.ts). The library's copy() (api.ts) runs the same code.
 * See docs/cp.md.
 */
import { lstat, readdir, realpath, stat } from "node:fs/promises";
import { realpathSync } from "node:fs";
import { basename, dirname, join, posix } from "node:path";
import { RpcClient, RpcError } from "../../rpc/index.js";
import { RdmaError, type LocalMr, type Rdma, type RdmaBuilder, type RemoteMr } from "../../index.js";
import { builderFor, DEFAULT_PORT, parseIntArg, parseSize } from "./common.js";
import { checkRel, CopyError, resolveInsideSync, withPath } from "./paths.js";
import { allocRing, chunkCount, chunkLen, FileSink, FileSource, sameSecond } from "./files.js";
import { readSmallInto, writeBatch, type BatchFile } from "./batch.js";
import { makeDir, makeLink, mapLimit, MAX_ENTRIES, peerMode, setTimes, walk } from "./tree.js";
import { checkListing, encodeGet, encodePut, fromJson, smallFiles, toJson, type Entry, type Result, type SmallFile } from "./protocol.js";
import { Progress, type OutputMode, type ProgressListener } from "./progress.js";
import { spool, StreamSink } from "./stream.js";
import type { Readable, Writable } from "node:stream";

/** Measured defaults (docs/performance.md, "cp"). */
export const DEFAULT_CHUNK = 1024 * 1024;
export const DEFAULT_DEPTH = 8;
/**
 * Every call to the server has a deadline: a server that is alive (its
 * transport answers) but never replies must not hang cp. The longest
 * legitimate call is a large file's final flush or a listing of a very
 * large tree, well under this.
 */
export const DEFAULT_TIMEOUT_S = 120;
/** Files up to this size travel inline in batches. */
const SMALL = 256 * 1024;
const BATCH_FILES = 1024;
/**
 * Measurement switch of the command (documented in docs/cp.md, "Environment"):
 * uploads pulled by the server with RDMA READ from this side's ring instead
 * of pushed with RDMA WRITE into the server's. docs/performance.md compares
 * the two; the push is faster, so it is no option.
 */
const PULL_ENV = "ASYNC_RDMA_CP_UPLOAD";

export const USAGE = `usage: async-rdma cp [options] src... dest
Copies files to or from an \`async-rdma serve\` server. A remote path is
host:path or host:port:path (scp syntax; paths are relative to the served
directory). Either every src is remote (download) or dest is (upload).
A src of - uploads stdin (dest names the file); a dest of - writes the
one remote file named by src to stdout (progress and summary on stderr).

  -r, --recursive         copy directories
      --resume            continue an interrupted copy: files already complete
                          (same size and mtime) are skipped, a partial file
                          continues from its verified prefix
      --no-verify         no CRC-32 checks (faster, less CPU)
      --keep-setid        downloads keep the setuid/setgid bits the server sends
                          (by default they are dropped)
      --chunk <size>      bytes per chunk (default 1m; 4k to 16m)
      --depth <n>         chunks in flight (default ${DEFAULT_DEPTH}; 1 to 64)
      --timeout <s>       seconds the server may take to answer a call
                          (default ${DEFAULT_TIMEOUT_S}; 0: no limit)
      --provider <p>      tcp, verbs or auto (default auto)
      --auth-key-file <f> authenticate with the key in this file (not
                          readable by others: chmod 600)
      --json              progress and result as JSON lines on stdout
  -q, --quiet             no progress, no summary
  -h, --help              this help

Examples:
  async-rdma cp big.iso server:isos/          upload into the directory isos/
  async-rdma cp -r server:7000:photos ./      download a tree from port 7000
  async-rdma cp --resume big.iso server:      continue after an interruption
  tar c dir | async-rdma cp - server:dir.tar  upload a pipe
  async-rdma cp server:dir.tar - | tar x      download into a pipe
`;

interface Remote {
  host: string;
  port: number;
  path: string;
}

/** host:path, host:port:path, [v6]:path, [v6]:port:path; local when it starts with / or . or has no colon. */
export function parseRemote(s: string): Remote | null {
  if (s.startsWith("/") || s.startsWith(".")) return null;
  let host: string;
  let rest: string;
  if (s.startsWith("[")) {
    const e = s.indexOf("]:");
    if (e < 0) return null;
    host = s.slice(1, e);
    rest = s.slice(e + 2);
  } else {
    const c = s.indexOf(":");
    if (c <= 0) return null;
    host = s.slice(0, c);
    if (host.includes("/")) return null;
    rest = s.slice(c + 1);
  }
  const m = /^(\d{1,5}):(.*)$/s.exec(rest);
  if (m) return { host, port: Number(m[1]), path: m[2]! };
  return { host, port: DEFAULT_PORT, path: rest };
}

/** The settings of one copy (the command's options, or the library's CopyOptions). */
export interface Options {
  recursive: boolean;
  resume: boolean;
  verify: boolean;
  chunk: number;
  depth: number;
  provider: string | undefined;
  keyFile: string | undefined;
  mode: OutputMode;
  /** Downloads keep the setuid/setgid bits the server sends (--keep-setid). */
  keepSetid: boolean;
  /** Deadline of every call to the server, ms (0: none). */
  timeoutMs: number;
  /** Uploads pulled by the server with RDMA READ (the measurement switch ASYNC_RDMA_CP_UPLOAD=read). */
  pull: boolean;
}

/** Slot numbers of the ring, from a free list. */
class Slots {
  private readonly free: number[];
  private readonly waiting: ((k: number) => void)[] = [];
  constructor(n: number) {
    this.free = Array.from({ length: n }, (_, i) => n - 1 - i);
  }
  acquire(): Promise<number> {
    const k = this.free.pop();
    return k !== undefined ? Promise.resolve(k) : new Promise((r) => this.waiting.push(r));
  }
  release(k: number): void {
    const w = this.waiting.shift();
    if (w) w(k);
    else this.free.push(k);
  }
}

function codeOf(e: unknown): string {
  return typeof (e as { code?: unknown })?.code === "string" ? (e as { code: string }).code : "ERROR";
}

function msgOf(e: unknown): string {
  const m = e instanceof Error ? e.message : String(e);
  // RpcError prefixes the method name: the user does not need it
  return e instanceof RpcError ? m.replace(/^[a-zA-Z]+: /, "") : m;
}

/** What a TIMEOUT means to the user. */
function silentNote(e: unknown, opts: Options): string {
  return codeOf(e) === "TIMEOUT" ? ` (the server did not answer within --timeout ${opts.timeoutMs / 1000} s)` : "";
}

/** The connection died: nothing more can be copied on it. */
function fatal(e: unknown): boolean {
  return e instanceof RdmaError || (e instanceof RpcError && e.code === "PROTOCOL");
}

/**
 * The error to report once the connection is gone: a chunk task that was
 * touching the ring when it was released fails with a TypeError (detached
 * memory); the cause is the lost connection.
 */
function lost(rdma: Rdma, e: unknown): unknown {
  if (e instanceof RdmaError || !rdma.isClosed) return e;
  return new RdmaError("CONNECTION_CLOSED", "the connection to the server closed");
}

class Session {
  readonly slots: Slots;
  readonly local: Uint8Array;

  constructor(
    readonly rdma: Rdma,
    readonly rpc: RpcClient,
    readonly ring: LocalMr,
    readonly rmr: RemoteMr,
    readonly chunk: number,
    readonly depth: number,
    readonly readOnly: boolean,
    readonly opts: Options,
    readonly p: Progress,
    /** The ring is aligned for O_DIRECT writes (downloads' FileSink). */
    readonly direct: boolean,
  ) {
    this.slots = new Slots(depth);
    this.local = ring.bytes;
  }

  /** `directDir`: downloads write under this local directory (the ring is aligned for it). */
  static async open(r: Remote, b: RdmaBuilder, opts: Options, p: Progress, directDir: string | null, signal: AbortSignal | undefined): Promise<Session> {
    b.setPeerTimeout(10_000);
    const rdma = await b.connect({ host: r.host, port: r.port }, signal ? { signal } : undefined);
    try {
      const rpc = new RpcClient(rdma, opts.timeoutMs > 0 ? { timeoutMs: opts.timeoutMs } : {});
      // the server may grant fewer slots, never another chunk size: this ring is big enough
      const { ring, direct } = allocRing(rdma, opts.chunk * opts.depth, opts.chunk, directDir);
      if (opts.pull) rdma.share("cp-client-ring", ring, { access: "read" });
      const h = fromJson(await rpc.call("hello", toJson({ version: 1, chunk: opts.chunk, depth: opts.depth, verify: opts.verify, pull: opts.pull })));
      const chunk = Number(h.chunk);
      const depth = Number(h.depth);
      if (chunk !== opts.chunk || !(depth >= 1 && depth <= opts.depth)) throw new CopyError("PROTOCOL", `the server answered chunk ${chunk}, depth ${depth}`);
      const rmr = await rdma.openSharedMr(String(h.ring), opts.timeoutMs > 0 ? { timeoutMs: opts.timeoutMs } : {});
      return new Session(rdma, rpc, ring, rmr, chunk, depth, h.readOnly === true, opts, p, direct);
    } catch (e) {
      await rdma.close().catch(() => {});
      throw e;
    }
  }

  async call(method: string, o: unknown): Promise<Record<string, unknown>> {
    return fromJson(await this.rpcCall(method, toJson(o)));
  }

  /** Every call goes through here: the count (in --json's result) shows what batching saves. */
  rpcCall(method: string, payload: Uint8Array): Promise<Uint8Array> {
    this.p.calls++;
    return this.rpc.call(method, payload);
  }

  async close(): Promise<void> {
    await this.rdma.close().catch(() => {});
  }

  /** Runs one chunk task per chunk index from `first`, `depth` at once; the first failure stops new ones. */
  async pipeline(size: number, first: number, task: (i: number, slot: number) => Promise<void>): Promise<void> {
    const n = chunkCount(size, this.chunk);
    let failure: unknown = null;
    const running = new Set<Promise<void>>();
    for (let i = first; i < n && failure === null; i++) {
      const slot = await this.slots.acquire();
      if (failure !== null) {
        this.slots.release(slot);
        break;
      }
      const t: Promise<void> = task(i, slot)
        .catch((e: unknown) => void (failure ??= e))
        .finally(() => {
          this.slots.release(slot);
          running.delete(t);
        });
      running.add(t);
    }
    await Promise.all(running);
    if (failure !== null) throw failure;
  }
}

/** First index where the two CRC lists differ (the verified prefix, in chunks). */
function agree(a: readonly number[], b: readonly number[]): number {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return i;
}

interface Item {
  /** Where the data is read: local absolute path (upload) or remote relative path (download). */
  from: string;
  /** Where it goes: remote relative path (upload) or local absolute path (download). */
  to: string;
  entry: Entry;
  /** Downloads: the local directory or file the server's tree lands in, and the entry's path below it. */
  base?: string;
  rel?: string;
}

/**
 * Where a download writes `i`: its path below the destination, with the
 * parent directories resolved through symlinks and checked to stay inside
 * the destination, so a link left by an earlier copy from a hostile server
 * cannot lead a later write out of it.
 */
function localTarget(i: Item, parents: Map<string, string>): string {
  if (i.base === undefined || i.rel === undefined || i.rel === "") return i.to;
  let root = parents.get("\0" + i.base);
  if (root === undefined) {
    root = realpathSync(i.base);
    parents.set("\0" + i.base, root);
  }
  return resolveInsideSync(root, i.rel, parents);
}

// ---------------------------------------------------------------- upload

/** The names and types at the top of a listing (its own entry and temporary files left out). */
function topLevel(entries: readonly Entry[]): Map<string, string> {
  return new Map(entries.filter((e) => e.path !== "" && !e.path.includes("/")).map((e) => [e.path, e.type]));
}

/**
 * --resume with one directory source into an existing directory `dest`
 * that holds nothing named after the source: is `dest` the copy an earlier
 * run made when it did not exist yet (`cp -r tree dest` makes `dest` the
 * copy of `tree` when `dest` is new, `dest/tree` when it exists)? It is when
 * everything at its top is also at the source's top, with the same type.
 * An empty directory is not: the copy goes into it, as without --resume.
 */
function earlierCopy(dest: Map<string, string>, src: Map<string, string>): boolean {
  if (dest.size === 0) return false;
  for (const [name, type] of dest) if (src.get(name) !== type) return false;
  return true;
}

async function planUpload(s: Session, srcs: string[], dest: string): Promise<Item[]> {
  const p = s.p;
  const d = fromJson(await s.rpcCall("stat", toJson({ path: dest })));
  const dtype = String(d.type);
  if (srcs.length > 1 && dtype !== "dir") throw new CopyError("ENOTDIR", `${dest || "."}: ${dtype === "none" ? "no such directory" : "is a file, a directory is expected"} (several sources)`);
  const items: Item[] = [];
  for (const src of srcs) {
    let st;
    try {
      st = await stat(src);
    } catch (e) {
      p.fail(src, codeOf(e), msgOf(withPath(e, src)));
      continue;
    }
    let base = dtype === "dir" ? posix.join(dest, basename(src)) : dest;
    if (st.isDirectory()) {
      if (!s.opts.recursive) {
        p.fail(src, "EISDIR", "is a directory (use -r)");
        continue;
      }
      if (dtype === "file" || dtype === "symlink") {
        p.fail(src, "ENOTDIR", `${dest}: the destination is a file, a directory is expected`);
        continue;
      }
      const root = await realpath(src);
      const entries = await walk(root);
      if (s.opts.resume && dtype === "dir" && srcs.length === 1 && String((await s.call("stat", { path: base })).type) === "none") {
        const theirs = checkListing((await s.call("list", { path: dest })).entries, MAX_ENTRIES);
        if (earlierCopy(topLevel(theirs), topLevel(entries))) base = dest;
      }
      for (const e of entries) items.push({ from: e.path === "" ? root : join(root, e.path), to: e.path === "" ? base : posix.join(base, e.path), entry: e });
    } else if (st.isFile()) {
      // a trailing slash names a directory, as with cp and scp
      if (dtype !== "dir" && dest.endsWith("/")) {
        p.fail(src, dtype === "none" ? "ENOENT" : "ENOTDIR", `${dest}: ${dtype === "none" ? "no such directory" : "not a directory"}`);
        continue;
      }
      items.push({ from: src, to: base, entry: { path: "", type: "file", size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs } });
    } else p.fail(src, "EINVAL", "not a regular file or directory");
  }
  return items;
}

async function upload(s: Session, items: Item[]): Promise<void> {
  const p = s.p;
  if (s.readOnly) throw new CopyError("EROFS", "the server is read-only");
  await transferTree(s, items, {
    mkdirs: async (dirs, times) => resultsOf(await s.call("mkdirs", { dirs: dirs.map((i) => ({ path: i.to, mode: i.entry.mode, mtimeMs: i.entry.mtimeMs })), times })),
    links: async (links) => resultsOf(await s.call("symlinks", { links: links.map((i) => ({ path: i.to, target: i.entry.target })) })),
    same: async (files) => (await s.call("check", { files: files.map((i) => ({ path: i.to, size: i.entry.size, mtimeMs: i.entry.mtimeMs })) })).same as boolean[],
    small: async (batch) => {
      const slot = await s.slots.acquire();
      try {
        const at = slot * s.chunk;
        const files: SmallFile[] = [];
        const ok: Item[] = [];
        let off = 0;
        for (const i of batch) {
          try {
            // read straight into the registered slot; a file named on the command line is
            // followed (as scp does), inside a tree links are copied as links
            const r = readSmallInto(i.from, i.entry.path === "", s.local.subarray(at + off, at + s.chunk), s.opts.verify);
            files.push({ path: i.to, ...r.meta, crc: r.crc, off });
            ok.push(i);
            off += r.meta.size;
          } catch (e) {
            p.fail(i.from, codeOf(e), msgOf(withPath(e, i.from)));
          }
        }
        if (files.length === 0) return;
        p.file = ok[ok.length - 1]!.to;
        // the WRITE is posted before the call: on one QP the bytes are in place when it arrives
        const wrote = off > 0 ? s.rdma.write(s.ring.slice(at, at + off), s.rmr.slice(at, at + off)) : Promise.resolve();
        const [, reply] = await Promise.all([wrote, s.call("putSmall", { slot, files })]);
        resultsOf(reply).forEach((x, k) => {
          const i = ok[k]!;
          if (x.ok) done(p, i);
          else p.fail(i.to, x.code, x.message);
        });
      } finally {
        s.slots.release(slot);
      }
    },
    big: async (i) => {
      const src = await FileSource.open(i.from, true);
      let id = -1;
      try {
        p.file = i.to;
        const o = await s.call("open", { path: i.to, ...src.meta, resume: s.opts.resume });
        id = Number(o.id);
        const theirs = (o.existing as number[]) ?? [];
        let first = 0;
        if (theirs.length > 0) {
          first = agree(await src.prefixCrcs(s.chunk, theirs.length), theirs);
          const r = await s.call("accept", { id, chunks: first });
          p.skipped += Number(r.bytes);
        }
        const size = src.st.size;
        await s.pipeline(size, first, async (k, slot) => {
          const off = k * s.chunk;
          const n = chunkLen(size, s.chunk, k);
          const view = s.local.subarray(slot * s.chunk, slot * s.chunk + n);
          const crc = await src.readChunk(k, s.chunk, view, s.opts.verify);
          const at = slot * s.chunk;
          if (s.opts.pull) await s.rpcCall("pull", encodePut(id, slot, off, n, crc));
          // WRITE then the call, on one QP: the data is in place when `put` arrives
          else await Promise.all([s.rdma.write(s.ring.slice(at, at + n), s.rmr.slice(at, at + n)), s.rpcCall("put", encodePut(id, slot, off, n, crc))]);
          p.add(n);
        });
        if (await src.changed()) throw new CopyError("SOURCE_CHANGED", "the source changed during the copy; rerun with --resume");
        await s.call("finish", { id, digest: src.digest() });
        id = -1;
        p.files++;
      } finally {
        if (id >= 0) await s.call("abort", { id }).catch(() => {});
        await src.close();
      }
    },
  });
}

function done(p: Progress, i: Item): void {
  p.files++;
  p.add(i.entry.size);
}

function resultsOf(o: Record<string, unknown>): Result[] {
  const r = o.results;
  if (!Array.isArray(r)) throw new CopyError("PROTOCOL", "results missing");
  return r as Result[];
}

interface Ends {
  mkdirs(dirs: Item[], times: boolean): Promise<Result[]>;
  links(links: Item[]): Promise<Result[]>;
  same(files: Item[]): Promise<boolean[]>;
  small(batch: Item[]): Promise<void>;
  big(i: Item): Promise<void>;
}

/** The order of a copy, the same both ways: directories, quick check, small files in batches, large files, links, directory times. */
async function transferTree(s: Session, items: Item[], ends: Ends): Promise<void> {
  const p = s.p;
  const dirs = items.filter((i) => i.entry.type === "dir");
  const links = items.filter((i) => i.entry.type === "symlink");
  let files = items.filter((i) => i.entry.type === "file");
  p.total = files.reduce((a, i) => a + i.entry.size, 0);
  const report = (list: Item[], r: Result[]): void =>
    r.forEach((x, k) => {
      if (!x.ok) p.fail(list[k]!.to, x.code, x.message);
    });
  if (dirs.length > 0) report(dirs, await ends.mkdirs(dirs, false));
  if (s.opts.resume && files.length > 0) {
    const same = await ends.same(files);
    files = files.filter((i, k) => {
      if (!same[k]) return true;
      p.skipped += i.entry.size;
      p.filesSkipped++;
      return false;
    });
  }
  // a batch fills at most one slot of the ring
  const limit = Math.min(SMALL, s.chunk);
  const small = files.filter((i) => i.entry.size <= limit);
  const big = files.filter((i) => i.entry.size > limit);
  const batches: Item[][] = [];
  let cur: Item[] = [];
  let bytes = 0;
  for (const i of small) {
    if (cur.length >= BATCH_FILES || (cur.length > 0 && bytes + i.entry.size > s.chunk)) {
      batches.push(cur);
      cur = [];
      bytes = 0;
    }
    cur.push(i);
    bytes += i.entry.size;
  }
  if (cur.length > 0) batches.push(cur);
  await mapLimit(batches, s.depth, async (b) => {
    try {
      await ends.small(b);
    } catch (e) {
      if (fatal(e) || s.rdma.isClosed) throw lost(s.rdma, e);
      for (const i of b) p.fail(i.to, codeOf(e), msgOf(e));
    }
  });
  for (const i of big) {
    try {
      await ends.big(i);
    } catch (e) {
      if (fatal(e) || s.rdma.isClosed) throw lost(s.rdma, e);
      p.fail(i.to, codeOf(e), msgOf(e));
    }
  }
  // links last: no file of this copy is ever written through a link it created
  // (a hostile server listing `a -> /etc` and then `a/passwd`)
  if (links.length > 0) report(links, await ends.links(links));
  if (dirs.length > 0) report(dirs, await ends.mkdirs([...dirs].reverse(), true));
  p.tick(true);
}

// ---------------------------------------------------------------- download

/** topLevel() of a local directory. */
async function localTopLevel(dir: string): Promise<Map<string, string>> {
  const out = new Map<string, string>();
  for (const n of await readdir(dir)) {
    if (n.startsWith(".") && n.endsWith(".rdma-part")) continue;
    const st = await lstat(join(dir, n)).catch(() => null);
    out.set(n, st?.isSymbolicLink() ? "symlink" : st?.isDirectory() ? "dir" : st?.isFile() ? "file" : "other");
  }
  return out;
}

async function planDownload(s: Session, srcs: string[], dest: string): Promise<Item[]> {
  const p = s.p;
  const dst = await lstat(dest).catch(() => null);
  const isDir = dst?.isDirectory() === true || (dst?.isSymbolicLink() === true && (await stat(dest).catch(() => null))?.isDirectory() === true);
  if (srcs.length > 1 && !isDir) throw new CopyError("ENOTDIR", `${dest}: ${dst ? "is a file, a directory is expected" : "no such directory"} (several sources)`);
  const items: Item[] = [];
  for (const src of srcs) {
    let answer: Record<string, unknown>;
    try {
      // a link named on the command line is followed (as for uploads, and as scp does); the
      // server answers the path it resolved to, inside the served tree
      answer = await s.call("list", { path: src, follow: true });
    } catch (e) {
      if (fatal(e)) throw e;
      p.fail(src, codeOf(e), msgOf(e));
      continue;
    }
    // the whole listing is refused when any of it is malformed (PROTOCOL: the server is broken or hostile)
    const entries = checkListing(answer.entries, MAX_ENTRIES);
    const top = entries[0];
    if (!top) {
      p.fail(src, "EINVAL", "not a regular file, directory or link (sockets, FIFOs and devices are not copied)");
      continue;
    }
    if (top.type === "symlink") {
      // a server that does not follow links (older than this cp) lists the link itself
      p.fail(src, "ELOOP", "is a symlink on the server, which did not follow it (a newer async-rdma serve does)");
      continue;
    }
    const from = typeof answer.path === "string" ? checkRel(answer.path) : src;
    let base = isDir ? join(dest, basename(src) || ".") : dest;
    if (top.type === "dir") {
      if (!s.opts.recursive) {
        p.fail(src, "EISDIR", "is a directory (use -r)");
        continue;
      }
      if (dst && !isDir && srcs.length === 1) {
        p.fail(dest, "ENOTDIR", "the destination is a file, a directory is expected");
        continue;
      }
      if (s.opts.resume && isDir && srcs.length === 1 && basename(src) !== "" && (await lstat(base).catch(() => null)) === null && earlierCopy(await localTopLevel(dest), topLevel(entries))) base = dest;
    } else if (!isDir && dest.endsWith("/")) {
      // a trailing slash names a directory, as with cp and scp
      p.fail(dest, dst ? "ENOTDIR" : "ENOENT", dst ? "not a directory" : "no such directory");
      continue;
    }
    for (const e of entries) {
      const rel = e.path;
      items.push({ from: rel === "" ? from : posix.join(from, rel), to: rel === "" ? base : join(base, rel), entry: e, base, rel });
    }
  }
  return items;
}

async function download(s: Session, items: Item[]): Promise<void> {
  const p = s.p;
  // targets are resolved when written (the directories of this copy are created first)
  const parents = new Map<string, string>();
  const at_ = (i: Item): string => localTarget(i, parents);
  // the server chooses modes: setuid/setgid only when the user asked for them
  const mode = (m: number): number => peerMode(m, s.opts.keepSetid);
  const each = async (list: Item[], fn: (i: Item) => Promise<void>): Promise<Result[]> =>
    mapLimit(list, 1, async (i) => {
      try {
        await fn(i);
        return { ok: true } as Result;
      } catch (e) {
        return { ok: false, code: codeOf(e), message: msgOf(withPath(e, i.to)) };
      }
    });
  await transferTree(s, items, {
    mkdirs: (dirs, times) => each(dirs, async (i) => (times ? setTimes(at_(i), mode(i.entry.mode), i.entry.mtimeMs) : makeDir(at_(i), mode(i.entry.mode) | 0o700))),
    links: (links) => each(links, async (i) => makeLink(at_(i), i.entry.target ?? "")),
    same: (files) =>
      mapLimit(files, 16, async (i) => {
        const st = await lstat(at_(i)).catch(() => null);
        return st !== null && st.isFile() && st.size === i.entry.size && sameSecond(st.mtimeMs, i.entry.mtimeMs);
      }),
    small: async (batch) => {
      const slot = await s.slots.acquire();
      try {
        const byPath = new Map(batch.map((i) => [checkRel(i.from), i]));
        const files = smallFiles(await s.call("getSmall", { slot, paths: [...byPath.keys()] }), "files", s.chunk, batch.length);
        const at = slot * s.chunk;
        let end = 0;
        for (const f of files) if ("crc" in f) end = f.off + f.size;
        if (end > 0) await s.rdma.read(s.ring.slice(at, at + end), s.rmr.slice(at, at + end));
        const todo: { i: Item; b: BatchFile }[] = [];
        for (const f of files) {
          const i = byPath.get(f.path);
          if (!i) throw new CopyError("PROTOCOL", `the server sent ${JSON.stringify(f.path)}, which was not asked for`);
          if (!("crc" in f)) p.fail(i.from, f.code, f.message);
          else {
            try {
              todo.push({ i, b: { abs: at_(i), f: { ...f, mode: mode(f.mode) }, data: s.local.subarray(at + f.off, at + f.off + f.size) } });
            } catch (e) {
              p.fail(i.to, codeOf(e), msgOf(withPath(e, i.to)));
            }
          }
        }
        if (todo.length > 0) p.file = todo[todo.length - 1]!.i.from;
        const errs = await writeBatch(
          todo.map((t) => t.b),
          s.opts.verify,
        );
        errs.forEach((e, k) => {
          const { i } = todo[k]!;
          if (e === null) done(p, i);
          else p.fail(i.to, codeOf(e), msgOf(withPath(e, i.to)));
        });
      } finally {
        s.slots.release(slot);
      }
    },
    big: async (i) => {
      p.file = i.from;
      const o = await s.call("openRead", { path: i.from });
      const id = Number(o.id);
      let open = true;
      let sink: FileSink | null = null;
      try {
        const meta = { size: Number(o.size), mode: mode(Number(o.mode)), mtimeMs: Number(o.mtimeMs) };
        sink = await FileSink.open(at_(i), meta, s.chunk, s.opts.resume, s.opts.verify, s.direct);
        let first = 0;
        if (sink.existing.length > 0) {
          const theirs = (await s.call("sums", { id, count: sink.existing.length })).crcs as number[];
          first = agree(sink.existing, theirs);
          p.skipped += sink.accept(first);
        }
        const k0 = sink;
        await s.pipeline(meta.size, first, async (k, slot) => {
          const off = k * s.chunk;
          const n = chunkLen(meta.size, s.chunk, k);
          const r = await s.rpcCall("get", encodeGet(id, slot, off, n));
          const crc = new DataView(r.buffer, r.byteOffset, r.byteLength).getUint32(0);
          const at = slot * s.chunk;
          await s.rdma.read(s.ring.slice(at, at + n), s.rmr.slice(at, at + n));
          await k0.write(off, s.local.subarray(at, at + n), crc);
          p.add(n);
        });
        const c = await s.call("closeRead", { id });
        open = false;
        if (c.changed === true) throw new CopyError("SOURCE_CHANGED", "the source changed during the copy; rerun with --resume");
        await sink.finish(String(c.digest));
        sink = null;
        p.files++;
      } finally {
        await sink?.abort();
        if (open) await s.call("closeRead", { id }).catch(() => {});
      }
    },
  });
}

// ---------------------------------------------------------------- command

/** The directory a download into `dest` writes under: dest itself, or its parent. */
async function directoryOf(dest: string): Promise<string> {
  return (await stat(dest).catch(() => null))?.isDirectory() === true ? dest : dirname(dest) || ".";
}

/** Default settings of a copy (the command's defaults). */
export function defaultOptions(): Options {
  return { recursive: false, resume: false, verify: true, chunk: DEFAULT_CHUNK, depth: DEFAULT_DEPTH, provider: undefined, keyFile: undefined, mode: "human", keepSetid: false, timeoutMs: DEFAULT_TIMEOUT_S * 1000, pull: false };
}

/** `async-rdma cp args...`; `listener` hears the copy's progress and errors (the command prints them itself). */
export async function cp(args: string[], listener: ProgressListener | null = null): Promise<number> {
  const opts = defaultOptions();
  opts.pull = process.env[PULL_ENV] === "read";
  const paths: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === "-h" || a === "--help") {
      process.stdout.write(USAGE);
      return 0;
    } else if (a === "-r" || a === "--recursive") opts.recursive = true;
    else if (a === "--resume") opts.resume = true;
    else if (a === "--no-verify") opts.verify = false;
    else if (a === "--keep-setid") opts.keepSetid = true;
    else if (a === "--chunk") {
      opts.chunk = parseSize(args[++i], "--chunk");
      if (opts.chunk < 4096 || opts.chunk > 16 * 1024 * 1024) throw new CopyError("USAGE", "--chunk must be between 4k and 16m");
    } else if (a === "--depth") opts.depth = parseIntArg(args[++i], "--depth", 1, 64);
    else if (a === "--provider") opts.provider = args[++i];
    else if (a === "--timeout") opts.timeoutMs = parseIntArg(args[++i], "--timeout", 0, 86_400) * 1000;
    else if (a === "--auth-key-file") opts.keyFile = args[++i];
    else if (a === "--json") opts.mode = "json";
    else if (a === "-q" || a === "--quiet") opts.mode = opts.mode === "json" ? "json" : "quiet";
    else if (a === "--") paths.push(...args.slice(i + 1)), (i = args.length);
    else if (a.startsWith("-") && a !== "-") throw new CopyError("USAGE", `unknown option ${a} (async-rdma cp --help)`);
    else paths.push(a);
  }
  if (paths.length < 2) throw new CopyError("USAGE", "cp needs at least one source and a destination (async-rdma cp --help)");
  const dest = paths.pop()!;
  const p = new Progress(opts.mode, listener);
  // stdout carries the data: what cp says goes to stderr
  if (dest === "-") p.out = process.stderr;
  await copyPaths(paths, dest, { opts, builder: () => builderFor(opts.provider, opts.keyFile), p, stdin: process.stdin, stdout: process.stdout });
  p.summary();
  return p.errors.length === 0 ? 0 : 1;
}

/** What one copy runs with besides its paths. */
export interface CopyRun {
  opts: Options;
  /** Called once the paths are checked (a usage error comes first). */
  builder: () => RdmaBuilder;
  p: Progress;
  /** Aborts the copy: the connection is closed, what is being copied fails (and stays resumable). */
  signal?: AbortSignal;
  /** The source `-`. */
  stdin?: Readable;
  /** The destination `-`. */
  stdout?: Writable;
}

/**
 * Copies `srcs` to `dest` (the command's semantics; `-` is `run.stdin` as a
 * source, `run.stdout` as the destination). What fails is recorded in
 * `run.p.errors`; throws only on a usage error.
 */
export async function copyPaths(srcs: readonly string[], dest: string, run: CopyRun): Promise<void> {
  const { opts, p, signal } = run;
  const dr = dest === "-" ? null : parseRemote(dest);
  const sr = srcs.map((x) => (x === "-" ? null : parseRemote(x)));
  let remote: Remote;
  let up: boolean;
  if (dr && sr.every((x) => x === null)) {
    remote = dr;
    up = true;
  } else if (!dr && sr.length > 0 && sr.every((x) => x !== null)) {
    remote = sr[0]!;
    up = false;
    if (sr.some((x) => x!.host !== remote.host || x!.port !== remote.port)) throw new CopyError("USAGE", "every remote source must be on the same server");
  } else throw new CopyError("USAGE", "either the destination is remote (upload) or every source is (download), not both and not neither");
  const fromStdin = up && srcs.includes("-");
  if (fromStdin && srcs.length > 1) throw new CopyError("USAGE", "- (stdin) must be the only source");
  if (fromStdin && run.stdin === undefined) throw new CopyError("USAGE", "- as a source needs an input stream");
  const toStdout = !up && dest === "-";
  if (toStdout && srcs.length > 1) throw new CopyError("USAGE", "- (stdout) takes one source file");
  if (toStdout && run.stdout === undefined) throw new CopyError("USAGE", "- as the destination needs an output stream");
  // a usage error (a bad --provider, a key file others can read) before anything else
  const builder = run.builder();
  const aborted = (): boolean => signal?.aborted === true;
  let spooled: Awaited<ReturnType<typeof spool>> | null = null;
  let s: Session | null = null;
  const onAbort = (): void => void s?.close();
  signal?.addEventListener("abort", onAbort, { once: true });
  try {
    if (fromStdin) {
      try {
        // read the whole stream first: the connection is not held idle while a pipe fills
        spooled = await spool(run.stdin!);
      } catch (e) {
        p.fail("-", codeOf(e), msgOf(e));
        return;
      }
    }
    try {
      if (aborted()) throw new CopyError("ABORTED", "aborted");
      s = await Session.open(remote, builder, opts, p, up || toStdout ? null : await directoryOf(dest), signal);
      if (aborted()) throw new CopyError("ABORTED", "aborted");
    } catch (e) {
      p.fail(`${remote.host}:${remote.port}`, codeOf(e), msgOf(e) + silentNote(e, opts));
      return;
    }
    try {
      if (fromStdin) await upload(s, await planStdin(s, spooled!.path, remote.path));
      else if (up) await upload(s, await planUpload(s, [...srcs], remote.path));
      else if (toStdout) await downloadTo(s, sr[0]!.path, run.stdout!);
      else await download(s, await planDownload(s, sr.map((x) => x!.path), dest));
    } catch (e0) {
      const e = lost(s.rdma, e0);
      const resumable = e instanceof RdmaError && !toStdout ? "; rerun with --resume to continue" : "";
      p.fail(p.file || `${remote.host}:${remote.port}`, codeOf(e), msgOf(e) + silentNote(e, opts) + resumable);
    } finally {
      await s.close();
    }
  } finally {
    signal?.removeEventListener("abort", onAbort);
    await spooled?.remove();
  }
}

/** The upload of a spooled stream: one file, to the path `dest` names (not a directory: a stream has no name). */
async function planStdin(s: Session, path: string, dest: string): Promise<Item[]> {
  const d = await s.call("stat", { path: dest });
  if (dest === "" || dest.endsWith("/") || String(d.type) === "dir") throw new CopyError("EISDIR", `${dest || "."}: is a directory; - (stdin) needs a file name as the destination`);
  const st = await stat(path);
  return [{ from: path, to: dest, entry: { path: "", type: "file", size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs } }];
}

/** One remote file written to `out` in order (stream.ts). */
async function downloadTo(s: Session, src: string, out: Writable): Promise<void> {
  const p = s.p;
  const answer = await s.call("list", { path: src, follow: true });
  const top = checkListing(answer.entries, MAX_ENTRIES)[0];
  if (!top || top.type !== "file") throw new CopyError(top?.type === "dir" ? "EISDIR" : "EINVAL", `${src}: ${top?.type === "dir" ? "is a directory" : "is not a regular file"}; - (stdout) takes one file`);
  const from = typeof answer.path === "string" ? checkRel(answer.path) : src;
  p.file = from;
  const o = await s.call("openRead", { path: from });
  const id = Number(o.id);
  let open = true;
  try {
    const size = Number(o.size);
    p.total = size;
    const sink = new StreamSink(out, size, s.chunk, s.opts.verify);
    await s.pipeline(size, 0, async (k, slot) => {
      const off = k * s.chunk;
      const n = chunkLen(size, s.chunk, k);
      try {
        const r = await s.rpcCall("get", encodeGet(id, slot, off, n));
        const crc = new DataView(r.buffer, r.byteOffset, r.byteLength).getUint32(0);
        const at = slot * s.chunk;
        await s.rdma.read(s.ring.slice(at, at + n), s.rmr.slice(at, at + n));
        await sink.write(off, s.local.subarray(at, at + n), crc);
      } catch (e) {
        // the chunks after this one wait for it: they fail with it
        sink.fail(e);
        throw e;
      }
      p.add(n);
    });
    const c = await s.call("closeRead", { id });
    open = false;
    if (c.changed === true) throw new CopyError("SOURCE_CHANGED", "the source changed during the copy");
    sink.finish(String(c.digest));
    p.files++;
    p.tick(true);
  } finally {
    if (open) await s.call("closeRead", { id }).catch(() => {});
  }
}
