/**
 * The agent: one connection's engine over one RC QP. It posts work requests
 * in per-tick batches (one postSend per flush), drains completions, runs the
 * control protocol (credits, memory requests, grants and leases, lending,
 * rendezvous, close) and turns work completions into promise settlements.
 *
 * What this file owns: the public operations (their argument checks), what
 * a two-sided message becomes (eager DATA, control messages in recycled
 * headers), completion dispatch (selective signalling: a signalled
 * completion settles every unsignalled request before it), and the
 * connection's face to its parts (the hosts they see). The parts, each
 * owning one invariant behind a narrow host interface (none imports this
 * file): parts.ts (building them and wiring each to its host), lifecycle.ts
 * (fail → drain → teardown, close, abandon; QP and CQ destroyed before the
 * buffers posted to them), arrivals.ts (each receive decoded and handed to
 * its one owner), ops.ts (integer wrIds; every operation settles once),
 * send-lanes.ts (what is posted in which order, batching, selective
 * signalling), credits.ts (flow control: the peer never sees a SEND without
 * a receive posted, and credits can always flow back), recv-ring.ts (receive
 * buffers and their recycling), inbox.ts (arrival order, back-pressure, what
 * stays receivable after the end), rendezvous.ts (large messages both ways),
 * bounce.ts, one-sided.ts (WRITE, READ, atomics), liveness.ts (a dead or
 * stopped peer is noticed within keepalive + peer timeout),
 * memory-protocol.ts (grants, lends, shares, quotas and leases), poller.ts
 * (completion polling).
 */
import { RdmaError } from "../errors.js";
import {
  CompletionBuffer,
  SendFlags,
  WcStatus,
  WrOpcode,
  type AsyncEvent,
  type CompletionQueue,
  type QueuePair,
  type SendWr,
} from "../transport/types.js";
import type { LocalMr, RemoteMr } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import { abortError } from "./queue.js";
import { HDR, MsgType, bytesOf, encodeData, encodeMsg, toWire } from "./codec.js";
import type { Credits } from "./credits.js";
import type { Inbox, Received } from "./inbox.js";
import { newOp, type Op, type OpTable, type SendListener } from "./ops.js";
import { CTRL_BUF, type HeaderPool, type Pending, type SendLanes } from "./send-lanes.js";
import type { RecvRing } from "./recv-ring.js";
import type { Rendezvous } from "./rendezvous.js";
import type { OneSided } from "./one-sided.js";
import type { Liveness } from "./liveness.js";
import type { Lifecycle } from "./lifecycle.js";
import type { Arrivals } from "./arrivals.js";
import type { CtrlMsg, MemoryProtocol, PeerLimits } from "./memory-protocol.js";
import { makeParts, type PartsHost } from "./parts.js";
import type { Share } from "./shares.js";
import type { RemoteAccess } from "../memory/mr.js";
import type { Poller } from "./poller.js";
import { Traffic } from "./stats.js";
import { statusError } from "./status.js";
import type { ConnectionOptions, PeerParams } from "./options.js";

import type { PollingMode } from "./poller.js";
export type { PollingMode };

export type { ConnectionOptions, PeerParams } from "./options.js";

/** Largest plain buffer send() copies behind the message's header (Connection.sendCopy): no staging memory. */
export const SMALL_SEND_COPY = CTRL_BUF - HDR;

/** @internal */
export class Connection implements PartsHost {
  readonly qp: QueuePair;
  readonly cq: CompletionQueue;
  readonly pool: MrPool;
  readonly opts: ConnectionOptions;
  readonly peer: PeerParams;

  /** Operations by integer wrId (ops.ts). */
  private readonly ops: OpTable;
  /** Send credits both ways (credits.ts). */
  private readonly cr: Credits;
  /** What waits to be posted, and posting (send-lanes.ts). */
  private readonly lanes: SendLanes;
  private readonly headers: HeaderPool;
  /** Receive buffers posted for the peer (recv-ring.ts). */
  private readonly recvs: RecvRing;
  private readonly poller: Poller;
  /** What arrived and was not read: arrival order, back-pressure, kept after the end (inbox.ts). */
  private readonly inbox: Inbox;
  /** Large messages both ways (rendezvous.ts). */
  private readonly rndv: Rendezvous;
  /** WRITE, READ and the atomics (one-sided.ts). */
  private readonly oneSided: OneSided;
  readonly memory: MemoryProtocol;
  private readonly live: Liveness;
  /** Messages and bytes each way, rendezvous, credit stalls (stats.ts). */
  readonly traffic = new Traffic();

  /** Failure, close, teardown and abandon (lifecycle.ts). */
  private readonly life: Lifecycle;
  /** What arrives, handed to the part that owns it (arrivals.ts). */
  private readonly arrivals: Arrivals;

  constructor(qp: QueuePair, cq: CompletionQueue, pool: MrPool, opts: ConnectionOptions, peer: PeerParams, onClosed: () => void) {
    this.qp = qp;
    this.cq = cq;
    this.pool = pool;
    this.opts = opts;
    this.peer = peer;
    const p = makeParts(this, qp, cq, pool, opts, peer, this.traffic, onClosed);
    this.ops = p.ops;
    this.cr = p.cr;
    this.lanes = p.lanes;
    this.headers = p.headers;
    this.recvs = p.recvs;
    this.poller = p.poller;
    this.inbox = p.inbox;
    this.rndv = p.rndv;
    this.oneSided = p.oneSided;
    this.memory = p.memory;
    this.live = p.live;
    this.life = p.life;
    this.arrivals = p.arrivals;
    qp.onEvent = (e: AsyncEvent) => this.life.onQpEvent(e);
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
    return this.life.down;
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
    this.recvs.postInitial();
  }

  /** Starts completion processing (after connect). */
  start(): void {
    this.poller.start();
    this.memory.sendLimits(this.opts.maxMessageSize);
    this.live.start();
  }

  // ---------------------------------------------------------------- posting

  /** Throws when the connection is closing or failed (lifecycle.ts). */
  checkOpen(what: string): void {
    this.life.checkOpen(what);
  }

  /** Encodes a control message into a recycled small buffer and queues its SEND. */
  sendCtrl(m: CtrlMsg, op: Op | null = null, credit = 1, ordered = false): void {
    const mem = this.headers.take();
    const a = mem.alloc;
    const len = encodeMsg(bytesOf(a.buffer), toWire(m), a.bufOffset);
    const o = op ?? newOp("msg");
    o.hdr = mem;
    this.lanes.enqueueSend(o, mem, len, SendFlags.SIGNALED, credit, ordered);
  }

  /** MemoryHost: a control message posted after every operation queued before it. */
  sendCtrlOrdered(m: CtrlMsg): void {
    this.sendCtrl(m, null, 1, true);
  }

  /** MemoryHost: a control message whose promise settles when its SEND completes. */
  postCtrl(m: CtrlMsg, signal?: AbortSignal): Promise<void> {
    const op = newOp("msg");
    const p = this.ops.track<void>(op, signal);
    this.sendCtrl(m, op);
    return p;
  }

  /** LanesHost: a wrId for a work request being posted. */
  slot(op: Op): number {
    return this.ops.slot(op);
  }

  /** LanesHost: posts one work-request list. */
  post(batch: SendWr[], wasIdle: boolean): void {
    try {
      this.qp.postSend(batch);
    } catch (e) {
      this.fail(e instanceof RdmaError ? e : new RdmaError("DEVICE", `postSend failed: ${(e as Error).message}`, { cause: e }));
    }
    // One clock read for both (the wait starts once the list is posted: never before).
    const now = performance.now();
    if (wasIdle) this.live.startWaiting(now);
    this.poller.afterPost(batch.length, this.lanes.outstanding, now);
  }

  /** CREDIT messages sent (stats: a quiet connection sends none). */
  private creditMessages = 0;

  /** LanesHost: queues a CREDIT message. */
  sendCredits(): void {
    this.creditMessages++;
    this.sendCtrl({ type: MsgType.CREDIT }, null, 3);
  }

  /** LanesHost: an operation none of whose work requests was posted is dropped: its resources freed, its promise rejected. */
  dropQueued(op: Op, parts: Pending[], err: unknown): void {
    for (const p of parts) if (p.hdr) this.headers.put(p.hdr);
    op.result?.release();
    op.result = null;
    const { reject, then, listener } = this.ops.end(op);
    then?.(false);
    reject?.(err);
    listener?.sent(err);
  }

  private static checkSignal(signal: AbortSignal | undefined): void {
    if (signal?.aborted) throw abortError(signal);
  }

  // ----------------------------------------------------------- data ops

  /** Two-sided send of `lmr`'s bytes (eager or rendezvous), optionally with immediate data. */
  send(lmr: LocalMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    return this.sendAs(lmr, imm, signal, null)!;
  }

  /**
   * send() without a promise: `listener` is told how it ended (a layer
   * above's own messages, the RPC outbox's batches). Throws as send() does
   * for what is refused before anything is queued.
   */
  sendListened(lmr: LocalMr, listener: SendListener): void {
    this.sendAs(lmr, undefined, undefined, listener);
  }

  /** send(), settled by its promise (`listener` null: returned) or told to `listener` (nothing returned). */
  private sendAs(lmr: LocalMr, imm: number | undefined, signal: AbortSignal | undefined, listener: SendListener | null): Promise<void> | undefined {
    this.checkOpen("send");
    lmr.mem.check("send");
    Connection.checkSignal(signal);
    const len = lmr.length;
    const peerMax = this.peerMaxMessage();
    if (peerMax !== undefined && len > peerMax) throw new RdmaError("OUT_OF_RANGE", `a ${len}-byte message exceeds the peer's maxMessageSize (${peerMax})`);
    if (len > 2 ** 32 - 1) throw new RdmaError("OUT_OF_RANGE", `a ${len}-byte message is longer than the protocol carries (2^32 - 1)`);
    if (len <= this.peer.eagerMax) {
      // Without a signal nothing but its slot and its record refers to the operation: reused.
      const op = signal === undefined ? this.ops.reusableOp() : newOp("msg");
      const hdr = this.headers.take();
      const a = hdr.alloc;
      encodeData(bytesOf(a.buffer), len, imm, a.bufOffset);
      op.hdr = hdr;
      lmr.mem.inflight++;
      op.mem = lmr.mem;
      let p: Promise<void> | undefined;
      if (listener === null) p = this.ops.track<void>(op, signal);
      else op.listener = listener;
      const m = lmr.mem.alloc;
      // Small messages go inline: the HCA takes the bytes from the WQE, no DMA read of the buffers.
      this.lanes.enqueueSend(op, hdr, HDR, HDR + len <= this.opts.maxInline ? SendFlags.INLINE : 0, 2, false, m.addr + lmr.start, len, m.mr.lkey);
      this.countSent(len);
      return p;
    }
    const p = this.rndv.send(lmr, imm, this.peer.eagerMax, signal);
    this.countSent(len);
    this.traffic.rendezvousSent++;
    if (listener === null) return p;
    p.then(
      () => listener.sent(null),
      (e: unknown) => listener.sent(e),
    );
    return undefined;
  }

  /**
   * Two-sided send of a small plain buffer (at most SMALL_SEND_COPY bytes,
   * and at most the peer's eager size: the caller checks): its bytes are
   * copied behind the header, into one of the recycled header buffers, so
   * the message costs no staging allocation, registration or detach.
   */
  sendCopy(data: ArrayBufferView, imm: number | undefined, signal: AbortSignal | undefined, what: string): Promise<void> {
    this.checkOpen(what);
    Connection.checkSignal(signal);
    const len = data.byteLength;
    const peerMax = this.peerMaxMessage();
    if (peerMax !== undefined && len > peerMax) throw new RdmaError("OUT_OF_RANGE", `a ${len}-byte message exceeds the peer's maxMessageSize (${peerMax})`);
    const op = signal === undefined ? this.ops.reusableOp() : newOp("msg");
    const hdr = this.headers.take();
    const a = hdr.alloc;
    const buf = bytesOf(a.buffer);
    encodeData(buf, len, imm, a.bufOffset);
    if (len > 0) buf.set(new Uint8Array(data.buffer, data.byteOffset, len), a.bufOffset + HDR);
    op.hdr = hdr;
    const p = this.ops.track<void>(op, signal);
    this.lanes.enqueueSend(op, hdr, HDR + len, HDR + len <= this.opts.maxInline ? SendFlags.INLINE : 0, 2, false);
    this.countSent(len);
    return p;
  }

  /**
   * The largest message the peer accepts: from the side channel's handshake,
   * else from its LIMITS message (RDMA CM's private data does not carry it;
   * LIMITS arrives before the connection is handed out).
   */
  private peerMaxMessage(): number | undefined {
    return this.peer.maxMessageSize ?? this.memory.peerLimits?.maxMessageSize;
  }

  /** A message accepted for sending (counted once nothing before it can throw). */
  private countSent(len: number): void {
    this.traffic.messagesSent++;
    this.traffic.bytesSent += len;
  }

  /** One-sided WRITE (optionally with immediate, which consumes a peer receive and so a credit). */
  write(lmr: LocalMr, rmr: RemoteMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    return this.oneSided.write(lmr, rmr, imm, signal);
  }

  read(lmr: LocalMr, rmr: RemoteMr, signal?: AbortSignal): Promise<void> {
    return this.oneSided.read(lmr, rmr, signal);
  }

  atomic(rmr: RemoteMr, opcode: typeof WrOpcode.ATOMIC_CMP_AND_SWP | typeof WrOpcode.ATOMIC_FETCH_AND_ADD, compareAdd: bigint, swap: bigint, signal?: AbortSignal): Promise<bigint> {
    return this.oneSided.atomic(rmr, opcode, compareAdd, swap, signal);
  }

  /** Next message in arrival order (eager and rendezvous alike). */
  receive(signal?: AbortSignal): Promise<Received> {
    return this.inbox.receive(signal);
  }

  /** receive() without the immediate: settled with the message's memory. */
  receiveMr(signal?: AbortSignal): Promise<LocalMr> {
    return this.inbox.receiveMr(signal);
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
    this.oneSided.checkRemote(rmr, "renew");
    return this.memory.renew(rmr, leaseMs, signal);
  }

  /** Gives a remote region back to its owner, who receives it with receiveLocalMr. */
  sendRemoteMr(rmr: RemoteMr, signal?: AbortSignal): Promise<void> {
    this.checkOpen("sendRemoteMr");
    this.oneSided.checkRemote(rmr, "sendRemoteMr");
    return this.memory.giveBack(rmr, signal);
  }

  // ------------------------------------------------------------ completions

  /** PartsHost: the completion queue was drained. */
  afterDrain(): void {
    this.recvs.postBatch();
    this.life.drained();
  }

  /** PartsHost: one work completion. */
  onCompletion(b: CompletionBuffer, i: number): void {
    const id = b.wrId[i]!;
    const status = b.status[i]!;
    const op = this.ops.take(id);
    if (!op) return;
    this.live.progressed(this.poller.drainTime);
    if (op.kind === "recv") {
      const mem = this.recvs.take(id);
      if (status !== WcStatus.SUCCESS) {
        mem.release();
        if (status !== WcStatus.WR_FLUSH_ERR) this.failFromStatus(status, "receive");
        else this.fail(this.life.failure ?? new RdmaError("CONNECTION_CLOSED", "the connection was closed by the peer"));
        return;
      }
      this.arrivals.onReceive(mem, b.opcode[i]!, b.byteLen[i]!, b.imm[i]!);
      return;
    }
    // Selective signaling: the send queue completes in order, so a completion for this WR
    // means every WR posted before it (unsignaled, silent on success) has completed too.
    for (let sid = this.lanes.unsignaledBefore(id); sid >= 0; sid = this.lanes.unsignaledBefore(id)) {
      const prev = this.ops.take(sid);
      if (prev) this.settleSend(prev, WcStatus.SUCCESS);
    }
    this.settleSend(op, status);
    if (this.lanes.waiting) this.lanes.flush();
  }

  private settleSend(op: Op, status: number): void {
    this.lanes.outstanding--;
    if (op.parts > 1 && status === WcStatus.SUCCESS) {
      // A part of a chunked transfer: the operation settles with its last work request.
      op.parts--;
      return;
    }
    op.parts = 0;
    if (op.hdr) this.headers.put(op.hdr);
    op.hdr = null;
    // A failed part settles the operation once; the parts after it complete flushed, silently.
    const { resolve, reject, then, listener } = this.ops.end(op);
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
      listener?.sent(null);
    } else {
      op.result?.release();
      op.result = null;
      const err = this.failFromStatus(status, op.kind);
      if (then) then(false);
      reject?.(err);
      listener?.sent(err);
    }
    if (op.reusable) this.ops.reuse(op);
  }

  private failFromStatus(status: number, what: string): RdmaError {
    if (status === WcStatus.WR_FLUSH_ERR && this.life.failure) {
      return new RdmaError(this.life.failure.code === "CONNECTION_CLOSED" ? "CONNECTION_CLOSED" : "FLUSHED", `${what} flushed: ${this.life.failure.message}`, { wcStatus: "WR_FLUSH_ERR", cause: this.life.failure });
    }
    const err = statusError(status, what);
    this.fail(err);
    return err;
  }

  // ------------------------------------------------------------- lifecycle (lifecycle.ts)

  /** Why the connection ended, or null while it is up. */
  get failure(): RdmaError | null {
    return this.life.failure;
  }

  /** This side's close began: new operations are refused. */
  get closing(): boolean {
    return this.life.closing;
  }

  /** The connection ended by a close of either side (CLOSE sent or received before any failure), not by a failure. */
  get endedCleanly(): boolean {
    return this.life.endedCleanly;
  }

  /** Why this side's flushing close did not flush (the connection did not end cleanly); null otherwise. */
  get closeFailure(): RdmaError | null {
    return this.life.closeFailure;
  }

  protocolError(reason: string): void {
    this.life.protocolError(reason);
  }

  /** Fails the connection: every pending operation and wait rejects with the cause (idempotent). */
  fail(err: RdmaError): void {
    this.life.fail(err);
  }

  /**
   * The peer ended the connection out of band (RDMA CM DISCONNECTED), which
   * can overtake completions still in the CQ: what completed before (its
   * last messages, its CLOSE) is taken first, as if the end had come in
   * band, then the connection fails with `err` (nothing more when the
   * CLOSE was among them).
   */
  failAfterDrain(err: RdmaError): void {
    if (this.failure === null) this.poller.pollNow();
    this.life.fail(err);
  }

  /** A connection whose setup failed before start(): destroys its QP and CQ and frees what it posted. */
  abandon(reason: RdmaError): void {
    this.life.abandon(reason);
  }

  /** Graceful close (`flush`: the peer receives everything sent before); resolves null, or why it did not do what was asked. */
  close(timeoutMs: number, flush = false): Promise<RdmaError | null> {
    return this.life.close(timeoutMs, flush);
  }

  /** Whether the connection keeps the process alive (Rdma.ref/unref; poller.ts). */
  setKeepAlive(on: boolean): void {
    this.poller.setKeepAlive(on);
  }

  get isClosed(): boolean {
    return this.life.closed;
  }

  /** Work requests posted and not completed, plus those queued to be posted (stats). */
  get workInFlight(): number {
    return this.lanes.outstanding + this.lanes.queued;
  }

  stats(): { credits: number; sqOutstanding: number; grants: number; quotaUsed: number; lends: number; unclaimedLocal: number; unclaimedRemote: number; unread: number; rendezvousOut: number; sharesOpenedByPeer: number; sharesOpened: number; recycledReceives: number; creditMessages: number; receiveRing: number } {
    return { credits: this.cr.credits, sqOutstanding: this.lanes.outstanding, ...this.memory.stats(), unread: this.inbox.held(), rendezvousOut: this.rndv.outstanding, recycledReceives: this.recvs.recycled, creditMessages: this.creditMessages, receiveRing: this.cr.ourRing };
  }
}
