/**
 * Chunks, as both ends count them: a file of `size` bytes is
 * ceil(size / chunk) chunks, the last one short. The per-file digest is
 * SHA-256 over the size and every chunk's CRC-32 in order, computed by each
 * side from the bytes it holds. What a receiver keeps per chunk while a file
 * arrives (a CRC and a bit) follows from the sender's claims, so it is
 * charged to a StateBudget (per connection, and the process's) before
 * anything is allocated.
 */
import { createHash } from "node:crypto";
import { CopyError } from "./paths.js";

/** Chunks of a file of `size` bytes. */
export function chunkCount(size: number, chunk: number): number {
  return Math.ceil(size / chunk);
}

/** Bytes of chunk `i`. */
export function chunkLen(size: number, chunk: number, i: number): number {
  return Math.min(chunk, size - i * chunk);
}

/** The per-file digest (hex) of `size` and the CRC-32 of its first `count` chunks. */
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
