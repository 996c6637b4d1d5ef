/**
 * The receive queue of a tcp QP: posted receive WRs, oldest first, held as
 * records recycled through a free list in a ring of references, so a posted
 * receive allocates nothing in steady state (the WR's scatter/gather list is
 * copied into the record's own Sge objects: the caller may reuse its WR).
 *
 * Invariant: a record goes back to the free list (release) only once its
 * receive is finished, right after its completion was generated (success,
 * error or flush); the responder holds the one being filled (curRecv) until
 * then. The frame reader's placement names MRs and offsets, never the
 * record, so nothing reads a released record.
 */
import type { Sge } from "../types.js";

export interface RqEntry {
  wrId: number;
  /** The first `nsge` elements are the WR's scatter/gather list. */
  readonly sges: Sge[];
  nsge: number;
}

/** Positions are rebased below this (they stay small integers). */
const REBASE_AT = 1 << 29;

export class RecvQueue {
  private ring: (RqEntry | undefined)[] = new Array<RqEntry | undefined>(16);
  private mask = 15;
  private head = 0;
  private tail = 0;
  /** Free records, free[0, nfree) (a stack by count: pop and push on a small array would give up and regrow its backing store). */
  private readonly free: RqEntry[] = [];
  private nfree = 0;

  /** Receives queued (posted and not yet taken). */
  get length(): number {
    return this.tail - this.head;
  }

  /** Queues a receive WR (the caller checked the queue's bound). */
  post(wrId: number, sgList: readonly Sge[] | undefined): void {
    const r = this.nfree > 0 ? this.free[--this.nfree]! : { wrId: 0, sges: [], nsge: 0 };
    r.wrId = wrId;
    const n = sgList === undefined ? 0 : sgList.length;
    const sges = r.sges;
    for (let k = 0; k < n; k++) {
      const s = sgList![k]!;
      const t = sges[k];
      if (t === undefined) sges.push({ addr: s.addr, length: s.length, lkey: s.lkey });
      else {
        t.addr = s.addr;
        t.length = s.length;
        t.lkey = s.lkey;
      }
    }
    r.nsge = n;
    if (this.tail - this.head > this.mask) this.grow();
    this.ring[this.tail & this.mask] = r;
    this.tail++;
  }

  /** The oldest queued receive, taken off the queue (the caller releases it once completed), or null. */
  shift(): RqEntry | null {
    if (this.head === this.tail) return null;
    const k = this.head & this.mask;
    const r = this.ring[k]!;
    this.ring[k] = undefined;
    this.head++;
    if (this.head >= REBASE_AT) {
      const d = this.head - (this.head & this.mask);
      this.head -= d;
      this.tail -= d;
    }
    return r;
  }

  /** A taken receive was completed: its record is free for the next post. */
  release(r: RqEntry): void {
    this.free[this.nfree++] = r;
  }

  /** Drops every record (the QP is destroyed). */
  clear(): void {
    this.ring = new Array<RqEntry | undefined>(16);
    this.mask = 15;
    this.head = this.tail = 0;
    this.free.length = 0;
    this.nfree = 0;
  }

  private grow(): void {
    const cap = (this.mask + 1) * 2;
    const ring = new Array<RqEntry | undefined>(cap);
    for (let i = this.head; i < this.tail; i++) ring[i & (cap - 1)] = this.ring[i & this.mask];
    this.ring = ring;
    this.mask = cap - 1;
  }
}
