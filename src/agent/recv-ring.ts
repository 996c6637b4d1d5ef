/**
 * The receive ring of one connection: the buffers posted for the peer's
 * SENDs (header + eager payload each), and their recycling.
 *
 * Invariants:
 * - a receive buffer is allocated and registered once: one that comes back
 *   without being handed to the user (control messages, immediates,
 *   rendezvous announcements) is re-posted as it is; one handed to the user
 *   (a DATA message) comes back when the user disposes of it, its views
 *   detached first (pool.renew), so the user's old view never aliases a
 *   re-posted buffer (memory whose bytes no view was handed out for — the
 *   RPC layer reads them with mr.ts's peekBytes and copies what it keeps — has
 *   nothing to detach and is re-posted as it is); at most the receive depth are kept spare, and none
 *   once the connection ended;
 * - receives re-posted while the completion queue drains are posted as one
 *   list when the drain ends, and counted as credits to return only once
 *   posted (a credit never promises a receive that is not there);
 * - every posted receive is in `posted` until its completion (or teardown)
 *   frees it.
 */
import { RdmaError } from "../errors.js";
import type { QueuePair } from "../transport/types.js";
import { LocalMemory } from "../memory/mr.js";
import type { Allocation, MrPool } from "../memory/pool.js";
import { HDR } from "./codec.js";
import { newOp, type OpTable } from "./ops.js";
import { initialReceives } from "./credits.js";

type RecvWr = { wrId: number; sgList: { addr: number; length: number; lkey: number }[] };

/** What the ring needs from its connection. */
export interface RecvHost {
  /** The connection failed or was torn down: buffers are freed, not re-posted. */
  ended(): boolean;
  /** The completion queue is being drained (re-posts are batched until it ends). */
  draining(): boolean;
  /** `n` receives were posted: credits to return (credits.ts). */
  reposted(n: number): void;
  fail(err: RdmaError): void;
}

export class RecvRing {
  /** Posted receives by wrId. */
  private readonly posted = new Map<number, LocalMemory>();
  /** Spare buffers (at most the receive depth). */
  private readonly spare: LocalMemory[] = [];
  /** Receives re-posted while draining the CQ: posted as one list when the drain ends. */
  private batch: RecvWr[] = [];
  /** Receives in `batch` (filled by index, never emptied: an emptied array drops its storage). */
  private nBatch = 0;
  /** The other list, swapped in while one is posted (both reused: the provider copies at post time). */
  private spareBatch: RecvWr[] | null = [];
  /**
   * Each buffer's work request, made once and reused at every post (the
   * provider copies what it keeps then): a buffer is posted at most once at a
   * time, so its record is never in two lists.
   */
  private readonly wrs = new WeakMap<Allocation, RecvWr>();
  /** The operation of every posted receive: its slot says "a receive" (its buffer is in `posted`), nothing more. */
  private readonly recvOp = newOp("recv");
  /** Buffers that came back from the user and were re-posted (stats). */
  recycled = 0;

  constructor(
    private readonly host: RecvHost,
    private readonly ops: OpTable,
    private readonly qp: QueuePair,
    private readonly pool: MrPool,
    private readonly depth: number,
    private readonly eagerMax: number,
  ) {}

  /** Receives posted and not completed. */
  get size(): number {
    return this.posted.size;
  }

  /** Posts the first receives, initialReceives of the depth (before the QP connects, so the peer never meets an empty queue). */
  postInitial(): void {
    const wrs = [];
    for (let i = initialReceives(this.depth); i > 0; i--) wrs.push(this.newRecv());
    this.qp.postRecv(wrs);
  }

  /** The ring grows by `n` receives (credits.ts decides when): posted like re-posts, and reported as credits once posted. */
  grow(n: number): void {
    if (this.host.ended()) return;
    for (let i = 0; i < n; i++) this.batch[this.nBatch++] = this.newRecv();
    if (!this.host.draining()) this.postBatch();
  }

  /** The buffer of a completed receive, no longer posted. */
  take(id: number): LocalMemory {
    const mem = this.posted.get(id)!;
    this.posted.delete(id);
    return mem;
  }

  /** A buffer that was not handed to the user: kept to be re-posted, or freed. */
  put(mem: LocalMemory): void {
    if (this.host.ended() || this.spare.length >= this.depth) mem.release();
    else this.spare.push(mem);
  }

  /** A buffer handed to the user comes back when the user disposes of it (see the invariants). */
  private readonly recycle = (alloc: Allocation, viewed: boolean): boolean => {
    if (this.host.ended() || this.spare.length >= this.depth) return false;
    if (viewed ? !this.pool.renew(alloc) : !this.pool.isLive(alloc)) return false;
    const m = new LocalMemory(this.pool, alloc);
    m.recycle = this.recycle;
    this.spare.push(m);
    this.recycled++;
    return true;
  };

  private newRecv(): RecvWr {
    let mem = this.spare.pop();
    if (mem === undefined) {
      mem = new LocalMemory(this.pool, this.pool.alloc(HDR + this.eagerMax));
      mem.recycle = this.recycle;
    }
    const id = this.ops.slot(this.recvOp);
    this.posted.set(id, mem);
    const a = mem.alloc;
    let wr = this.wrs.get(a);
    if (wr === undefined) {
      wr = { wrId: id, sgList: [{ addr: a.addr, length: a.length, lkey: a.mr.lkey }] };
      this.wrs.set(a, wr);
      return wr;
    }
    wr.wrId = id;
    const sge = wr.sgList[0]!;
    sge.addr = a.addr;
    sge.length = a.length;
    sge.lkey = a.mr.lkey;
    return wr;
  }

  /** Re-posts one receive (batched while the completion queue drains). */
  repost(): void {
    if (this.host.ended()) return;
    this.batch[this.nBatch++] = this.newRecv();
    if (!this.host.draining()) this.postBatch();
  }

  /** Posts the batched receives (one postRecv), and only then counts them as credits to return. */
  postBatch(): void {
    const batch = this.batch;
    const n = this.nBatch;
    if (n === 0) return;
    if (batch.length !== n) batch.length = n;
    this.batch = this.spareBatch ?? [];
    this.spareBatch = null;
    this.nBatch = 0;
    try {
      if (this.host.ended()) {
        for (const r of batch) this.drop(r.wrId);
        return;
      }
      try {
        this.qp.postRecv(batch);
      } catch (e) {
        for (const r of batch) this.drop(r.wrId);
        this.host.fail(e instanceof RdmaError ? e : new RdmaError("DEVICE", `postRecv failed: ${(e as Error).message}`, { cause: e }));
        return;
      }
    } finally {
      this.spareBatch = batch;
    }
    this.host.reposted(n);
  }

  /** A receive that was never posted: free its slot and buffer. */
  private drop(id: number): void {
    const mem = this.posted.get(id);
    this.posted.delete(id);
    mem?.release();
    this.ops.take(id);
  }

  /** Teardown: every buffer, posted or spare, is freed (the QP is in error: nothing lands any more). */
  release(): void {
    for (const m of this.posted.values()) m.release();
    this.posted.clear();
    for (const r of this.spare.splice(0)) r.release();
  }
}
