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
 */

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
