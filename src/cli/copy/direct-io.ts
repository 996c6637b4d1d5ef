/**
 * Rings for direct I/O: a ring of registered chunk buffers that starts at a
 * page, so the big files' chunks go from a slot to the disk with O_DIRECT
 * (no copy into the page cache) when the file system takes it; whatever the
 * kernel refuses goes through the page cache instead.
 */
import { closeSync, constants, openSync, readFileSync, readSync, writeSync } from "node:fs";
import { randomBytes } from "node:crypto";
import type { LocalMr, Rdma } from "../../index.js";

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
export const O_DIRECT = (constants as Record<string, number>).O_DIRECT;
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
