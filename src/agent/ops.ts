/**
 * Operations and their slots. Every operation the agent runs (a user's send,
 * write, read or atomic; a control message; a posted receive; the agent's
 * own rendezvous READ) is one `Op`, and every work request carries an
 * integer wrId that indexes this table: ids come from a free list, and no
 * closure is created below the API per work request.
 *
 * Invariant: an operation settles exactly once. `end` hands out its
 * continuations and clears them, so a second settlement (a flushed
 * completion after a failure, teardown after a lost completion) finds nothing
 * to call; its pinned memory is unpinned and its abort watch removed with
 * it, however it ends.
 */
import { AbortWatch, abortError } from "./queue.js";
import type { LocalMemory } from "../memory/mr.js";

export type OpKind = "msg" | "write" | "read" | "atomic" | "recv";

export interface Op {
  kind: OpKind;
  resolve: ((v: unknown) => void) | null;
  reject: ((e: unknown) => void) | null;
  /** Memory kept alive while the op is in flight (an operation uses at most one region). */
  mem: LocalMemory | null;
  /** A control-message buffer to free on completion. */
  hdr: LocalMemory | null;
  /** atomics: where the old value lands. */
  result: LocalMemory | null;
  /** Called on success instead of resolve (internal continuations). */
  then: ((ok: boolean) => void) | null;
  /** Told how it ended instead of a promise (a layer above's own sends: {@link SendListener}). */
  listener: SendListener | null;
  /** Stops watching the operation's signal (AbortWatch); null when it has none or it ended. */
  unwatch: (() => void) | null;
  /** Work requests still to complete (chunked transfers post several). */
  parts: number;
  /** Some work request of it reached the send queue (an abort can no longer recall it). */
  posted: boolean;
  /**
   * From the table's free list ({@link OpTable.reusableOp}): an eager SEND
   * without an abort signal, which nothing but its slot and its queued record
   * refers to; its completion gives it back ({@link OpTable.reuse}).
   */
  reusable: boolean;
}

/**
 * Told how a send ended, instead of a promise: what a layer above (the RPC
 * outbox) uses for its own sends, so a message costs it no promise.
 */
export interface SendListener {
  /** The send completed (`err` null) or failed (`err` why); called exactly once. */
  sent(err: unknown): void;
}

export function newOp(kind: OpKind): Op {
  return { kind, resolve: null, reject: null, mem: null, hdr: null, result: null, then: null, listener: null, unwatch: null, parts: 1, posted: false, reusable: false };
}

/** The continuations of an operation that ended, for the caller to run. */
export interface Ended {
  resolve: Op["resolve"];
  reject: Op["reject"];
  then: Op["then"];
  listener: Op["listener"];
}

/** Free operations kept for reuse. */
const FREE_OPS = 1024;

export class OpTable {
  private slots: (Op | null)[] = [];
  private readonly freeSlots: number[] = [];
  /** end()'s answer, reused: read it at once (destructure), never keep it. */
  private readonly ended: Ended = { resolve: null, reject: null, then: null, listener: null };
  /** One abort listener per signal, however many operations wait on it. */
  readonly aborts = new AbortWatch();

  /**
   * @param onAbort called when an operation's signal aborts before any of its
   *   work requests was posted: the owner of the queues removes it and drops it.
   */
  constructor(private readonly onAbort: (op: Op, err: unknown) => void) {}

  /** A free wrId for `op`. */
  slot(op: Op): number {
    const id = this.freeSlots.pop();
    if (id !== undefined) {
      this.slots[id] = op;
      return id;
    }
    this.slots.push(op);
    return this.slots.length - 1;
  }

  /** The operation of a completion's wrId, its slot freed; null when it already ended. */
  take(id: number): Op | null {
    const op = this.slots[id];
    if (!op) return null;
    this.slots[id] = null;
    this.freeSlots.push(id);
    return op;
  }

  /**
   * The promise of an operation. The caller has checked that `signal` is not
   * aborted before creating anything. An abort while the operation still
   * waits in a queue (credits, send-queue room) removes it (`onAbort`): it
   * never reaches the wire, and rejects with ABORTED. Once posted it cannot
   * be recalled: it is reported as it completes (done, or its error), never
   * as aborted while it may still land. The abort listener lives exactly as
   * long as the operation (`end`).
   */
  track<T>(op: Op, signal: AbortSignal | undefined): Promise<T> {
    // One executor for every operation (no closure per operation): it runs synchronously, here.
    this.tracking = op;
    const p = new Promise<T>(this.executor);
    this.tracking = null;
    if (signal) {
      op.unwatch = this.aborts.add(signal, () => {
        if (op.posted) return; // settles with its completion
        this.onAbort(op, abortError(signal));
      });
    }
    return p;
  }

  private tracking: Op | null = null;
  private readonly executor = (resolve: (v: never) => void, reject: (e: unknown) => void): void => {
    const op = this.tracking!;
    op.resolve = resolve as (v: unknown) => void;
    op.reject = reject;
  };

  /** Free operations for eager SENDs without a signal (at most FREE_OPS). */
  private readonly freeOps: Op[] = [];

  /** An operation for an eager SEND that has no abort signal: from the free list, or new. */
  reusableOp(): Op {
    const op = this.freeOps.pop() ?? newOp("msg");
    op.reusable = true;
    return op;
  }

  /**
   * A reusable operation settled (its completion ran its continuations): back
   * to the free list. Nothing else refers to it then: its slot was taken, its
   * record given back when posted, and it never had an abort listener.
   */
  reuse(op: Op): void {
    if (!op.reusable || op.unwatch !== null || op.resolve !== null || op.reject !== null || op.then !== null || op.listener !== null) return;
    op.reusable = false;
    op.hdr = null;
    op.result = null;
    op.mem = null;
    op.parts = 1;
    op.posted = false;
    if (this.freeOps.length < FREE_OPS) this.freeOps.push(op);
  }

  /**
   * An operation ends (once): its memory is unpinned, its abort watch
   * removed, and its continuations handed to the caller to run (in a record
   * reused by the next end(): take them out before anything else ends).
   */
  end(op: Op): Ended {
    const mem = op.mem;
    op.mem = null;
    mem?.opDone();
    op.unwatch?.();
    op.unwatch = null;
    // One record, reused: the caller takes the continuations out at once (nothing per operation).
    const r = this.ended;
    r.resolve = op.resolve;
    r.reject = op.reject;
    r.then = op.then;
    r.listener = op.listener;
    op.resolve = op.reject = op.then = null;
    op.listener = null;
    return r;
  }

  /** Empties the table: every operation still in it (a completion that never came), for the caller to settle. */
  drain(): Op[] {
    const left: Op[] = [];
    for (let i = 0; i < this.slots.length; i++) {
      const op = this.slots[i];
      if (!op) continue;
      this.slots[i] = null;
      left.push(op);
    }
    return left;
  }
}
