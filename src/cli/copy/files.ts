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
 * The per-file digest is SHA-256 over the size and every chunk's CRC-32 in
 * order: both sides compute it from the bytes they hold.
 */
import { closeSync, constants, openSync, readFileSync, readSync, writeSync, type Stats } from "node:fs";
import { lstat, open, rename, stat, statfs, type FileHandle } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { createHash, randomBytes } from "node:crypto";
import { crc32 } from "node:zlib";
import { CopyError } from "./paths.js";
import type { LocalMr, Rdma } from "../../index.js";

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

export function chunkCount(size: number, chunk: number): number {
  return Math.ceil(size / chunk);
}

export function chunkLen(size: number, chunk: number, i: number): number {
  return Math.min(chunk, size - i * chunk);
}

export function fileDigest(size: number, crcs: ArrayLike<number>, count = crcs.length): string {
  const h = createHash("sha256");
  const head = Buffer.alloc(8);
  head.writeBigUInt64BE(BigInt(size), 0);
  h.update(head);
  // in pieces: a file of millions of chunks needs no second copy of its CRCs
  const piece = Buffer.alloc(4 * Math.min(count, 16384));
  for (let i = 0; i < count; i += 16384) {
    const m = Math.min(16384, count - i);
    for (let k = 0; k < m; k++) piece.writeUInt32BE((crcs[i + k] ?? 0) >>> 0, 4 * k);
    h.update(piece.subarray(0, 4 * m));
  }
  return h.digest("hex");
}

/**
 * What a receiver holds per file while it arrives: a CRC-32 and a bit per
 * chunk. Its size follows from the sender's claimed size and chunk size, so
 * it is charged to a StateBudget before anything is allocated.
 */
export function chunkStateBytes(size: number, chunk: number): number {
  const n = chunkCount(size, chunk);
  return 4 * n + Math.ceil(n / 8);
}

/**
 * Bytes of per-chunk state that files being received may hold: one budget
 * per connection, charged also to its parent (the process's).
 */
export class StateBudget {
  used = 0;
  constructor(
    readonly limit: number,
    private readonly parent: StateBudget | null = null,
  ) {}

  /** Charges `n` bytes (to the parent too), or throws: EFBIG past this budget, EBUSY past the parent's. */
  take(n: number): void {
    if (this.used + n > this.limit)
      throw new CopyError(
        this.parent ? "EFBIG" : "EBUSY",
        this.parent
          ? `receiving this file needs ${mib(n)} of bookkeeping (a CRC per chunk), and this connection's files may hold ${mib(this.limit)} (${mib(this.used)} in use): use a larger --chunk`
          : `the server is busy: files being received hold ${mib(this.used)} of bookkeeping (at most ${mib(this.limit)}); retry later or use a larger --chunk`,
      );
    this.parent?.take(n);
    this.used += n;
  }

  give(n: number): void {
    this.used -= n;
    this.parent?.give(n);
  }
}

function mib(n: number): string {
  return `${(n / 2 ** 20).toFixed(1)} MiB`;
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

/**
 * Direct I/O for the big files' chunks: a chunk written with O_DIRECT goes
 * from the registered slot to the disk without a copy into the page cache
 * (measured here: 2 GiB written through the page cache cost 4.7 s of system
 * time, with O_DIRECT 0.5 s; docs/performance.md, "cp and serve"). The
 * kernel wants the memory, the file offset and the length aligned (to the
 * device's DMA and logical block sizes): offsets and lengths are multiples
 * of DIRECT_ALIGN, and the ring starts at a page (`directShift`). Anything the kernel refuses goes through the page cache.
 */
export const DIRECT_ALIGN = 4096;
const O_DIRECT = (constants as Record<string, number>).O_DIRECT;
/** Linux's O_TMPFILE (with O_DIRECTORY): an unnamed file, gone on close. */
const O_TMPFILE = 0o20200000;

/**
 * Where in `buf` a page starts (0 ≤ offset < DIRECT_ALIGN), or null when it
 * cannot be told. The kernel accepts O_DIRECT from memory aligned to the
 * device's DMA alignment (512 bytes here), but a buffer that is not page
 * aligned is split per page on its way to the device: measured here, 1 MiB
 * writes ran at ~115 MB/s from 512-aligned memory and ~1 GB/s from
 * page-aligned memory. JavaScript cannot see an address, so this finds the
 * buffer in the process's own memory (/proc/self/maps and /proc/self/mem,
 * Linux only): a random marker written at its start is looked for in the
 * writable mappings large enough to hold it, first at their starts (where a
 * fresh large allocation lands), then through the whole of those up to
 * SCAN_MAX bytes (the allocator's heap); a hit counts only when a second
 * marker written into the buffer shows up at the same address.
 */
export function pageOffset(buf: Uint8Array): number | null {
  if (process.platform !== "linux" || buf.length < 2 * DIRECT_ALIGN) return null;
  let fd: number;
  let maps: string;
  try {
    maps = readFileSync("/proc/self/maps", "utf8");
    fd = openSync("/proc/self/mem", "r");
  } catch {
    return null;
  }
  const saved = buf.slice(0, MARK);
  try {
    const ranges: [bigint, number][] = [];
    for (const line of maps.split("\n")) {
      const m = /^([0-9a-f]+)-([0-9a-f]+) rw/.exec(line);
      if (!m) continue;
      const lo = BigInt("0x" + m[1]!);
      const size = Number(BigInt("0x" + m[2]!) - lo);
      if (size >= buf.length) ranges.push([lo, size]);
    }
    const mark = randomBytes(MARK);
    buf.set(mark, 0);
    const block = Buffer.alloc(SCAN_BLOCK + MARK);
    const found = (lo: bigint, len: number): bigint | null => {
      let n: number;
      try {
        n = readSync(fd, block, 0, len, lo);
      } catch {
        return null;
      }
      for (let at = block.subarray(0, n).indexOf(mark); at >= 0; at = block.subarray(0, n).indexOf(mark, at + 1)) {
        const addr = lo + BigInt(at);
        // the marker's own copy (or any other) is not the buffer: a second marker must appear there
        const again = randomBytes(MARK);
        buf.set(again, 0);
        const check = Buffer.alloc(MARK);
        let ok = false;
        try {
          ok = readSync(fd, check, 0, MARK, addr) === MARK && check.equals(again);
        } catch {
          /* unreadable */
        }
        buf.set(mark, 0);
        if (ok) return addr;
      }
      return null;
    };
    const offsetOf = (addr: bigint): number => (DIRECT_ALIGN - Number(addr % BigInt(DIRECT_ALIGN))) % DIRECT_ALIGN;
    for (const [lo, size] of ranges) {
      const a = found(lo, Math.min(size, 64 * 1024));
      if (a !== null) return offsetOf(a);
    }
    for (const [lo, size] of ranges) {
      if (size > SCAN_MAX) continue;
      for (let off = SCAN_BLOCK - MARK; off < size; off += SCAN_BLOCK) {
        const a = found(lo + BigInt(off), Math.min(size - off, SCAN_BLOCK + MARK));
        if (a !== null) return offsetOf(a);
      }
    }
    return null;
  } finally {
    buf.set(saved, 0);
    closeSync(fd);
  }
}
const MARK = 32;
const SCAN_BLOCK = 1024 * 1024;
const SCAN_MAX = 256 * 1024 * 1024;

/**
 * The offset into `buf` where a page starts, when an O_DIRECT write from
 * there into the file system holding `dir` succeeds; else null (no O_DIRECT,
 * no O_TMPFILE, not writable, address unknown). The probe writes into an
 * unnamed temporary file, never a name.
 */
export function directShift(buf: Uint8Array, dir: string): number | null {
  if (O_DIRECT === undefined) return null;
  const at = pageOffset(buf);
  if (at === null || buf.length - at < DIRECT_ALIGN) return null;
  let fd: number;
  try {
    fd = openSync(dir, O_TMPFILE | constants.O_WRONLY | O_DIRECT, 0o600);
  } catch {
    return null;
  }
  try {
    writeSync(fd, buf, at, DIRECT_ALIGN, 0);
    return at;
  } catch {
    return null;
  } finally {
    closeSync(fd);
  }
}

/**
 * A ring of `bytes` registered bytes; with `directDir` (a directory the
 * files will be written under) it starts at an address O_DIRECT accepts when
 * one is found, and `direct` says so. The ring is a slice of a slightly
 * larger allocation (disposing the slice returns it all).
 */
export function allocRing(rdma: Rdma, bytes: number, chunk: number, directDir: string | null): { ring: LocalMr; direct: boolean } {
  // ASYNC_RDMA_CP_DIRECT=0: a measurement switch (bench only), every write through the page cache
  if (directDir === null || chunk % DIRECT_ALIGN !== 0 || process.env.ASYNC_RDMA_CP_DIRECT === "0") return { ring: rdma.allocLocalMr(bytes), direct: false };
  const all = rdma.allocLocalMr(bytes + DIRECT_ALIGN);
  const at = directShift(all.bytes, directDir);
  return { ring: all.slice(at ?? 0, (at ?? 0) + bytes), direct: at !== null };
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
