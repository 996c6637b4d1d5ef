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
import { stat } from "node:fs/promises";
import { dirname } from "node:path";
import type { Readable, Writable } from "node:stream";
import { RdmaError, type RdmaBuilder } from "../../index.js";
import { builderFor, parseIntArg, parseSize } from "./common.js";
import { CopyError } from "./paths.js";
import { Progress, type ProgressListener } from "./progress.js";
import { spool } from "./stream.js";
import { defaultOptions, parseRemote, USAGE, type Options, type Remote } from "./cp-options.js";
import { codeOf, lost, msgOf, Session, silentNote } from "./cp-session.js";
import { planUpload, planStdin, upload } from "./cp-upload.js";
import { download, downloadTo, planDownload } from "./cp-download.js";

// The command's parts (each opens with what it owns): cp-options.ts (settings, defaults, usage,
// remote paths), cp-session.ts (the connection, ring, slots, pipeline), cp-transfer.ts (the order
// of a copy), cp-upload.ts, cp-download.ts. Re-exported for main.ts, api.ts and the tests.
export { DEFAULT_CHUNK, DEFAULT_DEPTH, DEFAULT_TIMEOUT_S, defaultOptions, parseRemote, USAGE, type Options } from "./cp-options.js";

/**
 * Measurement switch of the command (documented in docs/cp.md, "Environment"):
 * uploads pulled by the server with RDMA READ from this side's ring instead
 * of pushed with RDMA WRITE into the server's. docs/performance.md compares
 * the two; the push is faster, so it is no option.
 */
const PULL_ENV = "ASYNC_RDMA_CP_UPLOAD";

// ---------------------------------------------------------------- command

/** The directory a download into `dest` writes under: dest itself, or its parent. */
async function directoryOf(dest: string): Promise<string> {
  return (await stat(dest).catch(() => null))?.isDirectory() === true ? dest : dirname(dest) || ".";
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
