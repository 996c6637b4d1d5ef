/**
 * How one connection ends: failure, graceful close (with or without flush),
 * teardown, and the abandon of a connection whose setup failed.
 *
 * Invariants:
 * - `fail` is idempotent: the first failure is the connection's failure and
 *   every later one is ignored. It rejects every waiter (memory protocol,
 *   rendezvous, inbox), drops the work still queued for posting, moves the
 *   QP to ERR and lets the flushed completions settle what was posted;
 * - every operation settles exactly once: one none of whose work requests
 *   was posted is dropped here, one partly posted settles with its flushed
 *   completions, and one whose completion never came (the drain deadline,
 *   2 s) is rejected with the failure at teardown;
 * - `close` tells the peer (CLOSE) and refuses new operations at once, but
 *   the connection stays live while it waits: liveness runs and rendezvous
 *   cancels reach the peer. With `flush` the peer has taken everything sent
 *   before (every rendezvous send answered, and the CLOSE goes in the data
 *   lane behind every queued send and write) or the close reports why not
 *   (`closeFailure`: TIMEOUT, or what ended the connection meanwhile) and
 *   the connection did not end cleanly;
 * - `abandon` (setup failed before start) and teardown free everything the
 *   connection holds, once, whatever the peer sent;
 * - teardown order: the QP and the CQ are destroyed before the buffers posted
 *   to them are freed (the device stops using them first), then the parts
 *   release what they hold.
 */
import { RdmaError } from "../errors.js";
import { QpState, type AsyncEvent, type CompletionQueue, type QueuePair } from "../transport/types.js";
import type { Bounce } from "./bounce.js";
import type { Inbox } from "./inbox.js";
import type { Liveness } from "./liveness.js";
import type { MemoryProtocol } from "./memory-protocol.js";
import type { Op, OpTable } from "./ops.js";
import type { Poller } from "./poller.js";
import type { RecvRing } from "./recv-ring.js";
import type { Rendezvous } from "./rendezvous.js";
import type { HeaderPool, Pending, SendLanes } from "./send-lanes.js";

/** A work request whose flush completion did not come within this long is settled at teardown. */
const DRAIN_DEADLINE_MS = 2000;

/** What the lifecycle needs from its connection: the queues it destroys and the parts it ends, in its order. */
export interface LifecycleHost {
  readonly qp: Pick<QueuePair, "state" | "setError" | "destroy" | "onEvent">;
  readonly cq: Pick<CompletionQueue, "destroy">;
  readonly ops: Pick<OpTable, "drain" | "end">;
  readonly lanes: Pick<SendLanes, "takeAll" | "outstanding">;
  readonly headers: Pick<HeaderPool, "put" | "release">;
  readonly recvs: Pick<RecvRing, "size" | "release">;
  readonly poller: Pick<Poller, "pollNow" | "armForFlush" | "stop">;
  readonly inbox: Pick<Inbox, "fail" | "abandon" | "teardown" | "dropUnread">;
  readonly rndv: Pick<Rendezvous, "fail" | "teardown" | "outstanding" | "settled">;
  readonly memory: Pick<MemoryProtocol, "fail" | "teardown">;
  readonly live: Pick<Liveness, "stop">;
  readonly bounce: Pick<Bounce, "release">;
  /** An operation none of whose work requests was posted: its resources freed, its promise rejected. */
  dropQueued(op: Op, parts: Pending[], err: unknown): void;
  /** Queues CLOSE (`ordered`: in the data lane, behind every queued send and write); settles when its SEND completes. */
  sendClose(ordered: boolean): Promise<void>;
  /** The connection is gone (its owner's hook). */
  onClosed(): void;
}

export class Lifecycle {
  /** Why the connection ended (set once: the first failure). */
  failure: RdmaError | null = null;
  /** This side's close began: new operations are refused. */
  closing = false;
  /** Torn down (or abandoned): the queues are destroyed and everything released. */
  closed = false;
  /** The peer sent CLOSE: it sends nothing after it, and anything that comes anyway is not delivered. */
  peerClosed = false;
  /** The connection ended by a close of either side (CLOSE sent or received before any failure), not by a failure. */
  endedCleanly = false;
  /** Why this side's flushing close did not flush (the connection did not end cleanly); null otherwise. */
  closeFailure: RdmaError | null = null;
  private drainDeadline: NodeJS.Timeout | null = null;
  private readonly closedWaiters: (() => void)[] = [];

  constructor(private readonly host: LifecycleHost) {}

  /** The connection failed or is closing. */
  get down(): boolean {
    return this.failure !== null || this.closing;
  }

  /** Throws when the connection is closing (new operations are refused) or failed (with its failure as the cause). */
  checkOpen(what: string): void {
    if (this.failure) throw new RdmaError(this.failure.code === "CONNECTION_CLOSED" ? "CONNECTION_CLOSED" : this.failure.code, `${what}: ${this.failure.message}`, { cause: this.failure });
    if (this.closing) throw new RdmaError("CONNECTION_CLOSED", `${what}: the connection is closing`);
  }

  /** An asynchronous QP event (the QP left RTS). */
  onQpEvent(e: AsyncEvent): void {
    this.fail(new RdmaError("CONNECTION_CLOSED", `connection failed: ${e.reason}`));
  }

  /** The peer broke the protocol: nothing it sent after that is delivered (arrivals.ts). */
  protocolFailed = false;

  protocolError(reason: string): void {
    this.protocolFailed = true;
    const err = new RdmaError("PROTOCOL", `malformed control message from the peer: ${reason}; connection closed`);
    this.fail(err);
  }

  /** The peer's CLOSE arrived. */
  onPeerClose(): void {
    this.peerClosed = true;
    if (!this.failure) this.endedCleanly = true;
    this.fail(new RdmaError("CONNECTION_CLOSED", "the peer closed the connection"));
  }

  /** Fails the connection: every pending operation and wait rejects with the cause. */
  fail(err: RdmaError): void {
    if (this.failure) return;
    this.failure = err;
    const h = this.host;
    h.memory.fail(err);
    h.rndv.fail(err);
    // Messages that arrived whole before the end stay receivable (as a TCP
    // socket keeps the data before the FIN), unless this side closed.
    h.inbox.fail(err, this.closing);
    // Work that never reached the send queue: freed now, its operations rejected (once each).
    const queued = h.lanes.takeAll();
    const ops = new Map<Op, Pending[]>();
    for (const p of queued) {
      const l = ops.get(p.op);
      if (l) l.push(p);
      else ops.set(p.op, [p]);
    }
    for (const [op, parts] of ops) {
      if (op.posted) {
        // Some parts were posted: they settle the op with their (flushed) completions.
        for (const p of parts) if (p.hdr) h.headers.put(p.hdr);
        op.parts -= parts.length;
        if (op.parts <= 0) h.dropQueued(op, [], err);
      } else h.dropQueued(op, parts, err);
    }
    if (h.qp.state !== QpState.ERR) {
      try {
        h.qp.setError();
      } catch {
        /* already gone */
      }
    }
    // Flushed completions settle the posted operations; then tear down.
    h.poller.pollNow();
    this.teardownWhenDrained();
  }

  /** The completion queue was drained: a failed connection with nothing left posted is torn down. */
  drained(): void {
    if (this.failure && !this.closed && this.host.lanes.outstanding === 0 && this.host.recvs.size === 0) this.teardown();
  }

  /** Tears down once the flush completions have settled every posted WR (deadline DRAIN_DEADLINE_MS). */
  private teardownWhenDrained(): void {
    if (this.closed) return;
    if (this.host.lanes.outstanding === 0 && this.host.recvs.size === 0) return this.teardown();
    this.host.poller.armForFlush();
    if (this.drainDeadline === null) {
      this.drainDeadline = setTimeout(() => this.teardown(), DRAIN_DEADLINE_MS);
      this.drainDeadline.unref();
    }
  }

  private teardown(): void {
    if (this.closed) return;
    this.closed = true;
    this.host.poller.stop();
    this.destroyQueues();
    this.releaseAll();
    this.host.onClosed();
    for (const r of this.closedWaiters.splice(0)) r();
  }

  /**
   * Frees everything this connection holds, whatever the peer sent: grants
   * and lends (revoked first), regions handed back and never picked up,
   * messages received and never read, receive and control buffers, and any
   * operation whose completion never came.
   */
  private releaseAll(): void {
    const h = this.host;
    h.live.stop();
    if (this.drainDeadline) clearTimeout(this.drainDeadline);
    h.memory.teardown();
    h.rndv.teardown();
    // Any op still pending (a completion that never came) is settled now.
    for (const op of h.ops.drain()) {
      if (op.kind === "recv") continue;
      op.hdr?.release();
      op.hdr = null;
      op.result?.release();
      op.result = null;
      const { reject, then, listener } = h.ops.end(op);
      then?.(false);
      reject?.(this.failure);
      listener?.sent(this.failure);
    }
    h.recvs.release();
    h.headers.release();
    h.bounce.release();
    // Messages not read yet stay receivable (unless this side closed): the pool moves them out
    // of registered memory when it closes, keeping their peer-memory charge until read or dropped.
    h.inbox.teardown();
  }

  /**
   * A connection whose setup failed before start(): destroys its QP and CQ,
   * frees its receive and control buffers and marks it closed.
   */
  abandon(reason: RdmaError): void {
    if (this.closed) return;
    if (!this.failure) this.failure = reason;
    this.host.inbox.abandon();
    this.closed = true;
    this.host.memory.fail(reason);
    this.host.poller.stop();
    this.destroyQueues();
    this.releaseAll();
  }

  /**
   * The agent owns its QP and CQ and destroys them, once, before freeing the
   * buffers posted to them: the device stops using them first.
   */
  private destroyQueues(): void {
    this.host.qp.onEvent = null;
    try {
      this.host.qp.destroy();
    } catch {
      /* already destroyed */
    }
    try {
      this.host.cq.destroy();
    } catch {
      /* already destroyed */
    }
  }

  /**
   * Graceful close: tells the peer (its pending receives reject with
   * CONNECTION_CLOSED), waits for that message to leave, then tears down.
   * `flush`: the peer receives everything sent before. Resolves null when
   * the close did what was asked, else with the error that says why not
   * (TIMEOUT: `timeoutMs` ran out and the rest was dropped; or what ended
   * the connection meanwhile); that error is also `closeFailure`, and the
   * connection did not end cleanly.
   */
  async close(timeoutMs: number, flush = false): Promise<RdmaError | null> {
    // Closing this side drops what the peer sent and nobody read.
    if (this.failure) this.host.inbox.dropUnread(this.closed);
    if (this.closing || this.failure) {
      if (this.failure && !this.closed) await this.waitClosed(timeoutMs);
      // Already ended: what did not reach the peer was reported on its own operation.
      return null;
    }
    // While a flush waits the connection stays live: liveness runs, rendezvous cancels reach
    // the peer; only new operations are refused (checkOpen).
    this.closing = true;
    let timer: NodeJS.Timeout | null = null;
    const expired = new Promise<false>((r) => (timer = setTimeout(() => r(false), timeoutMs)));
    // Flushing: every rendezvous send is taken by the peer first, and the CLOSE goes in the
    // data lane behind every queued send and write, so its completion means the peer has
    // received all of them.
    let flushed = !flush || this.host.rndv.outstanding === 0 || (await Promise.race([this.host.rndv.settled(), expired]));
    if (this.failure === null) {
      const sent = this.host.sendClose(flush);
      flushed = (await Promise.race([sent.then(() => true, () => false), expired])) && flushed;
    } else flushed = false;
    if (timer) clearTimeout(timer);
    if (flush && !flushed) {
      // What ended a flush that did not finish: a failure (or the peer's close) meanwhile, else the timeout.
      const cause = this.failure as RdmaError | null; // set meanwhile, across the awaits
      this.closeFailure = cause
        ? new RdmaError(cause.code, `close: the connection ended before the peer took everything sent: ${cause.message}`, { cause })
        : new RdmaError("TIMEOUT", `close: the peer did not take everything sent within ${timeoutMs} ms (timeoutMs); the connection is closed and the rest was dropped`);
      this.endedCleanly = false; // even if the peer's CLOSE came meanwhile: something sent was lost
    } else if (!this.failure) this.endedCleanly = true;
    this.fail(new RdmaError("CONNECTION_CLOSED", "the connection was closed by this side"));
    await this.waitClosed(timeoutMs);
    return this.closeFailure;
  }

  private waitClosed(timeoutMs: number): Promise<void> {
    if (this.closed) return Promise.resolve();
    return new Promise<void>((resolve) => {
      const t = setTimeout(() => this.teardown(), timeoutMs);
      this.closedWaiters.push(() => {
        clearTimeout(t);
        resolve();
      });
    });
  }
}
