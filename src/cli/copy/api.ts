/**
 * async-rdma/cp: the `async-rdma cp` client as a library, for programs.
 *
 * `copy(sources, dest, options)` copies to or from an `async-rdma serve`
 * server exactly as the command does (same protocol, checks, resume), and
 * returns a `CopyJob`: an EventEmitter of `"progress"` (after every chunk or
 * batch) and `"fileError"` (a file that could not be copied; the copy goes
 * on), and a promise of the result (`await job`, or `job.done`). An
 * AbortSignal stops it: the connection is closed, the copy rejects with a
 * CopyError "ABORTED" and a later copy with `resume: true` continues it.
 *
 * It lives in cli/copy (the top layer, beside the command it shares all of
 * its code with) and is exported as the package's "./cp": nothing below cli
 * imports it, so the layers are unchanged.
 *
 * @example
 * import { copy } from "async-rdma/cp";
 * const job = copy("big.iso", "fileserver:isos/", { signal: AbortSignal.timeout(600_000) });
 * job.on("progress", (p) => console.log(`${p.bytes}/${p.total}`));
 * const result = await job; // { files, bytes, seconds, ... }
 */
import { EventEmitter } from "node:events";
import { Readable, Writable } from "node:stream";
import { RdmaBuilder, type ProviderChoice } from "../../index.js";
import { copyPaths, defaultOptions, type Options } from "./cp.js";
import { CopyError } from "./paths.js";
import { Progress, type CopyFileError, type CopyProgress } from "./progress.js";

export { CopyError } from "./paths.js";
export type { CopyFileError, CopyProgress } from "./progress.js";

/** Options of `copy()`; every one has the command's default. */
export interface CopyOptions {
  /** Copy directories (`-r`). */
  recursive?: boolean;
  /** Continue an interrupted copy (`--resume`). */
  resume?: boolean;
  /** CRC-32 per chunk and a digest per file (default true; `--no-verify`). */
  verify?: boolean;
  /** Bytes per chunk, 4 KiB to 16 MiB (default 1 MiB). */
  chunk?: number;
  /** Chunks in flight, 1 to 64 (default 8). */
  depth?: number;
  /** How long the server may take to answer a call, ms (default 120000; 0: no limit). */
  timeoutMs?: number;
  /** Downloads keep setuid/setgid bits (default false). */
  keepSetid?: boolean;
  /** The provider (default "auto"); ignored when `builder` is given. */
  provider?: ProviderChoice;
  /** The builder the connection is made with (its provider, auth key, device; its peer timeout is set to 10 s); default a new RdmaBuilder. */
  builder?: RdmaBuilder;
  /** Stops the copy: it rejects with CopyError "ABORTED"; what was copied stays (resumable). */
  signal?: AbortSignal;
}

/** What a copy did. */
export interface CopyResult {
  /** Files copied. */
  files: number;
  /** Files skipped whole (resume: already there). */
  filesSkipped: number;
  /** Bytes copied. */
  bytes: number;
  /** Bytes found already there (resume) and not copied. */
  skipped: number;
  seconds: number;
  /** Calls made to the server. */
  calls: number;
}

/**
 * A running copy: events `"progress"` (CopyProgress) and `"fileError"`
 * (CopyFileError), and its result (await it, or `done`).
 */
export class CopyJob extends EventEmitter<{ progress: [CopyProgress]; fileError: [CopyFileError] }> implements PromiseLike<CopyResult> {
  /**
   * Resolves when everything was copied; rejects with a CopyError: "ABORTED"
   * when the signal aborted, "USAGE" for bad arguments, else the code of the
   * first failure, with `errors` listing every file that failed.
   */
  readonly done: Promise<CopyResult>;

  /** @internal */
  constructor(run: (job: CopyJob) => Promise<CopyResult>) {
    super();
    // started on the next turn: listeners added right after copy() returns hear everything
    this.done = Promise.resolve().then(() => run(this));
  }

  then<A = CopyResult, B = never>(onfulfilled?: ((v: CopyResult) => A | PromiseLike<A>) | null, onrejected?: ((e: unknown) => B | PromiseLike<B>) | null): Promise<A | B> {
    return this.done.then(onfulfilled, onrejected);
  }
}

function checkInt(v: unknown, what: string, min: number, max: number): number {
  if (!Number.isInteger(v) || (v as number) < min || (v as number) > max) throw new CopyError("USAGE", `copy: ${what} must be an integer from ${min} to ${max}`);
  return v as number;
}

/**
 * Copies `sources` to `dest` with the command's semantics: a remote path is
 * `host:path` or `host:port:path`; either every source is remote (download)
 * or `dest` is (upload). A source may be a Readable (uploaded as the one
 * file `dest` names) and `dest` a Writable (the one remote file `sources`
 * names is written to it, in order).
 */
export function copy(sources: string | readonly string[] | Readable, dest: string | Writable, options: CopyOptions = {}): CopyJob {
  return new CopyJob(async (job) => {
    const opts: Options = defaultOptions();
    opts.mode = "none";
    if (options.recursive !== undefined) opts.recursive = options.recursive === true;
    if (options.resume !== undefined) opts.resume = options.resume === true;
    if (options.verify !== undefined) opts.verify = options.verify !== false;
    if (options.keepSetid !== undefined) opts.keepSetid = options.keepSetid === true;
    if (options.chunk !== undefined) opts.chunk = checkInt(options.chunk, "chunk", 4096, 16 << 20);
    if (options.depth !== undefined) opts.depth = checkInt(options.depth, "depth", 1, 64);
    if (options.timeoutMs !== undefined) opts.timeoutMs = checkInt(options.timeoutMs, "timeoutMs", 0, 86_400_000);
    const { signal } = options;
    if (signal !== undefined && !(signal instanceof AbortSignal)) throw new CopyError("USAGE", "copy: signal must be an AbortSignal");
    const stdin = sources instanceof Readable ? sources : undefined;
    const stdout = dest instanceof Writable ? dest : undefined;
    const srcs = stdin !== undefined ? ["-"] : typeof sources === "string" ? [sources] : [...(sources as readonly string[])];
    if (srcs.length === 0 || srcs.some((x) => typeof x !== "string" || x === "" || (x === "-" && stdin === undefined))) throw new CopyError("USAGE", "copy: sources must be paths (or one Readable)");
    if (stdout === undefined && (typeof dest !== "string" || dest === "" || dest === "-")) throw new CopyError("USAGE", "copy: dest must be a path (or a Writable)");
    const p = new Progress("none", { progress: (x) => job.emit("progress", x), error: (x) => job.emit("fileError", x) });
    const builder = (): RdmaBuilder => options.builder ?? (options.provider !== undefined ? new RdmaBuilder().setProvider(options.provider) : new RdmaBuilder());
    await copyPaths(srcs, stdout !== undefined ? "-" : (dest as string), { opts, builder, p, ...(signal ? { signal } : {}), ...(stdin ? { stdin } : {}), ...(stdout ? { stdout } : {}) });
    if (signal?.aborted) {
      const e = new CopyError("ABORTED", `the copy was aborted${p.done > 0 ? ` after ${p.done} bytes (resume: true continues it)` : ""}`);
      e.errors = p.errors;
      e.cause = signal.reason;
      throw e;
    }
    const r = p.result();
    if (!r.ok) {
      const first = p.errors[0]!;
      const e = new CopyError(first.code, `${p.errors.length} failed; the first: ${first.path}: ${first.message}`);
      e.errors = p.errors;
      throw e;
    }
    return { files: r.files, filesSkipped: r.filesSkipped, bytes: r.bytes, skipped: r.skipped, seconds: r.seconds, calls: r.calls };
  });
}
