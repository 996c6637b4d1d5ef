/**
 * The receive queue of a tcp QP: posted receive WRs, oldest first, held as
 * records recycled through a free list in a ring of references, so a posted
 * receive allocates nothing in steady state (ring.ts) (the WR's scatter/gather list is
 * copied into the record's own Sge objects: the caller may reuse its WR).
 *
 * Invariant: a record goes back to the free list (release) only once its
 * receive is finished, right after its completion was generated (success,
 * error or flush); the responder holds the one being filled (curRecv) until
 * then. The frame reader's placement names MRs and offsets, never the
 * record, so nothing reads a released record.
 */
import type { Sge } from "../types.js";
import { FreeList, RefRing, copySges } from "./ring.js";

export interface RqEntry {
  wrId: number;
  /** The first `nsge` elements are the WR's scatter/gather list. */
  readonly sges: Sge[];
  nsge: number;
}

/** Free receive records kept per QP (what a burst made beyond it goes to the GC). */
const FREE_RECORDS = 64;

export class RecvQueue {
  private readonly q = new RefRing<RqEntry>();
  private readonly records = new FreeList<RqEntry>(FREE_RECORDS);

  /** Receives queued (posted and not yet taken). */
  get length(): number {
    return this.q.length;
  }

  /** Queues a receive WR (the caller checked the queue's bound). */
  post(wrId: number, sgList: readonly Sge[] | undefined): void {
    // One SGE to begin with (an empty array's first push reserves 17 elements).
    const r = this.records.take() ?? { wrId: 0, sges: [{ addr: 0, length: 0, lkey: 0 }], nsge: 0 };
    r.wrId = wrId;
    r.nsge = copySges(sgList, r.sges);
    this.q.push(r);
  }

  /** The oldest queued receive, taken off the queue (the caller releases it once completed), or null. */
  shift(): RqEntry | null {
    if (this.q.length === 0) return null;
    const r = this.q.shift();
    this.q.rebase();
    return r;
  }

  /** A taken receive was completed: its record is free for the next post. */
  release(r: RqEntry): void {
    this.records.give(r);
  }

  /** Drops every record (the QP is destroyed). */
  clear(): void {
    this.q.clear();
    this.records.clear();
  }
}
