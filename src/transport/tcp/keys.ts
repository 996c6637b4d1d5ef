/**
 * The tcp device's key space: lkeys/rkeys of MRs and memory windows.
 *
 * A key is a 24-bit index and an 8-bit "key" byte, as on verbs: the low byte
 * is the consumer part that ibv_inc_rkey changes when a window is re-bound,
 * the index names the object. Each MR or window reserves its index for its
 * whole life, so a window's re-bound keys (same index, another low byte) can
 * never collide with any other object's key.
 *
 * Both parts are drawn from the CSPRNG: knowing one key (a grant, say) tells
 * nothing about any other. An index already in use is drawn again; index 0
 * is never used, so no key is 0 (0 means "unbound" for a window).
 */
import { randomFillSync } from "node:crypto";
import { RdmaError } from "../../errors.js";

/** Indices are 24 bits; 0 is reserved. */
export const KEY_INDICES = 0xffffff;

/** 32 random bits per call, from a pooled crypto.randomFillSync buffer. */
export function cryptoRandom32(): () => number {
  const pool = new Uint32Array(512);
  let pos = pool.length;
  return () => {
    if (pos === pool.length) {
      randomFillSync(pool);
      pos = 0;
    }
    return pool[pos++]!;
  };
}

export class KeySpace {
  private readonly live = new Set<number>();

  /**
   * @param capacity most indices live at once (the device's maxMr + maxMw,
   *   about 1/15 of the index space), so a draw hits a free index with
   *   probability ≥ 14/15 and allocation stays O(1) on average.
   * @param random source of 32 random bits (tests script it).
   */
  constructor(
    readonly capacity: number,
    private readonly random: () => number = cryptoRandom32(),
  ) {
    if (!Number.isInteger(capacity) || capacity < 1 || capacity > KEY_INDICES) throw new RangeError(`key space capacity ${capacity} out of range`);
  }

  /** Live indices. */
  get size(): number {
    return this.live.size;
  }

  /** A fresh key whose index no live key has; its index stays reserved until {@link release}. */
  alloc(): number {
    if (this.live.size >= this.capacity) {
      throw new RdmaError("RESOURCE_EXHAUSTED", `device key space full: ${this.capacity} MRs and memory windows live (verbs refuses with ENOMEM)`, { errnoName: "ENOMEM" });
    }
    for (;;) {
      const r = this.random() >>> 0;
      const index = r >>> 8;
      if (index === 0 || this.live.has(index)) continue;
      this.live.add(index);
      return ((index << 8) | (r & 0xff)) >>> 0;
    }
  }

  /** Whether `key`'s index is reserved. */
  has(key: number): boolean {
    return this.live.has(key >>> 8);
  }

  /** Frees `key`'s index (any low byte). */
  release(key: number): void {
    this.live.delete(key >>> 8);
  }
}
