/**
 * The agent: one connection's engine over one RC QP. It posts work requests
 * in per-tick batches (one postSend per flush), drains completions, runs the
 * control protocol (credits, memory requests, grants and leases, lending,
 * rendezvous, close) and turns work completions into promise settlements.
 *
 * Its parts, each owning one invariant behind a narrow host interface:
 * credits.ts (flow control: the peer never sees a SEND without a receive
 * posted, and credits can always flow back), inbox.ts (arrival order,
 * back-pressure, what stays receivable after the end), liveness.ts (a dead or stopped
 * peer is noticed within keepalive + peer timeout), memory-protocol.ts
 * (grants, lends, shares, quotas and leases), poller.ts (completion polling).
 */
import { RdmaError, type RdmaErrorCode } from "../errors.js";
import {
  Access,
  CompletionBuffer,
  QpState,
  SendFlags,
  WcOpcode,
  WcStatus,
  WrOpcode,
  wcStatusName,
  type AsyncEvent,
  type CompletionQueue,
  type QueuePair,
  type SendWr,
} from "../transport/types.js";
import type { MemoryRegion } from "../transport/types.js";
import { LocalMemory, LocalMr, type RemoteLease, type RemoteMr } from "../memory/mr.js";
import type { Allocation, MrPool } from "../memory/pool.js";
import { peerMemory } from "../memory/budget.js";
import { AbortWatch, abortError } from "./queue.js";
import { HDR, MsgType, RndvStatus, decodeMsg, encodeMsg, newMsg, type Msg } from "./codec.js";
import { Credits, NEED } from "./credits.js";
import { Bounce } from "./bounce.js";
import { Inbox, type Incoming, type Received } from "./inbox.js";
import { Liveness } from "./liveness.js";
import { MemoryProtocol, type CtrlMsg, type MemoryHost, type PeerLimits } from "./memory-protocol.js";
import type { Share } from "./shares.js";
import type { RemoteAccess } from "../memory/mr.js";
import { Poller } from "./poller.js";
import { Traffic } from "./stats.js";

import type { PollingMode } from "./poller.js";
export type { PollingMode };

export interface ConnectionOptions {
  /** Receive buffers posted for the peer's messages. */
  recvDepth: number;
  /** Largest message sent eagerly (copied into a posted receive); larger ones use rendezvous READ. */
  eagerMax: number;
  sendDepth: number;
  /** Bytes of this side's memory the peer may hold through requestRemoteMr at once. */
  quotaBytes: number;
  /** Regions the peer may hold through requestRemoteMr at once. */
  maxRegions: number;
  /** The owner revokes a grant or lend this long after the borrower's lease ends (leases.ts). */
  leaseGraceMs: number;
  /**
   * While this side waits on the peer (work posted, or a PING sent), the
   * peer must make progress (a completion, a message) within this bound or
   * the connection fails with RETRY_EXCEEDED (0: no bound). Devices do not
   * all report a dead peer (rxe does not), and a stopped process's device
   * may still answer; the agent bounds it itself.
   */
  peerTimeoutMs: number;
  /** A rendezvous send not completed by the peer within this is cancelled (0: never). */
  rendezvousTimeoutMs: number;
  /** Lease granted when the requester asks for none, and for lent regions. */
  defaultLeaseMs: number;
  /** Upper bound on any lease this side grants. */
  maxLeaseMs: number;
  polling: PollingMode;
  /** adaptive mode: how long to keep polling after the last completion before arming events. */
  spinUs: number;
  /** The QP's max inline data (0: no inline sends). */
  maxInline: number;
  /** Largest two-sided message accepted from the peer (rendezvous allocates this much). */
  maxMessageSize: number;
  /**
   * Idle time after which a PING asks the peer's agent for a PONG (0: never).
   * A dead or stopped peer then fails the connection after peerTimeoutMs and
   * every pending wait rejects, even when this side was only waiting to
   * receive.
   */
  keepaliveMs: number;
  /** Shared regions the peer may open (shares.ts), and how `allow(peer)` callbacks see the peer. */
  shares?: { find(key: string): Share | undefined; peer(): unknown };
}

export interface PeerParams {
  recvDepth: number;
  eagerMax: number;
  /** When the handshake told us; otherwise the sender does not check and the peer refuses. */
  maxMessageSize?: number;
}

const CTRL_BUF = 64;
/** At least one signaled WR per this many, so the send queue drains under selective signaling. */
const SIGNAL_EVERY = 32;
/**
 * One-sided transfers are posted as work requests of at most this many bytes
 * (one operation, one promise): completions keep coming during a long
 * transfer, so progress is visible to the peer timeout.
 */
export const CHUNK_BYTES = 8 << 20;

type OpKind = "msg" | "write" | "read" | "atomic" | "recv";

interface Op {
  kind: OpKind;
  resolve: ((v: unknown) => void) | null;
  reject: ((e: unknown) => void) | null;
  /** Memory kept alive while the op is in flight. */
  mems: LocalMemory[];
  /** A control-message buffer to free on completion. */
  hdr: LocalMemory | null;
  /** atomics: where the old value lands. */
  result: LocalMemory | null;
  /** Called on success instead of resolve (internal continuations). */
  then: ((ok: boolean) => void) | null;
  /** Stops watching the operation's signal (AbortWatch); null when it has none or it ended. */
  unwatch: (() => void) | null;
  /** Work requests still to complete (chunked transfers post several). */
  parts: number;
  /** Some work request of it reached the send queue (an abort can no longer recall it). */
  posted: boolean;
}

interface Pending {
  wr: SendWr;
  op: Op;
  /** 0: no credit (one-sided), 1: control, 2: data message, 3: credit message */
  credit: number;
  /**
   * The agent's own one-sided work (the READ of a rendezvous message it
   * receives): needs no credit and has no order with the user's operations,
   * so it never waits behind messages that wait for credits. Behind them it
   * could deadlock: the peer returns credits only as this side's messages are
   * read, which may wait for this READ.
   */
  internal?: boolean;
  /**
   * A control message that must not overtake the user's operations queued
   * before it (the acknowledgement of a revocation): it goes in the data
   * lane, in order, with a control message's credit need.
   */
  ordered?: boolean;
  /**
   * The remote region a one-sided operation targets: if its owner revoked it
   * while the operation still waited in the queue, the operation is dropped
   * locally (REMOTE_ACCESS) instead of reaching memory that may be gone.
   */
  lease?: RemoteLease | undefined;
  /** Runs when the work request is taken for posting (a rendezvous copies into bounce memory then). */
  onPost?: () => void;
  /** control buffer whose header gets the piggybacked credit count */
  hdr: LocalMemory | null;
}

interface RndvOut {
  mr: MemoryRegion;
  /** Replaced by a flushing close that waits for it (rendezvousSettled). */
  resolve: () => void;
  reject: (e: unknown) => void;
  /** Why it was cancelled (abort or deadline); the peer's RNDV_DONE decides the outcome. */
  cancelReason: RdmaError | null;
  timer: NodeJS.Timeout | null;
}

/** Credits the head of the data lane needs: a data message, an ordered control message, or one-sided work (none). */
function dataNeed(p: Pending): number {
  return p.credit === 2 ? NEED.data : p.credit === 1 ? NEED.ctrl : 0;
}

function codeOfStatus(s: number): RdmaErrorCode {
  switch (s) {
    case WcStatus.REM_ACCESS_ERR:
      return "REMOTE_ACCESS";
    case WcStatus.REM_INV_REQ_ERR:
      return "REMOTE_INVALID_REQUEST";
    case WcStatus.REM_OP_ERR:
      return "REMOTE_OPERATION";
    case WcStatus.RETRY_EXC_ERR:
      return "RETRY_EXCEEDED";
    case WcStatus.RNR_RETRY_EXC_ERR:
      return "RNR_RETRY_EXCEEDED";
    case WcStatus.WR_FLUSH_ERR:
      return "FLUSHED";
    case WcStatus.LOC_PROT_ERR:
      return "LOCAL_PROTECTION";
    case WcStatus.LOC_LEN_ERR:
      return "LOCAL_LENGTH";
    default:
      return "DEVICE";
  }
}

const ADVICE: Partial<Record<RdmaErrorCode, string>> = {
  REMOTE_ACCESS: "the peer refused the access (bad rkey, out of bounds, missing access, or a revoked lease); the connection is no longer usable",
  RETRY_EXCEEDED: "the peer did not answer (dead, unreachable or its QP was destroyed); reconnect",
  RNR_RETRY_EXCEEDED: "the peer had no receive posted for too long",
  FLUSHED: "the connection had already failed",
};

/** @internal */
export class Connection implements MemoryHost {
  readonly qp: QueuePair;
  readonly cq: CompletionQueue;
  readonly pool: MrPool;
  readonly opts: ConnectionOptions;
  readonly peer: PeerParams;

  // slots: integer wr_ids index this table (no closures below the API)
  private slots: (Op | null)[] = [];
  private freeSlots: number[] = [];
  private recvSlots = new Map<number, LocalMemory>();

  /** Send credits both ways (credits.ts). */
  private readonly cr: Credits;
  private sqOutstanding = 0;
  /** Slot ids of posted send WRs, in post order (completions arrive in this order). */
  private sqFifo: number[] = [];
  private sqFifoHead = 0;
  private sinceSignal = 0;
  private ctrlQ: Pending[] = [];
  private creditQ: Pending[] = [];
  /** Internal one-sided work (Pending.internal), posted before anything waiting for credits. */
  private rdQ: Pending[] = [];
  private dataQ: Pending[] = [];
  private flushScheduled = false;
  private readonly poller: Poller;

  /** What arrived and was not read: arrival order, back-pressure, kept after the end (inbox.ts). */
  private readonly inbox: Inbox;

  private nextToken = 1;
  private readonly rndvOut = new Map<number, RndvOut>();
  /** Incoming rendezvous messages waiting for the process-wide peer memory budget. */
  private readonly rndvWaiting: Incoming[] = [];
  private unsubscribeBudget: (() => void) | null = null;
  readonly memory: MemoryProtocol;
  private readonly live: Liveness;
  /** Messages and bytes each way, rendezvous, credit stalls (stats.ts). */
  readonly traffic = new Traffic();

  /** Last time the peer showed progress (a completion or an arrival), or this side began to wait. */

  failure: RdmaError | null = null;
  closing = false;
  private closed = false;
  private readonly onClosed: () => void;
  private readonly msg: Msg = newMsg();

  constructor(qp: QueuePair, cq: CompletionQueue, pool: MrPool, opts: ConnectionOptions, peer: PeerParams, onClosed: () => void) {
    this.qp = qp;
    this.cq = cq;
    this.pool = pool;
    this.opts = opts;
    this.peer = peer;
    this.cr = new Credits(peer.recvDepth, opts.recvDepth);
    this.onClosed = onClosed;
    this.memory = new MemoryProtocol(this, {
      quotaBytes: opts.quotaBytes,
      maxRegions: opts.maxRegions,
      defaultLeaseMs: opts.defaultLeaseMs,
      maxLeaseMs: opts.maxLeaseMs,
      leaseGraceMs: opts.leaseGraceMs,
      maxRegionSize: Math.min(pool.pd.device.attr.maxMrSize, 2 ** 32 - 1),
    });
    this.bounce = new Bounce(pool);
    this.inbox = new Inbox({ repostRecv: () => this.repostRecv(), failed: () => this.failure }, opts.recvDepth);
    this.live = new Liveness(
      {
        isDown: () => this.failure !== null || this.closing,
        outstanding: () => this.sqOutstanding,
        ping: () => this.sendCtrl({ type: MsgType.PING }),
        expire: (err) => this.fail(err),
      },
      opts.keepaliveMs,
      opts.peerTimeoutMs,
    );
    qp.onEvent = (e: AsyncEvent) => this.onQpEvent(e);
    this.poller = new Poller(cq, opts.polling, opts.spinUs, (b, i) => this.onCompletion(b, i), () => this.afterDrain());
  }

  /** MemoryHost: a shared region of this side by name key. */
  findShare(key: string): Share | undefined {
    return this.opts.shares?.find(key);
  }

  /** MemoryHost: the peer as allow(peer) sees it. */
  peerInfo(): unknown {
    return this.opts.shares?.peer() ?? null;
  }

  /** The peer's limits (quota, regions, maximum lease and message size), once its LIMITS arrived. */
  get peerLimits(): PeerLimits | null {
    return this.memory.peerLimits;
  }

  /** Resolves once the peer's limits are known. */
  whenPeerLimits(timeoutMs: number): Promise<PeerLimits> {
    return this.memory.whenLimits(timeoutMs);
  }

  /** MemoryHost: the connection failed or is closing. */
  get down(): boolean {
    return this.failure !== null || this.closing;
  }

  /** Sets the peer's parameters once the handshake told us them (before any send). */
  setPeer(p: PeerParams): void {
    this.peer.recvDepth = p.recvDepth;
    this.peer.eagerMax = p.eagerMax;
    if (p.maxMessageSize !== undefined) this.peer.maxMessageSize = p.maxMessageSize;
    this.cr.setPeerDepth(p.recvDepth);
  }

  /** Posts the receive buffers; call before the QP connects so the peer never meets an empty queue. */
  postInitialReceives(): void {
    const wrs = [];
    for (let i = 0; i < this.opts.recvDepth; i++) wrs.push(this.newRecv());
    this.qp.postRecv(wrs);
  }

  /** Starts completion processing (after connect). */
  start(): void {
    this.poller.start();
    this.memory.sendLimits(this.opts.maxMessageSize);
    this.live.start();
  }

  // ------------------------------------------------------------------ slots

  private newOp(kind: OpKind): Op {
    return { kind, resolve: null, reject: null, mems: [], hdr: null, result: null, then: null, unwatch: null, parts: 1, posted: false };
  }

  private slot(op: Op): number {
    const id = this.freeSlots.pop();
    if (id !== undefined) {
      this.slots[id] = op;
      return id;
    }
    this.slots.push(op);
    return this.slots.length - 1;
  }

  /** Control-message buffers are recycled: no allocation, registration or detach per message. */
  private readonly hdrFree: LocalMemory[] = [];

  private takeHdr(): LocalMemory {
    return this.hdrFree.pop() ?? new LocalMemory(this.pool, this.pool.alloc(CTRL_BUF));
  }

  private putHdr(h: LocalMemory): void {
    if (this.closed || this.hdrFree.length >= this.opts.sendDepth) h.release();
    else this.hdrFree.push(h);
  }

  /**
   * Receive buffers that came back without being handed to the user (control
   * messages, immediates, rendezvous announcements): re-posted as they are,
   * with no allocation or registration per message. At most the receive depth.
   */
  private readonly recvFree: LocalMemory[] = [];

  private putRecv(mem: LocalMemory): void {
    if (this.closed || this.failure || this.recvFree.length >= this.opts.recvDepth) mem.release();
    else this.recvFree.push(mem);
  }

  /**
   * A receive buffer handed to the user (a DATA message) comes back here when
   * the user disposes it: its views are detached (pool.renew) and it is
   * re-posted, with no allocation or registration. Past the receive depth,
   * or closing, it is freed.
   */
  private recycledRecvs = 0;

  private readonly recycleRecv = (alloc: Allocation): boolean => {
    if (this.closed || this.failure || this.recvFree.length >= this.opts.recvDepth) return false;
    if (!this.pool.renew(alloc)) return false;
    const m = new LocalMemory(this.pool, alloc);
    m.recycle = this.recycleRecv;
    this.recvFree.push(m);
    this.recycledRecvs++;
    return true;
  };

  private newRecv() {
    let mem = this.recvFree.pop();
    if (mem === undefined) {
      mem = new LocalMemory(this.pool, this.pool.alloc(HDR + this.opts.eagerMax));
      mem.recycle = this.recycleRecv;
    }
    const id = this.slot(this.newOp("recv"));
    this.recvSlots.set(id, mem);
    const a = mem.alloc;
    return { wrId: id, sgList: [{ addr: a.addr, length: a.length, lkey: a.mr.lkey }] };
  }

  /** Receives re-posted while draining the CQ: posted as one list when the drain ends. */
  private recvBatch: { wrId: number; sgList: { addr: number; length: number; lkey: number }[] }[] = [];

  private repostRecv(): void {
    if (this.failure || this.closed) return;
    this.recvBatch.push(this.newRecv());
    if (!this.poller.draining) this.postRecvBatch();
  }

  /** Posts the batched receives (one postRecv), and only then counts them as credits to return. */
  private postRecvBatch(): void {
    const batch = this.recvBatch;
    if (batch.length === 0) return;
    this.recvBatch = [];
    if (this.failure || this.closed) {
      for (const r of batch) this.dropRecv(r.wrId);
      return;
    }
    try {
      this.qp.postRecv(batch);
    } catch (e) {
      for (const r of batch) this.dropRecv(r.wrId);
      this.fail(e instanceof RdmaError ? e : new RdmaError("DEVICE", `postRecv failed: ${(e as Error).message}`, { cause: e }));
      return;
    }
    this.cr.reposted(batch.length);
    this.maybeSendCredits();
  }

  /** A receive that was never posted: free its slot and buffer. */
  private dropRecv(id: number): void {
    const mem = this.recvSlots.get(id);
    this.recvSlots.delete(id);
    mem?.release();
    this.slots[id] = null;
    this.freeSlots.push(id);
  }

  // ---------------------------------------------------------------- posting

  checkOpen(what: string): void {
    if (this.failure) throw new RdmaError(this.failure.code === "CONNECTION_CLOSED" ? "CONNECTION_CLOSED" : this.failure.code, `${what}: ${this.failure.message}`, { cause: this.failure });
    if (this.closing) throw new RdmaError("CONNECTION_CLOSED", `${what}: the connection is closing`);
  }

  /** Encodes a control message into a recycled small buffer and queues its SEND. */
  sendCtrl(m: CtrlMsg, op: Op | null = null, credit = 1, ordered = false): void {
    const mem = this.takeHdr();
    const full: Msg = { flags: 0, credits: 0, imm: 0, token: 0, a: 0, b: 0, addr: 0, rkey: 0, id: 0, ...m };
    const a = mem.alloc;
    const len = encodeMsg(new Uint8Array(a.buffer, a.bufOffset, CTRL_BUF), full);
    const o = op ?? this.newOp("msg");
    o.hdr = mem;
    this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: len, lkey: a.mr.lkey }] }, op: o, credit, hdr: mem, ordered });
  }

  /** MemoryHost: a control message posted after every operation queued before it. */
  sendCtrlOrdered(m: CtrlMsg): void {
    this.sendCtrl(m, null, 1, true);
  }

  /** MemoryHost: a control message whose promise settles when its SEND completes. */
  postCtrl(m: CtrlMsg, signal?: AbortSignal): Promise<void> {
    const op = this.newOp("msg");
    const p = this.track<void>(op, signal);
    this.sendCtrl(m, op);
    return p;
  }

  private enqueue(p: Pending): void {
    // A failed connection posts nothing more: work queued after fail() (a PONG or RNDV_DONE for a
    // message handled while the failure drains the CQ) is dropped like the work fail() found queued.
    // Queued, it would be flushed after the teardown freed its buffers.
    if (this.failure) return this.dropQueued(p.op, [p], this.failure);
    if (p.internal) this.rdQ.push(p);
    else if (p.credit === 3) this.creditQ.push(p);
    else if (p.credit === 1 && !p.ordered) this.ctrlQ.push(p);
    else this.dataQ.push(p);
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      queueMicrotask(() => this.flush());
    }
  }

  /** Posts everything that has credits and send-queue room, as one work-request list. */
  private flush(): void {
    this.flushScheduled = false;
    if (this.failure && this.failure.code !== "CONNECTION_CLOSED") return;
    const batch: SendWr[] = [];
    let room = this.opts.sendDepth - this.sqOutstanding;
    const take = (q: Pending[], min: (p: Pending) => number): void => {
      while (q.length > 0 && room > 0) {
        const p = q[0]!;
        if (p.lease?.revoked && !p.op.posted) {
          this.dropRevoked(q, p.op);
          continue;
        }
        const need = min(p);
        if (!this.cr.canSend(need)) {
          if (q === this.dataQ) this.traffic.stall();
          break;
        }
        if (q === this.dataQ) this.traffic.stalled = false;
        q.shift();
        p.op.posted = true;
        p.onPost?.();
        this.cr.spend(need);
        if (p.hdr !== null) {
          // piggyback the receive buffers we re-posted since the last report
          const a = p.hdr.alloc;
          new DataView(a.buffer, a.bufOffset + 4, 4).setUint32(0, this.cr.report());
        }
        const id = this.slot(p.op);
        p.wr.wrId = id;
        this.sqFifo.push(id);
        batch.push(p.wr);
        room--;
      }
    };
    // CREDIT messages first, on their own queue: they may use the last credit, and must never
    // wait behind control or data messages that are themselves waiting for credits.
    take(this.creditQ, () => NEED.credit);
    take(this.rdQ, () => 0);
    take(this.ctrlQ, () => NEED.ctrl);
    take(this.dataQ, dataNeed);
    if (this.ctrlQ.length || this.dataQ.length) this.maybeSendCredits();
    if (batch.length === 0) return;
    // Signal the last WR of the list and every SIGNAL_EVERY-th: fewer completions to poll, and
    // the send queue still drains (an unsignaled WR's slot is freed by the next signaled one).
    for (let i = 0; i < batch.length; i++) {
      const wr = batch[i]!;
      if (++this.sinceSignal >= SIGNAL_EVERY || i === batch.length - 1) {
        wr.flags = (wr.flags ?? 0) | SendFlags.SIGNALED;
        this.sinceSignal = 0;
      } else wr.flags = (wr.flags ?? 0) & ~SendFlags.SIGNALED;
    }
    if (this.sqOutstanding === 0) this.live.startWaiting();
    this.sqOutstanding += batch.length;
    try {
      this.qp.postSend(batch);
    } catch (e) {
      this.fail(e instanceof RdmaError ? e : new RdmaError("DEVICE", `postSend failed: ${(e as Error).message}`, { cause: e }));
    }
    this.poller.afterPost(batch.length, this.sqOutstanding);
  }

  /** Drops a queued one-sided operation (all its parts, at the head of `q`) whose remote region was revoked meanwhile. */
  private dropRevoked(q: Pending[], op: Op): void {
    let n = 0;
    while (n < q.length && q[n]!.op === op) n++;
    this.dropQueued(op, q.splice(0, n), new RdmaError("REMOTE_ACCESS", "the owner revoked this shared region while the operation waited to be posted; nothing reached it"));
  }

  /** Sends a CREDIT message when the credit rule (credits.ts) says nothing queued will carry the credits soon. */
  private maybeSendCredits(): void {
    const d = this.dataQ;
    if (this.cr.shouldSendCredits({ credit: this.creditQ.length > 0, ctrl: this.ctrlQ.length > 0, data: d.length > 0, dataHeadNeed: d.length > 0 ? dataNeed(d[0]!) : 0 })) this.sendCredits();
  }

  /** CREDIT messages sent (stats: a quiet connection sends none). */
  private creditMessages = 0;

  private sendCredits(): void {
    this.creditMessages++;
    this.sendCtrl({ type: MsgType.CREDIT }, null, 3);
  }

  /**
   * The promise of an operation. The caller has checked that `signal` is not
   * aborted before creating anything. An abort while the operation still
   * waits in a queue (credits, send-queue room) removes it: it never reaches
   * the wire, and rejects with ABORTED. Once posted it cannot be recalled:
   * it is reported as it completes (done, or its error), never as aborted
   * while it may still land. The abort listener lives exactly as long as the
   * operation (`finish`).
   */
  private track<T>(op: Op, signal: AbortSignal | undefined): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      op.resolve = resolve as (v: unknown) => void;
      op.reject = reject;
      if (signal) {
        op.unwatch = this.aborts.add(signal, () => {
          if (op.posted) return; // settles with its completion
          const mine: Pending[] = [];
          for (const q of [this.creditQ, this.rdQ, this.ctrlQ, this.dataQ]) {
            for (let i = q.length - 1; i >= 0; i--) if (q[i]!.op === op) mine.push(...q.splice(i, 1));
          }
          this.dropQueued(op, mine, abortError(signal));
        });
      }
    });
  }

  /**
   * An operation ends (once): its memory is unpinned, its abort watch
   * removed, and its continuations handed to the caller to run.
   */
  private endOp(op: Op): { resolve: Op["resolve"]; reject: Op["reject"]; then: Op["then"] } {
    for (const m of op.mems) m.opDone();
    op.mems = [];
    this.finish(op);
    const r = { resolve: op.resolve, reject: op.reject, then: op.then };
    op.resolve = op.reject = op.then = null;
    return r;
  }

  /** The abort listener goes with the operation, however it ends. */
  private finish(op: Op): void {
    op.unwatch?.();
    op.unwatch = null;
  }

  private readonly aborts = new AbortWatch();

  /** An operation none of whose work requests was posted is dropped: its resources freed, its promise rejected. */
  private dropQueued(op: Op, parts: Pending[], err: unknown): void {
    for (const p of parts) if (p.hdr) this.putHdr(p.hdr);
    op.result?.release();
    op.result = null;
    const { reject, then } = this.endOp(op);
    then?.(false);
    reject?.(err);
  }

  private static checkSignal(signal: AbortSignal | undefined): void {
    if (signal?.aborted) throw abortError(signal);
  }

  // ----------------------------------------------------------- data ops

  /** Two-sided send of `lmr`'s bytes (eager or rendezvous), optionally with immediate data. */
  send(lmr: LocalMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    this.checkOpen("send");
    lmr.mem.check("send");
    Connection.checkSignal(signal);
    const len = lmr.length;
    if (this.peer.maxMessageSize !== undefined && len > this.peer.maxMessageSize) throw new RdmaError("OUT_OF_RANGE", `a ${len}-byte message exceeds the peer's maxMessageSize (${this.peer.maxMessageSize})`);
    if (len > 2 ** 32 - 1) throw new RdmaError("OUT_OF_RANGE", `a ${len}-byte message is longer than the protocol carries (2^32 - 1)`);
    this.traffic.messagesSent++;
    this.traffic.bytesSent += len;
    if (len <= this.peer.eagerMax) {
      const op = this.newOp("msg");
      const hdr = this.takeHdr();
      const a = hdr.alloc;
      encodeMsg(new Uint8Array(a.buffer, a.bufOffset, CTRL_BUF), { type: MsgType.DATA, flags: imm === undefined ? 0 : 1, credits: 0, imm: imm ?? 0, token: 0, a: len, b: 0, addr: 0, rkey: 0, id: 0 });
      op.hdr = hdr;
      lmr.mem.inflight++;
      op.mems.push(lmr.mem);
      const sgl = [{ addr: a.addr, length: HDR, lkey: a.mr.lkey }];
      if (len > 0) sgl.push(lmr.sge());
      const p = this.track<void>(op, signal);
      // Small messages go inline: the HCA takes the bytes from the WQE, no DMA read of the buffers.
      const flags = HDR + len <= this.opts.maxInline ? SendFlags.INLINE : 0;
      this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.SEND, flags, sgList: sgl }, op, credit: 2, hdr });
      return p;
    }
    return this.sendRendezvous(lmr, imm, signal);
  }

  /**
   * Rendezvous: lend exactly these bytes read-only; the peer READs them and
   * answers RNDV_DONE, after which the registration is revoked. An abort or
   * the rendezvous deadline before RNDV_DONE sends RNDV_CANCEL: the peer
   * drops the message unless it already delivered it, and its RNDV_DONE says
   * which (ABORTED/TIMEOUT, or done). The registration stays until that
   * answer: the peer may be reading. No answer within peerTimeoutMs fails the
   * connection, which revokes it.
   */
  private sendRendezvous(lmr: LocalMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    const len = lmr.length;
    this.traffic.rendezvousSent++;
    const token = this.nextToken;
    this.nextToken = (this.nextToken + 1) >>> 0 || 1;
    // Mid sizes are copied into this connection's bounce memory (registered once); larger
    // messages get a registration over exactly their bytes, revoked once the peer has them.
    const slot = this.bounce.take(len, this.peer.eagerMax);
    let mr: MemoryRegion;
    let addr: number;
    // Bounce: the bytes are copied into the slot only when the announcement is posted (the
    // peer knows the bounce memory's key from earlier messages: a message aborted while
    // queued must never have been there), and the slot is wiped unless the peer took them.
    let copied = false;
    const copyIn = (): void => {
      if (copied || slot < 0) return;
      copied = true;
      this.bounce.copyIn(slot, lmr.bytes);
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
        const r = this.rndvOut.get(token);
        if (r?.timer) clearTimeout(r.timer);
        this.rndvOut.delete(token);
        unwatch?.();
        if (slot >= 0) {
          if (!copied) lmr.mem.opDone();
          this.bounce.put(slot, copied && !delivered);
        } else {
          mr.deregister();
          lmr.mem.opDone();
        }
      };
      const entry: RndvOut = {
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
      this.rndvOut.set(token, entry);
      const op = this.newOp("msg");
      // While the announcement waits in the queue (for credits) an abort or the deadline removes
      // it: nothing reached the wire, the peer knows nothing to cancel. Once posted, they cancel
      // the rendezvous with the peer.
      const withdraw = (reason: RdmaError): void => {
        if (op.posted) return this.cancelRendezvous(token, reason);
        const mine: Pending[] = [];
        for (let i = this.dataQ.length - 1; i >= 0; i--) if (this.dataQ[i]!.op === op) mine.push(...this.dataQ.splice(i, 1));
        op.then = null;
        this.dropQueued(op, mine, null);
        this.rndvOut.get(token)?.reject(reason);
      };
      if (this.opts.rendezvousTimeoutMs > 0) {
        entry.timer = setTimeout(() => withdraw(new RdmaError("TIMEOUT", `send: the peer did not take the ${len}-byte message within ${this.opts.rendezvousTimeoutMs} ms (rendezvousTimeoutMs)`)), this.opts.rendezvousTimeoutMs);
        entry.timer.unref();
      }
      op.then = (ok) => {
        if (!ok) this.rndvOut.get(token)?.reject(this.failure ?? new RdmaError("CONNECTION_CLOSED", "send failed"));
      };
      const hdr = this.takeHdr();
      const a = hdr.alloc;
      const n = encodeMsg(new Uint8Array(a.buffer, a.bufOffset, CTRL_BUF), { type: MsgType.RNDV, flags: 0, credits: 0, imm: imm ?? 0, token, a: len, b: imm === undefined ? 0 : 1, addr, rkey: mr.rkey, id: 0 });
      op.hdr = hdr;
      if (signal) unwatch = this.aborts.add(signal, () => withdraw(abortError(signal)));
      this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: n, lkey: a.mr.lkey }] }, op, credit: 2, hdr, onPost: copyIn });
    });
  }

  /** Bounce memory for rendezvous messages of mid size (bounce.ts). */
  private readonly bounce: Bounce;

  private cancelRendezvous(token: number, reason: RdmaError): void {
    const r = this.rndvOut.get(token);
    if (!r || r.cancelReason) return;
    r.cancelReason = reason;
    if (r.timer) clearTimeout(r.timer);
    r.timer = null;
    if (this.down) return; // fail() settles it
    this.sendCtrl({ type: MsgType.RNDV_CANCEL, token });
    // The answer (RNDV_DONE) must come within the peer timeout; the liveness check enforces
    // that while the cancel is unanswered.
    this.live.awaitingAnswer = true;
  }

  /**
   * Posts a one-sided transfer as work requests of at most CHUNK_BYTES each
   * (one op, settled when the last completes; a WRITE_WITH_IMM carries its
   * immediate on the last one, which RC orders after the others).
   */
  private postTransfer(op: Op, opcode: (typeof WrOpcode)[keyof typeof WrOpcode], lmr: LocalMr, remoteAddr: number, rkey: number, imm: number | undefined, credit: number, internal = false, lease?: RemoteLease): void {
    const len = lmr.length;
    const n = Math.max(1, Math.ceil(len / CHUNK_BYTES));
    op.parts = n;
    const sge = len > 0 ? lmr.sge() : null;
    for (let i = 0; i < n; i++) {
      const off = i * CHUNK_BYTES;
      const last = i === n - 1;
      const part = Math.min(CHUNK_BYTES, len - off);
      const wr: SendWr = {
        wrId: 0,
        opcode: last || opcode !== WrOpcode.RDMA_WRITE_WITH_IMM ? opcode : WrOpcode.RDMA_WRITE,
        flags: SendFlags.SIGNALED,
        sgList: sge ? [{ addr: sge.addr + off, length: part, lkey: sge.lkey }] : [],
        remoteAddr: remoteAddr + off,
        rkey,
      };
      if (last && imm !== undefined) wr.imm = imm;
      this.enqueue({ wr, op, credit: last ? credit : 0, hdr: null, internal, lease });
    }
  }

  /** A RemoteMr granted or lent to another connection is refused here, before anything is posted. */
  private checkRemote(rmr: RemoteMr, what: string): void {
    if (rmr.lease.owner !== null && rmr.lease.owner !== this) {
      throw new RdmaError("INVALID_ARGUMENT", `${what}: this RemoteMr was granted, lent or shared to another connection; a region can only be used on the connection it came from`);
    }
    rmr.lease.check(what);
    // The rights the owner gave (its registration enforces them too): refused before posting.
    const need = what === "read" ? null : what === "write" || what === "writeWithImm" ? "write" : what === "fetchAndAdd" || what === "compareAndSwap" ? "atomic" : null;
    if ((need === "write" && rmr.access === "read") || (need === "atomic" && rmr.access !== "atomic")) {
      throw new RdmaError("REMOTE_ACCESS", `${what}: the owner gave ${rmr.access} access to this region (${rmr.access === "read" ? "read only" : "read and write, no atomics"})`);
    }
  }

  /** One-sided WRITE (optionally with immediate, which consumes a peer receive and so a credit). */
  write(lmr: LocalMr, rmr: RemoteMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    const what = imm === undefined ? "write" : "writeWithImm";
    this.checkOpen(what);
    lmr.mem.check(what);
    this.checkRemote(rmr, what);
    Connection.checkSignal(signal);
    if (lmr.length > rmr.length) throw new RdmaError("OUT_OF_RANGE", `write of ${lmr.length} bytes into a ${rmr.length}-byte remote region`);
    const op = this.newOp("write");
    lmr.mem.inflight++;
    op.mems.push(lmr.mem);
    const p = this.track<void>(op, signal);
    this.postTransfer(op, imm === undefined ? WrOpcode.RDMA_WRITE : WrOpcode.RDMA_WRITE_WITH_IMM, lmr, rmr.addr, rmr.rkey, imm, imm === undefined ? 0 : 2, false, rmr.lease);
    return p;
  }

  read(lmr: LocalMr, rmr: RemoteMr, signal?: AbortSignal): Promise<void> {
    this.checkOpen("read");
    lmr.mem.check("read");
    this.checkRemote(rmr, "read");
    Connection.checkSignal(signal);
    if (lmr.length > rmr.length) throw new RdmaError("OUT_OF_RANGE", `read of ${lmr.length} bytes from a ${rmr.length}-byte remote region`);
    const op = this.newOp("read");
    lmr.mem.inflight++;
    op.mems.push(lmr.mem);
    const p = this.track<void>(op, signal);
    this.postTransfer(op, WrOpcode.RDMA_READ, lmr, rmr.addr, rmr.rkey, undefined, 0, false, rmr.lease);
    return p;
  }

  atomic(rmr: RemoteMr, opcode: typeof WrOpcode.ATOMIC_CMP_AND_SWP | typeof WrOpcode.ATOMIC_FETCH_AND_ADD, compareAdd: bigint, swap: bigint, signal?: AbortSignal): Promise<bigint> {
    const what = opcode === WrOpcode.ATOMIC_CMP_AND_SWP ? "compareAndSwap" : "fetchAndAdd";
    this.checkOpen(what);
    this.checkRemote(rmr, what);
    Connection.checkSignal(signal);
    if (rmr.length < 8) throw new RdmaError("OUT_OF_RANGE", `${what} needs 8 bytes of remote memory, the region has ${rmr.length}`);
    // Checked here: on the wire a misaligned atomic is a fatal error for the whole connection.
    if (rmr.addr % 8 !== 0) throw new RdmaError("INVALID_ARGUMENT", `${what} needs an 8-byte aligned remote address (0x${rmr.addr.toString(16)})`);
    const op = this.newOp("atomic");
    const res = new LocalMemory(this.pool, this.pool.alloc(8));
    op.result = res;
    const p = this.track<bigint>(op, signal);
    const a = res.alloc;
    this.enqueue({ wr: { wrId: 0, opcode, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: 8, lkey: a.mr.lkey }], remoteAddr: rmr.addr, rkey: rmr.rkey, compareAdd, swap }, op, credit: 0, hdr: null, lease: rmr.lease });
    return p;
  }

  /** Next message in arrival order (eager and rendezvous alike). */
  receive(signal?: AbortSignal): Promise<Received> {
    return this.inbox.receive(signal);
  }

  receiveWriteImm(signal?: AbortSignal): Promise<number> {
    return this.inbox.receiveWriteImm(signal);
  }

  receiveLocalMr(signal?: AbortSignal): Promise<LocalMr> {
    return this.memory.claimHandedBack(signal);
  }

  receiveRemoteMr(signal?: AbortSignal): Promise<RemoteMr> {
    return this.memory.remoteMrs.take({ signal });
  }

  // ------------------------------------------------------ memory protocol (memory-protocol.ts)

  requestRemoteMr(size: number, leaseMs: number, timeoutMs: number | undefined, signal?: AbortSignal, access: RemoteAccess = "atomic", waitForQuota = false): Promise<RemoteMr> {
    if (!Number.isInteger(size) || size < 1 || size > 2 ** 32 - 1) throw new RdmaError("OUT_OF_RANGE", `requestRemoteMr: size ${size} is outside 1 .. 2^32 - 1`);
    return this.memory.request(size, leaseMs, timeoutMs, signal, this, access, waitForQuota);
  }

  /** Lends exactly `lmr`'s bytes to the peer with `access` until it gives them back or the lease ends. */
  sendLocalMr(lmr: LocalMr, leaseMs: number, signal?: AbortSignal, access: RemoteAccess = "atomic"): Promise<void> {
    return this.memory.lend(lmr, leaseMs, signal, access);
  }

  /** Opens the peer's shared region `name`. */
  openSharedMr(name: string, timeoutMs: number | undefined, signal?: AbortSignal): Promise<RemoteMr> {
    return this.memory.open(name, timeoutMs, signal, this);
  }

  /** Asks the owner to extend a granted or lent region's lease. */
  renew(rmr: RemoteMr, leaseMs: number, signal?: AbortSignal): Promise<void> {
    this.checkRemote(rmr, "renew");
    return this.memory.renew(rmr, leaseMs, signal);
  }

  /** Gives a remote region back to its owner, who receives it with receiveLocalMr. */
  sendRemoteMr(rmr: RemoteMr, signal?: AbortSignal): Promise<void> {
    this.checkOpen("sendRemoteMr");
    this.checkRemote(rmr, "sendRemoteMr");
    return this.memory.giveBack(rmr, signal);
  }

  // ------------------------------------------------------------ completions

  private pollNow(): void {
    this.poller.pollNow();
  }

  private afterDrain(): void {
    this.postRecvBatch();
    if (this.failure && !this.closed && this.sqOutstanding === 0 && this.recvSlots.size === 0) this.teardown();
  }

  private onCompletion(b: CompletionBuffer, i: number): void {
    const id = b.wrId[i]!;
    const status = b.status[i]!;
    const op = this.slots[id];
    if (!op) return;
    this.slots[id] = null;
    this.freeSlots.push(id);
    this.live.progressed();
    if (op.kind === "recv") {
      const mem = this.recvSlots.get(id)!;
      this.recvSlots.delete(id);
      if (status !== WcStatus.SUCCESS) {
        mem.release();
        if (status !== WcStatus.WR_FLUSH_ERR) this.failFromStatus(status, "receive");
        else this.fail(this.failure ?? new RdmaError("CONNECTION_CLOSED", "the connection was closed by the peer"));
        return;
      }
      this.cr.consumed();
      this.onReceive(mem, b.opcode[i]!, b.byteLen[i]!, b.imm[i]!);
      return;
    }
    // Selective signaling: the send queue completes in order, so a completion for this WR
    // means every WR posted before it (unsignaled, silent on success) has completed too.
    while (this.sqFifoHead < this.sqFifo.length) {
      const sid = this.sqFifo[this.sqFifoHead++]!;
      if (sid === id) break;
      const prev = this.slots[sid];
      if (!prev) continue;
      this.slots[sid] = null;
      this.freeSlots.push(sid);
      this.settleSend(prev, WcStatus.SUCCESS);
    }
    if (this.sqFifoHead > 1024 && this.sqFifoHead * 2 > this.sqFifo.length) {
      this.sqFifo = this.sqFifo.slice(this.sqFifoHead);
      this.sqFifoHead = 0;
    }
    this.settleSend(op, status);
    if (this.creditQ.length || this.rdQ.length || this.ctrlQ.length || this.dataQ.length) this.flush();
  }

  private settleSend(op: Op, status: number): void {
    this.sqOutstanding--;
    if (op.parts > 1 && status === WcStatus.SUCCESS) {
      // A part of a chunked transfer: the operation settles with its last work request.
      op.parts--;
      return;
    }
    op.parts = 0;
    if (op.hdr) this.putHdr(op.hdr);
    op.hdr = null;
    // A failed part settles the operation once; the parts after it complete flushed, silently.
    const { resolve, reject, then } = this.endOp(op);
    if (status === WcStatus.SUCCESS) {
      let v: unknown;
      if (op.result) {
        const a = op.result.alloc;
        v = new DataView(a.buffer, a.bufOffset, 8).getBigUint64(0, true);
        op.result.release();
        op.result = null;
      }
      if (then) then(true);
      resolve?.(v);
    } else {
      op.result?.release();
      op.result = null;
      const err = this.failFromStatus(status, op.kind);
      if (then) then(false);
      reject?.(err);
    }
  }

  private failFromStatus(status: number, what: string): RdmaError {
    if (status === WcStatus.WR_FLUSH_ERR && this.failure) {
      return new RdmaError(this.failure.code === "CONNECTION_CLOSED" ? "CONNECTION_CLOSED" : "FLUSHED", `${what} flushed: ${this.failure.message}`, { wcStatus: "WR_FLUSH_ERR", cause: this.failure });
    }
    const code = codeOfStatus(status);
    const err = new RdmaError(code, `${what} failed with ${wcStatusName(status)}${ADVICE[code] ? `: ${ADVICE[code]}` : ""}`, { wcStatus: wcStatusName(status) });
    this.fail(err);
    return err;
  }

  private onReceive(mem: LocalMemory, opcode: number, byteLen: number, imm: number): void {
    this.live.arrived();
    this.poller.touch();
    if (this.peerClosed) {
      mem.release();
      return;
    }
    if (opcode === WcOpcode.RECV_RDMA_WITH_IMM) {
      this.putRecv(mem);
      // An unread immediate holds a credit like an unread message.
      this.inbox.pushImm(imm);
      return;
    }
    const a = mem.alloc;
    const m = this.msg;
    const err = decodeMsg(new Uint8Array(a.buffer, a.bufOffset, a.length), byteLen, m);
    if (err !== null) {
      mem.release();
      this.protocolError(err);
      return;
    }
    const breach = this.cr.returned(m.credits);
    if (breach !== null) {
      mem.release();
      this.protocolError(breach);
      return;
    }
    if (m.credits > 0 && (this.creditQ.length || this.rdQ.length || this.ctrlQ.length || this.dataQ.length)) this.flush();
    switch (m.type) {
      case MsgType.DATA: {
        if (byteLen - HDR !== m.a) {
          mem.release();
          return this.protocolError(`DATA message claims ${m.a} bytes but carries ${byteLen - HDR}`);
        }
        const lmr = new LocalMr(mem, HDR, m.a);
        this.traffic.messagesReceived++;
        this.traffic.bytesReceived += m.a;
        // The buffer now belongs to the user; a new one is posted unless too much is held unread.
        this.inbox.pushMessage(lmr, m.flags & 1 ? m.imm : undefined);
        return;
      }
      case MsgType.RNDV:
        this.putRecv(mem);
        if (m.a > this.opts.maxMessageSize) {
          return this.protocolError(`rendezvous message of ${m.a} bytes exceeds this side's maxMessageSize (${this.opts.maxMessageSize})`);
        }
        if (m.a === 0) return this.protocolError("rendezvous message of 0 bytes");
        return this.onRendezvous(m);
      default:
        this.putRecv(mem);
        if (m.type === MsgType.CREDIT) this.cr.echoed();
        this.repostRecv();
        return this.onControl(m);
    }
  }

  /**
   * An announced rendezvous message: READ it into memory of our own once the
   * process-wide peer memory budget allows (memory/budget.ts), in arrival
   * order; an unread one holds a credit like an eager message.
   */
  private onRendezvous(m: Msg): void {
    // `m` is the reused decode buffer: copy what the continuation needs.
    const entry: Incoming = { ready: false, mr: null, imm: m.b === 1 ? m.imm : undefined, rndv: { token: m.token, len: m.a, addr: m.addr, rkey: m.rkey, done: false, cancelled: false, started: false } };
    this.inbox.pushRendezvous(entry);
    this.rndvWaiting.push(entry);
    this.startRendezvousReads();
  }

  private startRendezvousReads(): void {
    while (this.rndvWaiting.length > 0 && !this.down) {
      const entry = this.rndvWaiting[0]!;
      const r = entry.rndv!;
      if (!peerMemory.take(r.len)) {
        // Wait for memory to come back (any connection of the process).
        this.unsubscribeBudget ??= peerMemory.onFree(() => this.startRendezvousReads());
        return;
      }
      this.rndvWaiting.shift();
      let dst: LocalMemory;
      try {
        dst = new LocalMemory(this.pool, this.pool.alloc(r.len), () => peerMemory.give(r.len));
      } catch (e) {
        peerMemory.give(r.len);
        return this.protocolError(`cannot allocate ${r.len} bytes for a rendezvous message: ${(e as Error).message}`);
      }
      r.started = true;
      const op = this.newOp("read");
      op.then = (ok) => {
        if (!ok) return dst.release();
        r.done = true;
        if (r.cancelled) {
          // The sender gave up before we delivered: drop it and say so.
          dst.release();
          this.inbox.drop(entry);
          this.sendCtrl({ type: MsgType.RNDV_DONE, token: r.token, a: RndvStatus.CANCELLED });
          return;
        }
        this.sendCtrl({ type: MsgType.RNDV_DONE, token: r.token, a: RndvStatus.DELIVERED });
        this.traffic.messagesReceived++;
        this.traffic.bytesReceived += r.len;
        this.traffic.rendezvousReceived++;
        this.inbox.ready(entry, new LocalMr(dst, 0, r.len));
      };
      this.postTransfer(op, WrOpcode.RDMA_READ, new LocalMr(dst, 0, r.len), r.addr, r.rkey, undefined, 0, true);
    }
    if (this.rndvWaiting.length === 0 && this.unsubscribeBudget) {
      this.unsubscribeBudget();
      this.unsubscribeBudget = null;
    }
  }

  private onRendezvousCancel(token: number): void {
    const entry = this.inbox.findRendezvous(token);
    if (!entry) return; // already delivered (RNDV_DONE sent), or unknown: the sender settles on our RNDV_DONE
    const r = entry.rndv!;
    r.cancelled = true;
    if (r.started) return; // the READ's completion answers
    const w = this.rndvWaiting.indexOf(entry);
    if (w >= 0) this.rndvWaiting.splice(w, 1);
    r.done = true;
    this.inbox.drop(entry);
    this.sendCtrl({ type: MsgType.RNDV_DONE, token, a: RndvStatus.CANCELLED });
  }

  private onControl(m: Msg): void {
    switch (m.type) {
      case MsgType.CREDIT:
        return;
      case MsgType.PING:
        return this.sendCtrl({ type: MsgType.PONG, token: m.token });
      case MsgType.PONG:
        return;
      case MsgType.RNDV_DONE: {
        const r = this.rndvOut.get(m.token);
        if (!r) return this.protocolError(`RNDV_DONE for unknown rendezvous ${m.token}`);
        if (m.a === RndvStatus.CANCELLED) {
          if (!r.cancelReason) return this.protocolError(`RNDV_DONE cancels rendezvous ${m.token}, which was not cancelled`);
          r.reject(r.cancelReason);
        } else r.resolve();
        return;
      }
      case MsgType.RNDV_CANCEL:
        return this.onRendezvousCancel(m.token);
      case MsgType.CLOSE:
        return this.onPeerClose();
      default:
        if (this.memory.onMessage(m, this)) return;
        return this.protocolError(`unexpected control message ${m.type}`);
    }
  }

  // ------------------------------------------------------------- lifecycle

  private onQpEvent(e: AsyncEvent): void {
    this.fail(new RdmaError("CONNECTION_CLOSED", `connection failed: ${e.reason}`));
  }

  protocolError(reason: string): void {
    const err = new RdmaError("PROTOCOL", `malformed control message from the peer: ${reason}; connection closed`);
    this.fail(err);
  }

  /** The peer sent CLOSE: it sends nothing after it, and anything that comes anyway is not delivered. */
  private peerClosed = false;
  /** The connection ended by a close of either side (CLOSE sent or received before any failure), not by a failure. */
  endedCleanly = false;

  private onPeerClose(): void {
    this.peerClosed = true;
    if (!this.failure) this.endedCleanly = true;
    this.fail(new RdmaError("CONNECTION_CLOSED", "the peer closed the connection"));
  }

  /** Fails the connection: every pending operation and wait rejects with the cause. */
  fail(err: RdmaError): void {
    if (this.failure) return;
    this.failure = err;
    this.memory.fail(err);
    for (const r of [...this.rndvOut.values()]) r.reject(err);
    // Messages that arrived whole before the end stay receivable (as a TCP
    // socket keeps the data before the FIN), unless this side closed.
    this.inbox.fail(err, this.closing);
    // Work that never reached the send queue: freed now, its operations rejected (once each).
    const queued = [...this.creditQ.splice(0), ...this.rdQ.splice(0), ...this.ctrlQ.splice(0), ...this.dataQ.splice(0)];
    const ops = new Map<Op, Pending[]>();
    for (const p of queued) {
      const l = ops.get(p.op);
      if (l) l.push(p);
      else ops.set(p.op, [p]);
    }
    for (const [op, parts] of ops) {
      if (op.posted) {
        // Some parts were posted: they settle the op with their (flushed) completions.
        for (const p of parts) if (p.hdr) this.putHdr(p.hdr);
        op.parts -= parts.length;
        if (op.parts <= 0) this.dropQueued(op, [], err);
      } else this.dropQueued(op, parts, err);
    }
    this.rndvWaiting.length = 0;
    if (this.unsubscribeBudget) {
      this.unsubscribeBudget();
      this.unsubscribeBudget = null;
    }
    if (this.qp.state !== QpState.ERR) {
      try {
        this.qp.setError();
      } catch {
        /* already gone */
      }
    }
    // Flushed completions settle the posted operations; then tear down.
    this.pollNow();
    this.teardownWhenDrained();
  }

  private drainDeadline: NodeJS.Timeout | null = null;

  /** Tears down once the flush completions have settled every posted WR (deadline 2 s). */
  private teardownWhenDrained(): void {
    if (this.closed) return;
    if (this.sqOutstanding === 0 && this.recvSlots.size === 0) return this.teardown();
    this.poller.armForFlush();
    if (this.drainDeadline === null) {
      this.drainDeadline = setTimeout(() => this.teardown(), 2000);
      this.drainDeadline.unref();
    }
  }

  private teardown(): void {
    if (this.closed) return;
    this.closed = true;
    this.releaseAll();
    this.poller.stop();
    this.qp.onEvent = null;
    this.onClosed();
    for (const r of this.closedWaiters.splice(0)) r();
  }

  /**
   * Frees everything this connection holds, whatever the peer sent: grants
   * and lends (revoked first), regions handed back and never picked up,
   * messages received and never read, receive and control buffers, and any
   * operation whose completion never came.
   */
  private releaseAll(): void {
    this.live.stop();
    if (this.drainDeadline) clearTimeout(this.drainDeadline);
    this.memory.teardown();
    for (const r of this.rndvOut.values()) if (r.timer) clearTimeout(r.timer);
    // Any op still pending (a completion that never came) is settled now.
    for (let i = 0; i < this.slots.length; i++) {
      const op = this.slots[i];
      if (!op) continue;
      this.slots[i] = null;
      if (op.kind === "recv") continue;
      op.hdr?.release();
      op.hdr = null;
      op.result?.release();
      op.result = null;
      const { reject, then } = this.endOp(op);
      then?.(false);
      reject?.(this.failure);
    }
    for (const m of this.recvSlots.values()) m.release();
    this.recvSlots.clear();
    for (const h of this.hdrFree.splice(0)) h.release();
    for (const r of this.recvFree.splice(0)) r.release();
    this.bounce.release();
    // Messages not read yet stay receivable (unless this side closed): the pool moves them out
    // of registered memory when it closes, keeping their peer-memory charge until read or dropped.
    this.inbox.teardown();
  }

  /**
   * A connection whose setup failed before start(): frees its receive and
   * control buffers and marks it closed. The caller destroys the QP and CQ.
   */
  abandon(reason: RdmaError): void {
    if (this.closed) return;
    if (!this.failure) this.failure = reason;
    this.inbox.abandon();
    this.closed = true;
    this.memory.fail(reason);
    this.releaseAll();
    this.poller.stop();
    this.qp.onEvent = null;
  }

  private readonly closedWaiters: (() => void)[] = [];

  /**
   * Graceful close: tells the peer (its pending receives reject with
   * CONNECTION_CLOSED), waits for that message to leave, then tears down.
   * `flush`: the peer receives everything sent before; otherwise resolves
   * with what ended the connection first, or null when `timeoutMs` ran out
   * (the rest was dropped).
   */
  async close(timeoutMs: number, flush = false): Promise<true | RdmaError | null> {
    // Closing this side drops what the peer sent and nobody read.
    if (this.failure) this.inbox.dropUnread(this.closed);
    if (this.closing || this.failure) {
      if (this.failure && !this.closed) await this.waitClosed(timeoutMs);
      // Already ended: what did not reach the peer was reported on its own operation.
      return true;
    }
    this.closing = true;
    let timer: NodeJS.Timeout | null = null;
    const expired = new Promise<false>((r) => (timer = setTimeout(() => r(false), timeoutMs)));
    // Flushing (lifecycle.ts): every rendezvous send is taken by the peer first, and the CLOSE
    // goes in the data lane behind every queued send and write, so its completion means the
    // peer has received all of them.
    let flushed = !flush || this.rndvOut.size === 0 || (await Promise.race([this.rendezvousSettled(), expired]));
    const op = this.newOp("msg");
    const sent = this.track<void>(op, undefined);
    this.sendCtrl({ type: MsgType.CLOSE }, op, 1, flush);
    flushed = (await Promise.race([sent.then(() => true, () => false), expired])) && flushed;
    if (timer) clearTimeout(timer);
    // What ended a flush that did not finish: a failure (or the peer's close) meanwhile, else the timeout (null).
    const cause = this.failure;
    if (!this.failure) this.endedCleanly = true;
    this.fail(new RdmaError("CONNECTION_CLOSED", "the connection was closed by this side"));
    await this.waitClosed(timeoutMs);
    return flushed || !flush ? true : cause;
  }

  /** Resolves once every rendezvous send started so far is settled (taken by the peer, cancelled or failed). */
  private rendezvousSettled(): Promise<true> {
    return Promise.all(
      [...this.rndvOut.values()].map(
        (r) =>
          new Promise<void>((done) => {
            const { resolve, reject } = r;
            r.resolve = () => (resolve(), done());
            r.reject = (e) => (reject(e), done());
          }),
      ),
    ).then(() => true);
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

  /** Whether the connection keeps the process alive (Rdma.ref/unref; poller.ts). */
  setKeepAlive(on: boolean): void {
    this.poller.setKeepAlive(on);
  }

  get isClosed(): boolean {
    return this.closed;
  }

  /** Work requests posted and not completed, plus those queued to be posted (stats). */
  get workInFlight(): number {
    return this.sqOutstanding + this.creditQ.length + this.rdQ.length + this.ctrlQ.length + this.dataQ.length;
  }

  stats(): { credits: number; sqOutstanding: number; grants: number; quotaUsed: number; lends: number; unclaimedLocal: number; unclaimedRemote: number; unread: number; rendezvousOut: number; sharesOpenedByPeer: number; sharesOpened: number; recycledReceives: number; creditMessages: number } {
    return { credits: this.cr.credits, sqOutstanding: this.sqOutstanding, ...this.memory.stats(), unread: this.inbox.held(), rendezvousOut: this.rndvOut.size, recycledReceives: this.recycledRecvs, creditMessages: this.creditMessages };
  }
}
