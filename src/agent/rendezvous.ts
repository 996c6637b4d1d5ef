/**
 * Rendezvous: two-sided messages larger than the peer's eager size, in both
 * directions.
 *
 * Sending: the bytes are lent read-only (bounce memory for mid sizes,
 * bounce.ts; a registration over exactly them above) and announced (RNDV);
 * the peer READs them and answers RNDV_DONE, after which the lend ends.
 * Receiving: an announcement takes its place in the inbox's arrival order;
 * its READ starts once the process-wide peer-memory budget (memory/budget.ts)
 * allows, in arrival order, into memory of this side's own.
 *
 * Invariants:
 * - the sender's bytes stay lent (and pinned) until the peer's RNDV_DONE says
 *   it has them or dropped them: an abort or the deadline (rendezvousTimeoutMs)
 *   before that sends RNDV_CANCEL and the answer decides the outcome (the peer
 *   may be reading); one that is still queued (for credits) is withdrawn and
 *   nothing reaches the wire; an unanswered cancel is bounded by the peer
 *   timeout (liveness.ts);
 * - every announcement received is answered exactly once (RNDV_DONE delivered
 *   or cancelled), and an unread or unfinished one holds a credit like an
 *   eager message;
 * - the budget taken for a READ goes back when its memory is freed, however
 *   the message ends.
 */
import { RdmaError } from "../errors.js";
import { Access, WrOpcode, SendFlags, type MemoryRegion } from "../transport/types.js";
import { LocalMemory, LocalMr } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import { peerMemory } from "../memory/budget.js";
import { abortError } from "./queue.js";
import { MsgType, RndvStatus, encodeMsg, toWire, type CtrlMessage } from "./codec.js";
import type { Bounce } from "./bounce.js";
import type { Inbox, Incoming } from "./inbox.js";
import type { CtrlMsg } from "./memory-protocol.js";
import { newOp, type Op } from "./ops.js";
import { CTRL_BUF, type Pending } from "./send-lanes.js";

/** What rendezvous needs from its connection. */
export interface RendezvousHost {
  /** The connection failed or is closing. */
  isDown(): boolean;
  /** Why the connection failed, or null. */
  failed(): RdmaError | null;
  /** A recycled control-message buffer. */
  takeHdr(): LocalMemory;
  /** Queues a work request in its lane (send-lanes.ts). */
  enqueue(p: Pending): void;
  /** Removes `op`'s work requests still waiting in the data lane. */
  withdraw(op: Op): Pending[];
  /** An operation none of whose work requests was posted: freed, its promise rejected. */
  dropQueued(op: Op, parts: Pending[], err: unknown): void;
  /** Calls `fn` when `signal` aborts, until the returned function is called. */
  watchAbort(signal: AbortSignal, fn: () => void): () => void;
  sendCtrl(m: CtrlMsg): void;
  /** Posts the agent's own READ of `dst`'s bytes from the peer (the internal lane). */
  read(op: Op, dst: LocalMr, addr: number, rkey: number): void;
  /** A cancel waits for the peer's answer: the peer timeout applies meanwhile. */
  awaitAnswer(): void;
  protocolError(reason: string): void;
  /** A message of `len` bytes was fetched and delivered to the inbox (stats). */
  delivered(len: number): void;
}

interface Outgoing {
  mr: MemoryRegion;
  resolve: () => void;
  reject: (e: unknown) => void;
  /** Why it was cancelled (abort or deadline); the peer's RNDV_DONE decides the outcome. */
  cancelReason: RdmaError | null;
  timer: NodeJS.Timeout | null;
}

export class Rendezvous {
  private nextToken = 1;
  private readonly out = new Map<number, Outgoing>();
  /** Incoming rendezvous messages waiting for the process-wide peer memory budget. */
  private readonly waiting: Incoming[] = [];
  private unsubscribeBudget: (() => void) | null = null;

  constructor(
    private readonly host: RendezvousHost,
    private readonly pool: MrPool,
    private readonly bounce: Bounce,
    private readonly inbox: Inbox,
    private readonly timeoutMs: number,
  ) {}

  /** Outgoing messages the peer has not answered yet. */
  get outstanding(): number {
    return this.out.size;
  }

  /**
   * Sends `lmr`'s bytes by rendezvous. The registration stays until the
   * peer's answer; no answer within peerTimeoutMs fails the connection,
   * which revokes it.
   */
  send(lmr: LocalMr, imm: number | undefined, eagerMax: number, signal?: AbortSignal): Promise<void> {
    const len = lmr.length;
    const token = this.nextToken;
    this.nextToken = (this.nextToken + 1) >>> 0 || 1;
    // Mid sizes are copied into this connection's bounce memory (registered once); larger
    // messages get a registration over exactly their bytes, revoked once the peer has them.
    const slot = this.bounce.take(len, eagerMax);
    let mr: MemoryRegion;
    let addr: number;
    // Bounce: the bytes are copied into the slot only when the announcement is posted (the
    // peer knows the bounce memory's key from earlier messages: a message aborted while
    // queued must never have been there), and the slot is wiped unless the peer took them.
    let copied = false;
    const copyIn = (): void => {
      if (copied || slot < 0) return;
      copied = true;
      // The memory is pinned (inflight) until now, even if its owner disposed of it meanwhile (freeing
      // waits for the operation): read the allocation itself, no check, and keep no view of it.
      const a = lmr.mem.alloc;
      this.bounce.copyIn(slot, new Uint8Array(a.buffer, a.bufOffset + lmr.start, lmr.length));
      lmr.mem.opDone();
    };
    if (slot >= 0) {
      mr = this.bounce.mr;
      addr = this.bounce.addr(slot);
    } else {
      mr = this.pool.grant(lmr.mem.alloc, lmr.start, len, Access.REMOTE_READ);
      addr = mr.addr;
    }
    // The user's bytes stay pinned until the copy (bounce) or until the peer has them.
    lmr.mem.inflight++;
    return new Promise<void>((resolve, reject) => {
      let unwatch: (() => void) | null = null;
      const settle = (delivered: boolean): void => {
        const r = this.out.get(token);
        if (r?.timer) clearTimeout(r.timer);
        this.out.delete(token);
        unwatch?.();
        if (slot >= 0) {
          if (!copied) lmr.mem.opDone();
          this.bounce.put(slot, copied && !delivered);
        } else {
          mr.deregister();
          lmr.mem.opDone();
        }
      };
      const entry: Outgoing = {
        mr,
        resolve: () => {
          settle(true);
          resolve();
        },
        reject: (e) => {
          settle(false);
          reject(e);
        },
        cancelReason: null,
        timer: null,
      };
      this.out.set(token, entry);
      const op = newOp("msg");
      // While the announcement waits in the queue (for credits) an abort or the deadline removes
      // it: nothing reached the wire, the peer knows nothing to cancel. Once posted, they cancel
      // the rendezvous with the peer.
      const withdraw = (reason: RdmaError): void => {
        if (op.posted) return this.cancel(token, reason);
        const mine = this.host.withdraw(op);
        op.then = null;
        this.host.dropQueued(op, mine, null);
        this.out.get(token)?.reject(reason);
      };
      if (this.timeoutMs > 0) {
        entry.timer = setTimeout(() => withdraw(new RdmaError("TIMEOUT", `send: the peer did not take the ${len}-byte message within ${this.timeoutMs} ms (rendezvousTimeoutMs)`)), this.timeoutMs);
        entry.timer.unref();
      }
      op.then = (ok) => {
        if (!ok) this.out.get(token)?.reject(this.host.failed() ?? new RdmaError("CONNECTION_CLOSED", "send failed"));
      };
      const hdr = this.host.takeHdr();
      const a = hdr.alloc;
      const n = encodeMsg(new Uint8Array(a.buffer, a.bufOffset, CTRL_BUF), toWire({ type: MsgType.RNDV, token, length: len, addr, rkey: mr.rkey, imm }));
      op.hdr = hdr;
      if (signal) unwatch = this.host.watchAbort(signal, () => withdraw(abortError(signal)));
      this.host.enqueue({ wr: { wrId: 0, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: n, lkey: a.mr.lkey }] }, op, credit: 2, hdr, onPost: copyIn });
    });
  }

  private cancel(token: number, reason: RdmaError): void {
    const r = this.out.get(token);
    if (!r || r.cancelReason) return;
    r.cancelReason = reason;
    if (r.timer) clearTimeout(r.timer);
    r.timer = null;
    // Only a failure stops the cancel (fail() settles the message); a flushing close is still
    // live and the peer must learn that it may drop the message.
    if (this.host.failed()) return;
    this.host.sendCtrl({ type: MsgType.RNDV_CANCEL, token });
    // The answer (RNDV_DONE) must come within the peer timeout; the liveness check enforces
    // that while the cancel is unanswered.
    this.host.awaitAnswer();
  }

  /** Resolves once every message sent so far is settled (taken by the peer, cancelled or failed): a flushing close waits for it. */
  settled(): Promise<true> {
    return Promise.all(
      [...this.out.values()].map(
        (r) =>
          new Promise<void>((done) => {
            const { resolve, reject } = r;
            r.resolve = () => (resolve(), done());
            r.reject = (e) => (reject(e), done());
          }),
      ),
    ).then(() => true);
  }

  /** The peer's RNDV_DONE for one of our messages: delivered, or dropped after our cancel. */
  onDone(token: number, status: number): void {
    const r = this.out.get(token);
    if (!r) return this.host.protocolError(`RNDV_DONE for unknown rendezvous ${token}`);
    if (status === RndvStatus.CANCELLED) {
      if (!r.cancelReason) return this.host.protocolError(`RNDV_DONE cancels rendezvous ${token}, which was not cancelled`);
      r.reject(r.cancelReason);
    } else r.resolve();
  }

  /**
   * An announced rendezvous message: READ it into memory of our own once the
   * process-wide peer memory budget allows (memory/budget.ts), in arrival
   * order; an unread one holds a credit like an eager message.
   */
  onAnnounce(m: Extract<CtrlMessage, { type: typeof MsgType.RNDV }>): void {
    const entry: Incoming = { ready: false, mr: null, imm: m.imm, rndv: { token: m.token, len: m.length, addr: m.addr, rkey: m.rkey, done: false, cancelled: false, started: false } };
    this.inbox.pushRendezvous(entry);
    this.waiting.push(entry);
    this.startReads();
  }

  private startReads(): void {
    while (this.waiting.length > 0 && !this.host.isDown()) {
      const entry = this.waiting[0]!;
      const r = entry.rndv!;
      if (!peerMemory.take(r.len)) {
        // Wait for memory to come back (any connection of the process).
        this.unsubscribeBudget ??= peerMemory.onFree(() => this.startReads());
        return;
      }
      this.waiting.shift();
      let dst: LocalMemory;
      try {
        dst = new LocalMemory(this.pool, this.pool.alloc(r.len), () => peerMemory.give(r.len));
      } catch (e) {
        peerMemory.give(r.len);
        return this.host.protocolError(`cannot allocate ${r.len} bytes for a rendezvous message: ${(e as Error).message}`);
      }
      r.started = true;
      const op = newOp("read");
      op.then = (ok) => {
        if (!ok) return dst.release();
        r.done = true;
        if (r.cancelled) {
          // The sender gave up before we delivered: drop it and say so.
          dst.release();
          this.inbox.drop(entry);
          this.host.sendCtrl({ type: MsgType.RNDV_DONE, token: r.token, status: RndvStatus.CANCELLED });
          return;
        }
        this.host.sendCtrl({ type: MsgType.RNDV_DONE, token: r.token, status: RndvStatus.DELIVERED });
        this.host.delivered(r.len);
        this.inbox.ready(entry, new LocalMr(dst, 0, r.len));
      };
      this.host.read(op, new LocalMr(dst, 0, r.len), r.addr, r.rkey);
    }
    if (this.waiting.length === 0) this.stopWaitingForBudget();
  }

  /** The peer cancelled a message it announced. */
  onCancel(token: number): void {
    const entry = this.inbox.findRendezvous(token);
    if (!entry) return; // already delivered (RNDV_DONE sent), or unknown: the sender settles on our RNDV_DONE
    const r = entry.rndv!;
    r.cancelled = true;
    if (r.started) return; // the READ's completion answers
    const w = this.waiting.indexOf(entry);
    if (w >= 0) this.waiting.splice(w, 1);
    r.done = true;
    this.inbox.drop(entry);
    this.host.sendCtrl({ type: MsgType.RNDV_DONE, token, status: RndvStatus.CANCELLED });
  }

  /** The connection failed: our messages reject with the cause; announced ones are no longer read. */
  fail(err: RdmaError): void {
    for (const r of [...this.out.values()]) r.reject(err);
    this.waiting.length = 0;
    this.stopWaitingForBudget();
  }

  /** Teardown: no deadline outlives the connection. */
  teardown(): void {
    for (const r of this.out.values()) if (r.timer) clearTimeout(r.timer);
  }

  private stopWaitingForBudget(): void {
    if (this.unsubscribeBudget) {
      this.unsubscribeBudget();
      this.unsubscribeBudget = null;
    }
  }
}
