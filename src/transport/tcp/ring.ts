/**
 * The two containers the tcp provider's per-WR records live in, so a message
 * allocates nothing in steady state:
 *
 * - RefRing: a FIFO of references addressed by absolute position
 *   (head <= i < tail), in a power-of-two array that doubles when full (its
 *   owner bounds the count: a QP's maxSendWr or maxRecvWr). Positions stay
 *   small integers: the owner rebases them (rebase) past REBASE_AT.
 * - FreeList: records kept for reuse, a stack by count (pop and push on a
 *   small array would give up its backing store and regrow it), at most
 *   `max` of them: what a burst allocated beyond that goes to the GC.
 * - VisitList: objects to call back later (CQs to notify, QPs owing an ACK).
 */
import type { Sge } from "../types.js";

/** Positions are rebased once the head passes this. */
export const REBASE_AT = 1 << 29;

export class RefRing<T> {
  private ring: (T | undefined)[] = new Array<T | undefined>(16);
  private mask = 15;
  /** The oldest entry's position. */
  head = 0;
  /** One past the newest entry's position. */
  tail = 0;

  get length(): number {
    return this.tail - this.head;
  }

  /** The entry at position i (head <= i < tail). */
  at(i: number): T {
    return this.ring[i & this.mask]!;
  }

  push(x: T): void {
    if (this.tail - this.head > this.mask) this.grow();
    this.ring[this.tail & this.mask] = x;
    this.tail++;
  }

  /** Removes and returns the oldest entry (the ring must not be empty). */
  shift(): T {
    const k = this.head & this.mask;
    const x = this.ring[k]!;
    this.ring[k] = undefined;
    this.head++;
    return x;
  }

  /**
   * Subtracts a multiple of the capacity from head and tail once the head
   * passed REBASE_AT, and returns it (0: not yet), for the owner's own
   * positions into the ring.
   */
  rebase(): number {
    if (this.head < REBASE_AT) return 0;
    const d = this.head - (this.head & this.mask);
    this.head -= d;
    this.tail -= d;
    return d;
  }

  clear(): void {
    this.ring = new Array<T | undefined>(16);
    this.mask = 15;
    this.head = this.tail = 0;
  }

  private grow(): void {
    const cap = (this.mask + 1) * 2;
    const ring = new Array<T | undefined>(cap);
    for (let i = this.head; i < this.tail; i++) ring[i & (cap - 1)] = this.ring[i & this.mask];
    this.ring = ring;
    this.mask = cap - 1;
  }
}

export class FreeList<T> {
  private readonly items: T[] = [];
  private n = 0;

  constructor(private readonly max: number) {}

  /** A free record, or null (the caller makes one). */
  take(): T | null {
    return this.n > 0 ? this.items[--this.n]! : null;
  }

  /** A record nothing reads any more; kept unless `max` are. */
  give(x: T): void {
    if (this.n < this.max) this.items[this.n++] = x;
  }

  clear(): void {
    this.items.length = 0;
    this.n = 0;
  }
}

/**
 * Objects to visit once at a later point (the end of a socket read, the end
 * of a turn), in the order added: kept by count and reused, so a use
 * allocates nothing, with a spare list for objects added while a run goes on
 * (they wait for the next run).
 */
export class VisitList<T> {
  private items: (T | null)[] = [];
  private n = 0;
  private spare: (T | null)[] | null = [];

  get length(): number {
    return this.n;
  }

  add(x: T): void {
    this.items[this.n++] = x;
  }

  /** Visits every object added before this call, once each; the first error thrown is rethrown once all were visited. */
  run(visit: (x: T) => void): void {
    const list = this.items;
    const n = this.n;
    this.items = this.spare ?? [];
    this.spare = null;
    this.n = 0;
    let failed = false;
    let err: unknown = null;
    for (let k = 0; k < n; k++) {
      const x = list[k]!;
      list[k] = null;
      try {
        visit(x);
      } catch (e) {
        if (!failed) err = e;
        failed = true;
      }
    }
    this.spare = list;
    if (failed) throw err;
  }
}

/** Copies a WR's scatter/gather list into a record's own Sge objects (reused, grown when needed); returns how many. */
export function copySges(from: readonly Sge[] | undefined, into: Sge[]): number {
  const n = from === undefined ? 0 : from.length;
  for (let k = 0; k < n; k++) {
    const s = from![k]!;
    const t = into[k];
    if (t === undefined) into.push({ addr: s.addr, length: s.length, lkey: s.lkey });
    else {
      t.addr = s.addr;
      t.length = s.length;
      t.lkey = s.lkey;
    }
  }
  return n;
}
