/**
 * The inbox of one connection: what arrived from the peer and was not read.
 *
 * Invariants:
 * - messages (eager and rendezvous alike) are handed to receive() in arrival
 *   order, each exactly once; a rendezvous message holds its place until its
 *   READ completes or it is dropped (cancelled), so later ones wait behind it;
 * - unread messages and immediates hold the peer's credits: past half the
 *   receive depth, a consumed receive is re-posted only as the user reads
 *   (back-pressure instead of growing memory or queues), so at most the depth
 *   plus half of it are ever unread;
 * - when the connection ends without this side closing it, what arrived whole
 *   stays receivable (then receive() rejects with the failure); received
 *   memory outlives the connection (MrPool.keep moves it out when the pool
 *   closes); a side that closes itself drops what it did not read.
 */
import type { RdmaError } from "../errors.js";
import type { LocalMr } from "../memory/mr.js";
import { AsyncQueue, abortError, abortableWait, type Settle } from "./queue.js";

/** A message in arrival order: whole (ready) or a rendezvous still being read. */
export interface Incoming {
  ready: boolean;
  mr: LocalMr | null;
  imm: number | undefined;
  /** Rendezvous: the sender's id, whether RNDV_DONE went out, whether the sender cancelled. */
  rndv: { token: number; len: number; addr: number; rkey: number; done: boolean; cancelled: boolean; started: boolean } | null;
}

export interface Received {
  mr: LocalMr;
  imm: number | undefined;
}

/** A receive() waiting: settled with the message, or only its memory (`mrOnly`). */
interface Waiter {
  resolve(v: unknown): void;
  reject(e: unknown): void;
  mrOnly: boolean;
}

/** What the inbox needs from its connection. */
export interface InboxHost {
  /** Re-posts one receive buffer (credits flow back to the peer). */
  repostRecv(): void;
  /** Why the connection ended, or null while it lives. */
  failed(): RdmaError | null;
}

export class Inbox {
  private readonly incoming: Incoming[] = [];
  private readonly waiters: Waiter[] = [];
  readonly writeImms = new AsyncQueue<number>("receiveWriteImm");
  /** Messages in `incoming` (not yet taken); immediates count apart (writeImms.length). */
  private heldMsgs = 0;
  /** Receives not re-posted because too much was held unread: posted as the user reads. */
  private pendingReposts = 0;
  /** The connection ended without this side closing it: what arrived whole stays receivable. */
  private keep = false;

  constructor(
    private readonly host: InboxHost,
    private readonly recvDepth: number,
  ) {}

  /** Unread messages and immediates. */
  held(): number {
    return this.heldMsgs + this.writeImms.length;
  }

  private maxHeld(): number {
    return Math.max(1, this.recvDepth >> 1);
  }

  /** A receive was consumed by something the user will read: re-post now, or when the user reads. */
  private repostOrHold(): void {
    if (this.held() <= this.maxHeld()) this.host.repostRecv();
    else this.pendingReposts++;
  }

  private repostHeld(): void {
    while (this.pendingReposts > 0 && this.held() < this.maxHeld()) {
      this.pendingReposts--;
      this.host.repostRecv();
    }
  }

  // ------------------------------------------------------------- arrivals

  /** A whole message arrived (eager). */
  pushMessage(mr: LocalMr, imm: number | undefined): void {
    // An eager message's record is only ever in `incoming`: records are reused (takeHead).
    const e = this.freeEntries.pop();
    if (e !== undefined) {
      e.mr = mr;
      e.imm = imm;
      this.incoming.push(e);
    } else this.incoming.push({ ready: true, mr, imm, rndv: null });
    this.heldMsgs++;
    this.repostOrHold();
    this.deliver();
  }

  /** A rendezvous message was announced: it holds its place until read (ready) or dropped. */
  pushRendezvous(entry: Incoming): void {
    this.incoming.push(entry);
    this.heldMsgs++;
    this.repostOrHold();
  }

  /** An immediate of a WRITE_WITH_IMM arrived. */
  pushImm(imm: number): void {
    this.writeImms.push(imm);
    this.repostOrHold();
  }

  /** A rendezvous message was read whole: it may be delivered now (in order). */
  ready(entry: Incoming, mr: LocalMr): void {
    entry.ready = true;
    entry.mr = mr;
    this.deliver();
  }

  /** Removes an undelivered message (it no longer holds a credit). */
  drop(entry: Incoming): void {
    const i = this.incoming.indexOf(entry);
    if (i < 0) return;
    this.incoming.splice(i, 1);
    this.heldMsgs--;
    this.repostHeld();
    this.deliver();
  }

  /** The rendezvous message announced with `token`, if it is not done yet. */
  findRendezvous(token: number): Incoming | undefined {
    return this.incoming.find((e) => e.rndv?.token === token && !e.rndv.done);
  }

  // ---------------------------------------------------------------- reads

  /** Next message in arrival order. */
  receive(signal?: AbortSignal): Promise<Received> {
    return this.next(signal, false) as Promise<Received>;
  }

  /** Next message's memory (receive() without the immediate): one promise, settled with the LocalMr itself. */
  receiveMr(signal?: AbortSignal): Promise<LocalMr> {
    return this.next(signal, true) as Promise<LocalMr>;
  }

  private next(signal: AbortSignal | undefined, mrOnly: boolean): Promise<unknown> {
    const head = this.incoming[0];
    if (head?.ready && this.waiters.length === 0) return Promise.resolve(this.takeHead(mrOnly));
    const failure = this.host.failed();
    if (failure) return Promise.reject(failure);
    if (signal === undefined) return new Promise((resolve, reject) => this.waiters.push({ resolve, reject, mrOnly }));
    if (signal.aborted) return Promise.reject(abortError(signal));
    return abortableWait<unknown>((w) => this.waiters.push({ resolve: w.resolve, reject: w.reject, mrOnly }), { signal, cleanup: this.unwait });
  }

  receiveWriteImm(signal?: AbortSignal): Promise<number> {
    const p = this.writeImms.take({ signal });
    if (this.pendingReposts > 0) void p.then(() => this.repostHeld(), () => {});
    return p;
  }

  private readonly unwait = (w: Settle<unknown>): void => {
    const i = this.waiters.findIndex((x) => x.resolve === w.resolve);
    if (i >= 0) this.waiters.splice(i, 1);
  };

  /** Free records of eager messages (at most the receive depth). */
  private readonly freeEntries: Incoming[] = [];

  /** Takes the head message: its memory (`mrOnly`), or the message with its immediate. */
  private takeHead(mrOnly: boolean): LocalMr | Received {
    const head = this.incoming.shift()!;
    this.heldMsgs--;
    // Received memory outlives its connection: the pool moves it out instead of freeing it
    // (MrPool.keep). One kept past the pool's close was moved already: the user holds plain
    // memory now, and the peer-memory charge it kept while unread goes back.
    const mem = head.mr!.mem;
    mem.userHeld = true;
    if (mem.pool !== null) mem.pool.keep(mem);
    else mem.releaseCharge();
    const mr = head.mr!;
    const imm = head.imm;
    if (head.rndv === null) {
      // An eager message's record: nobody else holds it (a rendezvous record is the rendezvous's too).
      head.mr = null;
      head.imm = undefined;
      if (this.freeEntries.length < this.recvDepth) this.freeEntries.push(head);
    }
    this.repostHeld();
    return mrOnly ? mr : { mr, imm };
  }

  /** Hands ready messages at the head to waiting receivers, in order. */
  private deliver(): void {
    while (this.waiters.length > 0 && this.incoming[0]?.ready) {
      const w = this.waiters.shift()!;
      w.resolve(this.takeHead(w.mrOnly));
    }
  }

  // ------------------------------------------------------------ lifecycle

  /**
   * The connection failed with `err`. Unless this side closed it (`closing`),
   * what arrived whole stays receivable: rendezvous messages still being read
   * are dropped (their READ frees its memory when it completes), waiters get
   * what is whole, and the rest of them reject.
   */
  fail(err: RdmaError, closing: boolean): void {
    this.keep = !closing;
    if (this.keep) {
      let j = 0;
      for (const e of this.incoming) {
        if (e.ready) this.incoming[j++] = e;
        else if (e.rndv) e.rndv.cancelled = true;
      }
      this.incoming.length = j;
      this.deliver();
    }
    for (const w of this.waiters.splice(0)) w.reject(err);
    this.writeImms.fail(err);
  }

  /** A setup that failed before start: nothing was handed out, nothing is kept. */
  abandon(): void {
    this.keep = false;
  }

  /**
   * The connection is torn down. Kept messages (completions drained after
   * fail() may have added entries: only the whole ones) are marked for the
   * pool to move out when it closes; otherwise everything unread is freed.
   */
  teardown(): void {
    if (this.keep) {
      let j = 0;
      for (const e of this.incoming) {
        if (e.ready && e.mr) {
          e.mr.mem.pool?.keep(e.mr.mem);
          this.incoming[j++] = e;
        }
      }
      this.incoming.length = j;
    } else {
      for (const e of this.incoming.splice(0)) e.mr?.mem.release();
    }
    this.heldMsgs = this.incoming.length;
    // Immediates that arrived before the end stay receivable like messages (dropped when this side closes).
    if (!this.keep) this.writeImms.drain();
  }

  /** This side closes: what the peer sent and nobody read is dropped. `tornDown`: teardown already ran. */
  dropUnread(tornDown: boolean): void {
    this.keep = false;
    if (!tornDown) return; // teardown frees them
    for (const e of this.incoming.splice(0)) e.mr?.mem.release();
    this.heldMsgs = 0;
    this.writeImms.drain();
  }
}
