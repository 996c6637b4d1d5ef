/**
 * The two ends of one file's copy, the same on either side of the wire.
 *
 * FileSink (the receiver): writes into a temporary name beside the
 * destination (`.<name>.rdma-part`); a chunk is written only after its CRC-32
 * matched the sender's; the file is renamed to its final name only when every
 * chunk is in, the per-file digest matches the sender's, and the data was
 * flushed (fsync), with mode and mtime already set. Anything else (a failed
 * write, a full disk, a dead peer) leaves the temporary file for --resume and
 * nothing under the final name.
 *
 * FileSource (the sender): a regular file opened without following a
 * symlink; `changed()` tells whether it was modified or replaced meanwhile.
 *
 * Chunk arithmetic, the per-file digest and the per-chunk state budget are
 * in chunks.ts; rings and O_DIRECT in direct-io.ts.
 */
import { constants, type Stats } from "node:fs";
import { lstat, open, rename, stat, statfs, type FileHandle } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { crc32 } from "node:zlib";
import { CopyError } from "./paths.js";
import { chunkCount, chunkLen, chunkStateBytes, fileDigest, type StateBudget } from "./chunks.js";
import { DIRECT_ALIGN, O_DIRECT } from "./direct-io.js";

export interface FileMeta {
  size: number;
  mode: number;
  mtimeMs: number;
}

/**
 * Resume's quick check compares modification times to the second, as rsync
 * does: a time set through utimes() need not read back with the same
 * fraction (in the Soft-RoCE test guest a millisecond comparison missed a
 * file this copy had just completed).
 */
export function sameSecond(aMs: number, bMs: number): boolean {
  return Math.floor(aMs / 1000) === Math.floor(bMs / 1000);
}

export function tempName(abs: string): string {
  return join(dirname(abs), `.${basename(abs)}.rdma-part`);
}

/** Reads exactly `len` bytes at `pos` (fewer only at end of file). */
export async function readFully(fh: FileHandle, buf: Uint8Array, len: number, pos: number): Promise<number> {
  let got = 0;
  while (got < len) {
    const { bytesRead } = await fh.read(buf, got, len - got, pos + got);
    if (bytesRead === 0) break;
    got += bytesRead;
  }
  return got;
}

/** CRC-32 of the first `count` chunks of a file (as far as it has whole chunks). */
export async function chunkCrcs(fh: FileHandle, size: number, chunk: number, count: number): Promise<number[]> {
  const out: number[] = [];
  const buf = Buffer.allocUnsafe(Math.min(chunk, Math.max(size, 1)));
  for (let i = 0; i < count; i++) {
    const n = chunkLen(size, chunk, i);
    if (n <= 0) break;
    const got = await readFully(fh, buf, n, i * chunk);
    if (got < n) break;
    out.push(crc32(buf.subarray(0, n)) >>> 0);
  }
  return out;
}

/** Flushes a directory's entries (a rename is durable once its directory is). */
export async function syncDir(dir: string): Promise<void> {
  let d: FileHandle | null = null;
  try {
    d = await open(dir, constants.O_RDONLY | constants.O_DIRECTORY);
    await d.sync();
  } catch {
    /* some file systems refuse fsync on a directory; the rename stands */
  } finally {
    await d?.close().catch(() => {});
  }
}

export class FileSink {
  /** The temporary file opened again with O_DIRECT (null: every chunk through the page cache). */
  private direct: FileHandle | null = null;
  /** Bytes written with O_DIRECT (the rest went through the page cache). */
  directBytes = 0;
  /** CRC-32 of each chunk received, and a bit per chunk: received (compact: millions of chunks are possible). */
  private readonly crcs: Uint32Array;
  private readonly have: Uint8Array;
  private readonly n: number;
  private missing: number;
  /** Bytes charged to `budget` for crcs and have, given back when the sink closes. */
  private charged = 0;
  private budget: StateBudget | null = null;
  /** CRC-32s of the whole chunks a kept temporary file already holds (resume). */
  readonly existing: number[];
  private closed = false;

  private constructor(
    readonly abs: string,
    readonly tmp: string,
    readonly meta: FileMeta,
    readonly chunk: number,
    private readonly fh: FileHandle,
    existing: number[],
    private readonly verify: boolean,
  ) {
    const n = chunkCount(meta.size, chunk);
    this.n = n;
    this.crcs = new Uint32Array(n);
    this.have = new Uint8Array(Math.ceil(n / 8));
    this.missing = n;
    this.existing = existing;
  }

  /**
   * Opens (resume: reopens) the temporary file for `abs`; `abs` must not be a
   * directory. `direct`: every buffer given to write() starts at an address
   * aligned for O_DIRECT (see directShift).
   */
  static async open(abs: string, meta: FileMeta, chunk: number, resume: boolean, verify = true, direct = false, budget: StateBudget | null = null): Promise<FileSink> {
    const st = await lstat(abs).catch(() => null);
    if (st?.isDirectory()) throw new CopyError("EISDIR", "the destination is a directory, a file is expected");
    const tmp = tempName(abs);
    // The size is the peer's claim, and what this side holds per file (a CRC and a bit per
    // chunk) grows with it: a claim is bounded by the space actually free (a kept temporary
    // file's blocks count as free: it is reused or replaced), and its state is charged to the budget.
    const fsst = await statfs(dirname(abs)).catch(() => null);
    if (fsst !== null) {
      const kept = await lstat(tmp).catch(() => null);
      const free = fsst.bavail * fsst.bsize + (kept?.isFile() ? kept.blocks * 512 : 0);
      if (meta.size > free) throw new CopyError("ENOSPC", `a file of ${meta.size} bytes does not fit in the space free at the destination (${free} bytes)`);
    }
    const state = chunkStateBytes(meta.size, chunk);
    budget?.take(state);
    let fh: FileHandle | null = null;
    let existing: number[] = [];
    try {
      if (resume) {
        fh = await open(tmp, constants.O_RDWR | constants.O_NOFOLLOW | constants.O_NONBLOCK).catch(() => null);
        if (fh) {
          const s = await fh.stat();
          if (!s.isFile()) {
            await fh.close();
            fh = null;
            throw new CopyError("EEXIST", `${basename(tmp)} exists and is not a regular file`);
          }
          existing = await chunkCrcs(fh, Math.min(s.size, meta.size), chunk, chunkCount(meta.size, chunk));
        }
      }
      if (!fh) {
        fh = await open(tmp, constants.O_RDWR | constants.O_CREAT | constants.O_TRUNC | constants.O_NOFOLLOW | constants.O_NONBLOCK, 0o600);
        if (!(await fh.stat()).isFile()) {
          await fh.close();
          fh = null;
          throw new CopyError("EEXIST", `${basename(tmp)} exists and is not a regular file`);
        }
      }
    } catch (e) {
      await fh?.close().catch(() => {});
      budget?.give(state);
      throw e;
    }
    const sink = new FileSink(abs, tmp, meta, chunk, fh, existing, verify);
    sink.budget = budget;
    sink.charged = state;
    try {
      if (direct && O_DIRECT !== undefined && chunk % DIRECT_ALIGN === 0 && meta.size >= chunk) {
        // the same file again, by its descriptor (the name could have been replaced meanwhile)
        sink.direct = await open(`/proc/self/fd/${fh.fd}`, constants.O_WRONLY | O_DIRECT).catch(() => null);
        // writes that extend the file are serialized (and waited for) by the file system: set the size
        // first, but only to a size the file system has room for (the size is the peer's claim; a
        // sparse file of any claimed size would cost nothing now and a whole read on --resume)
        if (sink.direct !== null) {
          const cur = (await fh.stat()).size;
          const fsst = await statfs(dirname(abs)).catch(() => null);
          if (cur < meta.size && fsst !== null && meta.size - cur <= fsst.bavail * fsst.bsize) await fh.truncate(meta.size);
        }
      }
    } catch (e) {
      await sink.abort();
      throw e;
    }
    return sink;
  }

  /** The first `n` chunks of the kept temporary file match the sender's: they count as received. */
  accept(n: number): number {
    if (!Number.isInteger(n) || n < 0 || n > this.existing.length) throw new CopyError("PROTOCOL", `accept: ${n} chunks, the temporary file has ${this.existing.length}`);
    let bytes = 0;
    for (let i = 0; i < n; i++) {
      this.mark(i, this.existing[i]!);
      bytes += chunkLen(this.meta.size, this.chunk, i);
    }
    return bytes;
  }

  /** Writes chunk `off / chunk` after checking its CRC-32 against the sender's. */
  async write(off: number, bytes: Uint8Array, crc: number): Promise<void> {
    if (this.closed) throw new CopyError("PROTOCOL", "write after the file was closed");
    const i = off / this.chunk;
    if (!Number.isInteger(i) || i < 0 || i >= this.n) throw new CopyError("PROTOCOL", `chunk at offset ${off} is outside the file`);
    if (bytes.length !== chunkLen(this.meta.size, this.chunk, i)) throw new CopyError("PROTOCOL", `chunk ${i} has ${bytes.length} bytes, expected ${chunkLen(this.meta.size, this.chunk, i)}`);
    // --no-verify: the sender sent no CRC and nothing is checked
    const got = this.verify ? crc32(bytes) >>> 0 : 0;
    if (got !== crc >>> 0) throw new CopyError("CHECKSUM", `chunk ${i} (offset ${off}) arrived with CRC-32 ${got.toString(16)}, the sender's is ${(crc >>> 0).toString(16)}`);
    let done = 0;
    const d = this.direct;
    if (d !== null && bytes.length % DIRECT_ALIGN === 0) {
      try {
        while (done < bytes.length) {
          const { bytesWritten } = await d.write(bytes, done, bytes.length - done, off + done);
          done += bytesWritten;
          this.directBytes += bytesWritten;
          if (bytesWritten === 0 || done % DIRECT_ALIGN !== 0) break;
        }
      } catch {
        // refused (alignment, a file system without O_DIRECT) or failed: the page cache from
        // here on, where a real error (a full disk) fails again and is reported
        if (this.direct === d) await this.closeDirect();
      }
    }
    while (done < bytes.length) {
      const { bytesWritten } = await this.fh.write(bytes, done, bytes.length - done, off + done);
      done += bytesWritten;
    }
    this.mark(i, got);
  }

  private mark(i: number, crc: number): void {
    const bit = 1 << (i & 7);
    if ((this.have[i >> 3]! & bit) === 0) this.missing--;
    this.have[i >> 3]! |= bit;
    this.crcs[i] = crc;
  }

  /** Verifies, flushes, sets mode and mtime, and renames to the final name. */
  async finish(digest: string): Promise<void> {
    if (this.missing !== 0) throw new CopyError("PROTOCOL", `${this.missing} chunks were never received`);
    const mine = fileDigest(this.meta.size, this.crcs);
    if (this.verify && mine !== digest) throw new CopyError("CHECKSUM", `the file's digest ${mine.slice(0, 16)}… differs from the sender's ${String(digest).slice(0, 16)}…`);
    this.closed = true;
    this.release();
    await this.closeDirect();
    try {
      await this.fh.truncate(this.meta.size);
      await this.fh.sync();
      await this.fh.chmod(this.meta.mode & 0o7777);
      const t = this.meta.mtimeMs / 1000;
      await this.fh.utimes(t, t);
    } finally {
      await this.fh.close();
    }
    await rename(this.tmp, this.abs);
    await syncDir(dirname(this.abs));
  }

  /** Stops; the temporary file stays for --resume. */
  async abort(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.release();
    await this.closeDirect();
    await this.fh.close().catch(() => {});
  }

  private release(): void {
    this.budget?.give(this.charged);
    this.charged = 0;
  }

  private async closeDirect(): Promise<void> {
    const d = this.direct;
    this.direct = null;
    await d?.close().catch(() => {});
  }
}

function same(a: Stats, b: Stats): boolean {
  return a.size === b.size && a.mtimeMs === b.mtimeMs && a.ino === b.ino && a.dev === b.dev;
}

export class FileSource {
  readonly crcs: number[] = [];

  private constructor(
    readonly abs: string,
    readonly fh: FileHandle,
    readonly st: Stats,
  ) {}

  get meta(): FileMeta {
    return { size: this.st.size, mode: this.st.mode & 0o7777, mtimeMs: this.st.mtimeMs };
  }

  /**
   * Opens a regular file; the last component is not followed unless
   * `follow`. Anything else is refused without blocking (non-blocking open:
   * a FIFO would otherwise hold a thread of libuv's pool until a writer came).
   */
  static async open(abs: string, follow = false): Promise<FileSource> {
    const fh = await open(abs, constants.O_RDONLY | constants.O_NONBLOCK | (follow ? 0 : constants.O_NOFOLLOW));
    const st = await fh.stat();
    if (!st.isFile()) {
      await fh.close();
      throw new CopyError(st.isDirectory() ? "EISDIR" : "EINVAL", st.isDirectory() ? "is a directory" : "is not a regular file");
    }
    return new FileSource(abs, fh, st);
  }

  /** Reads chunk `i` into `buf`; records its CRC-32 and returns it. */
  async readChunk(i: number, chunk: number, buf: Uint8Array, verify = true): Promise<number> {
    const n = chunkLen(this.st.size, chunk, i);
    const got = await readFully(this.fh, buf, n, i * chunk);
    if (got < n) throw new CopyError("SOURCE_CHANGED", `the file shrank during the copy (chunk ${i} short by ${n - got} bytes); rerun with --resume`);
    const c = verify ? crc32(buf.subarray(0, n)) >>> 0 : 0;
    this.crcs[i] = c;
    return c;
  }

  /** CRC-32s of the first `count` chunks (resume: compared with the receiver's). */
  async prefixCrcs(chunk: number, count: number): Promise<number[]> {
    const c = await chunkCrcs(this.fh, this.st.size, chunk, Math.min(count, chunkCount(this.st.size, chunk)));
    c.forEach((v, i) => (this.crcs[i] = v));
    return c;
  }

  digest(): string {
    return fileDigest(this.st.size, this.crcs);
  }

  /** True when the file was modified (size, mtime) or replaced since it was opened. */
  async changed(): Promise<boolean> {
    const now = await this.fh.stat();
    if (!same(now, this.st)) return true;
    const byName = await stat(this.abs).catch(() => null);
    return byName === null || byName.ino !== this.st.ino || byName.dev !== this.st.dev;
  }

  async close(): Promise<void> {
    await this.fh.close().catch(() => {});
  }
}
