/**
 * The agent: one connection's engine over one RC QP. It posts work requests
 * in per-tick batches (one postSend per flush), drains completions, runs the
 * control protocol (credits, memory requests, grants and leases, lending,
 * rendezvous, close) and turns work completions into promise settlements.
 *
 * Flow control: the peer posts `recvDepth` receive buffers and tells us; each
 * SEND (and WRITE_WITH_IMM) consumes one credit; credits come back in every
 * message header, or in a CREDIT message when enough have piled up. The last
 * credit is kept for CREDIT messages and a few more for control messages, so
 * neither data nor control can deadlock the other, and the peer never sees
 * a SEND without a receive posted (no RNR storms).
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
import { LocalMemory, LocalMr, RemoteLease, RemoteMr } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import { AsyncQueue, abortError } from "./queue.js";
import { DenyReason, HDR, MsgType, decodeMsg, encodeMsg, msgLength, newMsg, type Msg } from "./codec.js";

export type PollingMode = "event" | "busy" | "adaptive";

export interface ConnectionOptions {
  /** Receive buffers posted for the peer's messages. */
  recvDepth: number;
  /** Largest message sent eagerly (copied into a posted receive); larger ones use rendezvous READ. */
  eagerMax: number;
  sendDepth: number;
  /** Bytes of this side's memory the peer may hold through requestRemoteMr at once. */
  quotaBytes: number;
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
   * Idle time after which a zero-length RDMA WRITE probes the peer (0: never).
   * A dead peer then fails the connection (RETRY_EXCEEDED) and every pending
   * wait rejects, even when this side was only waiting to receive: verbs
   * itself notices a dead peer only when it sends.
   */
  keepaliveMs: number;
}

export interface PeerParams {
  recvDepth: number;
  eagerMax: number;
  /** When the handshake told us; otherwise the sender does not check and the peer refuses. */
  maxMessageSize?: number;
}

const CREDIT_RESERVE = 1;
const CTRL_RESERVE = 3;
const CTRL_BUF = 64;
/** Completions handled per event-loop turn before yielding ("512 ops" as zeromq.js does). */
const POLL_BUDGET = 512;
/** At least one signaled WR per this many, so the send queue drains under selective signaling. */
const SIGNAL_EVERY = 32;
/** Synchronous CQ polls after posting, per event-loop turn, in busy and adaptive modes. */
const SYNC_POLLS = 64;

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
  signal: AbortSignal | null;
  onAbort: (() => void) | null;
}

interface Pending {
  wr: SendWr;
  op: Op;
  /** 0: no credit (one-sided), 1: control, 2: data message, 3: credit message */
  credit: number;
  /** control buffer whose header gets the piggybacked credit count */
  hdr: LocalMemory | null;
}

interface Grant {
  mem: LocalMemory;
  mr: MemoryRegion;
  timer: NodeJS.Timeout | null;
  length: number;
}

interface Lend {
  mem: LocalMemory;
  mr: MemoryRegion;
  timer: NodeJS.Timeout | null;
  start: number;
  length: number;
}

interface Incoming {
  ready: boolean;
  mr: LocalMr | null;
  imm: number | undefined;
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

export class Connection {
  readonly qp: QueuePair;
  readonly cq: CompletionQueue;
  readonly pool: MrPool;
  readonly opts: ConnectionOptions;
  readonly peer: PeerParams;

  // slots: integer wr_ids index this table (no closures below the API)
  private slots: (Op | null)[] = [];
  private freeSlots: number[] = [];
  private recvSlots = new Map<number, LocalMemory>();

  private credits: number;
  private toReturn = 0;
  private sqOutstanding = 0;
  /** Slot ids of posted send WRs, in post order (completions arrive in this order). */
  private sqFifo: number[] = [];
  private sqFifoHead = 0;
  private sinceSignal = 0;
  private ctrlQ: Pending[] = [];
  private creditQ: Pending[] = [];
  private dataQ: Pending[] = [];
  private flushScheduled = false;
  private readonly cbuf = new CompletionBuffer(128);
  private polling = false;
  private lastActivity = 0;
  private pollScheduled = false;
  /** Synchronous polls right after a post in this event-loop turn (busy/adaptive). */
  private syncPolls = 0;

  private readonly incoming: Incoming[] = [];
  private readonly recvWaiters: { resolve: (v: { mr: LocalMr; imm: number | undefined }) => void; reject: (e: unknown) => void; cleanup: () => void }[] = [];
  private readonly writeImms = new AsyncQueue<number>("receiveWriteImm");
  private readonly localMrs = new AsyncQueue<LocalMr>("receiveLocalMr");
  private readonly remoteMrs = new AsyncQueue<RemoteMr>("receiveRemoteMr");
  private heldRecvs = 0;

  private nextToken = 1;
  private readonly requests = new Map<number, { resolve: (r: RemoteMr) => void; reject: (e: unknown) => void; sentAt: number; leaseMs: number }>();
  private readonly grants = new Map<number, Grant>();
  private quotaUsed = 0;
  private readonly lends = new Map<number, Lend>();
  private readonly rndvOut = new Map<number, { mem: LocalMemory; mr: MemoryRegion; resolve: () => void; reject: (e: unknown) => void }>();

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
    this.credits = peer.recvDepth;
    this.onClosed = onClosed;
    qp.onEvent = (e: AsyncEvent) => this.onQpEvent(e);
    cq.onNotify = () => this.pollNow();
  }

  /** Sets the peer's parameters once the handshake told us them (before any send). */
  setPeer(p: PeerParams): void {
    this.peer.recvDepth = p.recvDepth;
    this.peer.eagerMax = p.eagerMax;
    if (p.maxMessageSize !== undefined) this.peer.maxMessageSize = p.maxMessageSize;
    this.credits = p.recvDepth;
  }

  /** Posts the receive buffers; call before the QP connects so the peer never meets an empty queue. */
  postInitialReceives(): void {
    const wrs = [];
    for (let i = 0; i < this.opts.recvDepth; i++) wrs.push(this.newRecv());
    this.qp.postRecv(wrs);
  }

  /** Starts completion processing (after connect). */
  start(): void {
    if (this.opts.polling !== "busy") this.cq.requestNotify();
    this.pollNow();
    if (this.opts.keepaliveMs > 0) {
      this.keepalive = setInterval(() => this.probe(), this.opts.keepaliveMs);
      this.keepalive.unref();
    }
  }

  private keepalive: NodeJS.Timeout | null = null;

  private probe(): void {
    if (this.failure || this.closing) return;
    if (performance.now() - this.lastActivity < this.opts.keepaliveMs || this.sqOutstanding > 0) return;
    // A zero-length WRITE needs no rkey (IBA C9-88) and no receive at the peer: only its ACK.
    this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.RDMA_WRITE, flags: 0, sgList: [], remoteAddr: 0, rkey: 0 }, op: this.newOp("write"), credit: 0, hdr: null });
  }

  // ------------------------------------------------------------------ slots

  private newOp(kind: OpKind): Op {
    return { kind, resolve: null, reject: null, mems: [], hdr: null, result: null, then: null, signal: null, onAbort: null };
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

  private newRecv() {
    const mem = new LocalMemory(this.pool, this.pool.alloc(HDR + this.opts.eagerMax));
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
    if (!this.polling) this.postRecvBatch();
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
    this.toReturn += batch.length;
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

  /** Encodes a control message into a fresh small buffer and queues its SEND. */
  private sendCtrl(m: Partial<Msg> & { type: number }, op: Op | null = null, credit = 1): void {
    const mem = this.takeHdr();
    const full: Msg = { flags: 0, credits: 0, imm: 0, token: 0, a: 0, b: 0, addr: 0, rkey: 0, ...m };
    const a = mem.alloc;
    const len = encodeMsg(new Uint8Array(a.buffer, a.bufOffset, CTRL_BUF), full);
    const o = op ?? this.newOp("msg");
    o.hdr = mem;
    this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: len, lkey: a.mr.lkey }] }, op: o, credit, hdr: mem });
  }

  private enqueue(p: Pending): void {
    if (p.credit === 3) this.creditQ.push(p);
    else if (p.credit === 1) this.ctrlQ.push(p);
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
        const need = min(p);
        if (need > 0 && this.credits < need) break;
        q.shift();
        if (need > 0) this.credits--;
        if (p.hdr !== null) {
          // piggyback the receive buffers we re-posted since the last report
          const a = p.hdr.alloc;
          new DataView(a.buffer, a.bufOffset + 4, 4).setUint32(0, this.toReturn);
          this.toReturn = 0;
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
    take(this.creditQ, () => CREDIT_RESERVE);
    take(this.ctrlQ, () => CREDIT_RESERVE + 1);
    take(this.dataQ, (p) => (p.credit === 2 ? CREDIT_RESERVE + CTRL_RESERVE + 1 : 0));
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
    this.sqOutstanding += batch.length;
    this.lastActivity = performance.now();
    try {
      this.qp.postSend(batch);
    } catch (e) {
      this.fail(e instanceof RdmaError ? e : new RdmaError("DEVICE", `postSend failed: ${(e as Error).message}`, { cause: e }));
    }
    // Busy and adaptive modes look for the completions at once (a loopback or software device
    // often completes inside the post; on an HCA a small message completes within
    // microseconds), then keep polling from the next turns. At most SYNC_POLLS of these
    // synchronous looks per event-loop turn: a chain of operations whose completions are
    // always ready must not starve timers and I/O.
    if (this.opts.polling !== "event") {
      // Only when nothing else was outstanding (a request/response step): with a window in
      // flight the poll loop is already running and an extra poll per post only costs.
      if (this.sqOutstanding === batch.length && this.syncPolls < SYNC_POLLS) {
        this.syncPolls++;
        this.pollNow();
      }
      this.schedulePoll();
    }
  }

  /**
   * Returns credits explicitly when nothing queued will carry them soon: when
   * the queues are empty (after a quarter of the depth piled up), or when
   * every queued message is itself waiting for credits (then as soon as two
   * are owed; a CREDIT message costs the peer one buffer, so this cannot
   * ping-pong). Without the second case both sides can wait on each other.
   */
  private maybeSendCredits(): void {
    if (this.creditQ.length > 0 || this.toReturn < 2) return;
    const idle = this.ctrlQ.length === 0 && this.dataQ.length === 0;
    if (idle) {
      if (this.toReturn >= Math.max(2, this.opts.recvDepth >> 2)) this.sendCtrl({ type: MsgType.CREDIT }, null, 3);
      return;
    }
    const ctrlBlocked = this.ctrlQ.length === 0 || this.credits < CREDIT_RESERVE + 1;
    const dataBlocked = this.dataQ.length === 0 || (this.dataQ[0]!.credit === 2 && this.credits < CREDIT_RESERVE + CTRL_RESERVE + 1);
    if (ctrlBlocked && dataBlocked) this.sendCtrl({ type: MsgType.CREDIT }, null, 3);
  }

  private track<T>(op: Op, signal: AbortSignal | undefined): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      op.resolve = resolve as (v: unknown) => void;
      op.reject = reject;
      if (signal) {
        if (signal.aborted) throw abortError(signal);
        op.signal = signal;
        op.onAbort = () => {
          // The work request stays posted (it cannot be recalled); its memory stays pinned until it completes.
          const r = op.reject;
          op.resolve = op.reject = null;
          r?.(abortError(signal));
        };
        signal.addEventListener("abort", op.onAbort, { once: true });
      }
    });
  }

  // ----------------------------------------------------------- data ops

  /** Two-sided send of `lmr`'s bytes (eager or rendezvous), optionally with immediate data. */
  send(lmr: LocalMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    this.checkOpen("send");
    lmr.mem.check("send");
    const len = lmr.length;
    if (this.peer.maxMessageSize !== undefined && len > this.peer.maxMessageSize) throw new RdmaError("OUT_OF_RANGE", `a ${len}-byte message exceeds the peer's maxMessageSize (${this.peer.maxMessageSize})`);
    if (len <= this.peer.eagerMax) {
      const op = this.newOp("msg");
      const hdr = this.takeHdr();
      const a = hdr.alloc;
      encodeMsg(new Uint8Array(a.buffer, a.bufOffset, CTRL_BUF), { type: MsgType.DATA, flags: imm === undefined ? 0 : 1, credits: 0, imm: imm ?? 0, token: 0, a: len, b: 0, addr: 0, rkey: 0 });
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
    // Rendezvous: lend exactly these bytes read-only; the peer READs them and answers RNDV_DONE.
    const token = this.nextToken++;
    const mr = this.pool.grant(lmr.mem.alloc, lmr.start, len, Access.REMOTE_READ);
    lmr.mem.inflight++;
    return new Promise<void>((resolve, reject) => {
      const settle = (): void => {
        this.rndvOut.delete(token);
        mr.deregister();
        lmr.mem.opDone();
      };
      this.rndvOut.set(token, {
        mem: lmr.mem,
        mr,
        resolve: () => {
          settle();
          resolve();
        },
        reject: (e) => {
          settle();
          reject(e);
        },
      });
      if (signal) {
        if (signal.aborted) return this.rndvOut.get(token)!.reject(abortError(signal));
        signal.addEventListener("abort", () => this.rndvOut.get(token)?.reject(abortError(signal)), { once: true });
      }
      const op = this.newOp("msg");
      op.then = (ok) => {
        if (!ok) this.rndvOut.get(token)?.reject(this.failure ?? new RdmaError("CONNECTION_CLOSED", "send failed"));
      };
      const hdr = this.takeHdr();
      const a = hdr.alloc;
      const n = encodeMsg(new Uint8Array(a.buffer, a.bufOffset, CTRL_BUF), { type: MsgType.RNDV, flags: 0, credits: 0, imm: imm ?? 0, token, a: len, b: imm === undefined ? 0 : 1, addr: mr.addr, rkey: mr.rkey });
      op.hdr = hdr;
      this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: n, lkey: a.mr.lkey }] }, op, credit: 2, hdr });
    });
  }

  /** One-sided WRITE (optionally with immediate, which consumes a peer receive and so a credit). */
  write(lmr: LocalMr, rmr: RemoteMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    this.checkOpen(imm === undefined ? "write" : "writeWithImm");
    lmr.mem.check("write");
    rmr.lease.check("write");
    if (lmr.length > rmr.length) throw new RdmaError("OUT_OF_RANGE", `write of ${lmr.length} bytes into a ${rmr.length}-byte remote region`);
    const op = this.newOp("write");
    lmr.mem.inflight++;
    op.mems.push(lmr.mem);
    const p = this.track<void>(op, signal);
    const wr: SendWr = {
      wrId: 0,
      opcode: imm === undefined ? WrOpcode.RDMA_WRITE : WrOpcode.RDMA_WRITE_WITH_IMM,
      flags: SendFlags.SIGNALED,
      sgList: lmr.length > 0 ? [lmr.sge()] : [],
      remoteAddr: rmr.addr,
      rkey: rmr.rkey,
    };
    if (imm !== undefined) wr.imm = imm;
    this.enqueue({ wr, op, credit: imm === undefined ? 0 : 2, hdr: null });
    return p;
  }

  read(lmr: LocalMr, rmr: RemoteMr, signal?: AbortSignal): Promise<void> {
    this.checkOpen("read");
    lmr.mem.check("read");
    rmr.lease.check("read");
    if (lmr.length > rmr.length) throw new RdmaError("OUT_OF_RANGE", `read of ${lmr.length} bytes from a ${rmr.length}-byte remote region`);
    const op = this.newOp("read");
    lmr.mem.inflight++;
    op.mems.push(lmr.mem);
    const p = this.track<void>(op, signal);
    this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: lmr.length > 0 ? [lmr.sge()] : [], remoteAddr: rmr.addr, rkey: rmr.rkey }, op, credit: 0, hdr: null });
    return p;
  }

  atomic(rmr: RemoteMr, opcode: typeof WrOpcode.ATOMIC_CMP_AND_SWP | typeof WrOpcode.ATOMIC_FETCH_AND_ADD, compareAdd: bigint, swap: bigint, signal?: AbortSignal): Promise<bigint> {
    const what = opcode === WrOpcode.ATOMIC_CMP_AND_SWP ? "compareAndSwap" : "fetchAndAdd";
    this.checkOpen(what);
    rmr.lease.check(what);
    if (rmr.length < 8) throw new RdmaError("OUT_OF_RANGE", `${what} needs 8 bytes of remote memory, the region has ${rmr.length}`);
    // Checked here: on the wire a misaligned atomic is a fatal error for the whole connection.
    if (rmr.addr % 8 !== 0) throw new RdmaError("INVALID_ARGUMENT", `${what} needs an 8-byte aligned remote address (0x${rmr.addr.toString(16)})`);
    const op = this.newOp("atomic");
    const res = new LocalMemory(this.pool, this.pool.alloc(8));
    op.result = res;
    const p = this.track<bigint>(op, signal);
    const a = res.alloc;
    this.enqueue({ wr: { wrId: 0, opcode, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: 8, lkey: a.mr.lkey }], remoteAddr: rmr.addr, rkey: rmr.rkey, compareAdd, swap }, op, credit: 0, hdr: null });
    return p;
  }

  /** Next message in arrival order (eager and rendezvous alike). */
  receive(signal?: AbortSignal): Promise<{ mr: LocalMr; imm: number | undefined }> {
    const head = this.incoming[0];
    if (head?.ready && this.recvWaiters.length === 0) return Promise.resolve(this.takeHead());
    if (this.failure) return Promise.reject(this.failure);
    if (signal?.aborted) return Promise.reject(abortError(signal));
    return new Promise((resolve, reject) => {
      const onAbort = (): void => {
        const i = this.recvWaiters.indexOf(w);
        if (i >= 0) this.recvWaiters.splice(i, 1);
        reject(abortError(signal!));
      };
      const w = { resolve, reject, cleanup: () => signal?.removeEventListener("abort", onAbort) };
      signal?.addEventListener("abort", onAbort, { once: true });
      this.recvWaiters.push(w);
    });
  }

  private takeHead(): { mr: LocalMr; imm: number | undefined } {
    const head = this.incoming.shift()!;
    this.heldRecvs--;
    if (this.heldRecvs < this.maxHeld() && this.pendingReposts > 0) {
      this.pendingReposts--;
      this.repostRecv();
    }
    return { mr: head.mr!, imm: head.imm };
  }

  /** Hands ready messages at the head to waiting receivers, in order. */
  private deliver(): void {
    while (this.recvWaiters.length > 0 && this.incoming[0]?.ready) {
      const w = this.recvWaiters.shift()!;
      w.cleanup();
      w.resolve(this.takeHead());
    }
  }

  private pendingReposts = 0;

  private maxHeld(): number {
    return Math.max(1, this.opts.recvDepth >> 1);
  }

  receiveWriteImm(signal?: AbortSignal): Promise<number> {
    return this.writeImms.take({ signal });
  }

  receiveLocalMr(signal?: AbortSignal): Promise<LocalMr> {
    return this.localMrs.take({ signal });
  }

  receiveRemoteMr(signal?: AbortSignal): Promise<RemoteMr> {
    return this.remoteMrs.take({ signal });
  }

  // ------------------------------------------------------ memory protocol

  requestRemoteMr(size: number, leaseMs: number, timeoutMs: number | undefined, signal?: AbortSignal): Promise<RemoteMr> {
    this.checkOpen("requestRemoteMr");
    const token = this.nextToken++;
    return new Promise<RemoteMr>((resolve, reject) => {
      let timer: NodeJS.Timeout | null = null;
      const cleanup = (): void => {
        this.requests.delete(token);
        if (timer) clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
      };
      const onAbort = (): void => {
        cleanup();
        reject(abortError(signal!));
      };
      if (signal?.aborted) return reject(abortError(signal));
      signal?.addEventListener("abort", onAbort, { once: true });
      if (timeoutMs !== undefined) {
        timer = setTimeout(() => {
          cleanup();
          reject(new RdmaError("TIMEOUT", `requestRemoteMr(${size}): the peer did not answer within ${timeoutMs} ms`));
        }, timeoutMs);
      }
      this.requests.set(token, {
        resolve: (r) => {
          cleanup();
          resolve(r);
        },
        reject: (e) => {
          cleanup();
          reject(e);
        },
        sentAt: performance.now(),
        leaseMs,
      });
      this.sendCtrl({ type: MsgType.MR_REQUEST, token, a: size, b: leaseMs });
    });
  }

  /** Lends exactly `lmr`'s bytes to the peer (read, write, atomics) until it gives them back or the lease ends. */
  sendLocalMr(lmr: LocalMr, leaseMs: number, signal?: AbortSignal): Promise<void> {
    this.checkOpen("sendLocalMr");
    lmr.mem.check("sendLocalMr");
    const token = this.nextToken++;
    const mr = this.pool.grant(lmr.mem.alloc, lmr.start, lmr.length, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC);
    lmr.mem.lentTo = "sendLocalMr";
    const lend: Lend = { mem: lmr.mem, mr, timer: null, start: lmr.start, length: lmr.length };
    lend.timer = setTimeout(() => this.endLend(token, false), leaseMs);
    lend.timer.unref();
    this.lends.set(token, lend);
    const op = this.newOp("msg");
    const p = this.track<void>(op, signal);
    this.sendCtrl({ type: MsgType.MR_LEND, token, a: lmr.length, b: leaseMs, addr: mr.addr, rkey: mr.rkey }, op);
    return p;
  }

  /** Gives a remote region back to its owner, who receives it with receiveLocalMr. */
  sendRemoteMr(rmr: RemoteMr, signal?: AbortSignal): Promise<void> {
    this.checkOpen("sendRemoteMr");
    rmr.lease.check("sendRemoteMr");
    // Ownership moves with the message: this side may not use the region any more.
    rmr.lease.released = true;
    const op = this.newOp("msg");
    const p = this.track<void>(op, signal);
    this.sendCtrl({ type: MsgType.MR_GIVE_BACK, token: rmr.lease.token, a: rmr.origin === "lent" ? 1 : 0 }, op);
    return p;
  }

  private releaseRemote(token: number, origin: "granted" | "lent"): void {
    if (this.failure || this.closing) return;
    this.sendCtrl({ type: origin === "lent" ? MsgType.MR_RETURN : MsgType.MR_RELEASE, token });
  }

  private endGrant(token: number): Grant | null {
    const g = this.grants.get(token);
    if (!g) return null;
    this.grants.delete(token);
    if (g.timer) clearTimeout(g.timer);
    // Revoke first: from here on any access with the rkey fails with a remote access error.
    g.mr.deregister();
    this.quotaUsed -= g.length;
    return g;
  }

  private endLend(token: number, toQueue: boolean): void {
    const l = this.lends.get(token);
    if (!l) return;
    this.lends.delete(token);
    if (l.timer) clearTimeout(l.timer);
    l.mr.deregister();
    l.mem.lentTo = null;
    if (toQueue) this.localMrs.push(new LocalMr(l.mem, l.start, l.length));
  }

  // ------------------------------------------------------------ completions

  private pollNow(): void {
    if (this.polling || this.closed) return;
    this.polling = true;
    try {
      this.drainCq();
    } finally {
      this.polling = false;
    }
    this.postRecvBatch();
    if (this.failure && !this.closed && this.sqOutstanding === 0 && this.recvSlots.size === 0) this.teardown();
  }

  private drainCq(): void {
    let budget = POLL_BUDGET;
    let n: number;
    while (budget > 0 && (n = this.cq.poll(this.cbuf, Math.min(this.cbuf.capacity, budget))) > 0) {
      budget -= n;
      for (let i = 0; i < n; i++) this.onCompletion(i);
    }
    if (budget === 0) return this.schedulePoll();
    if (this.opts.polling === "busy") {
      // Busy: the CQ is never armed while the connection is open, so no completion ever
      // takes the event path (on verbs: channel read, ack and re-arm, three syscalls).
      return this.schedulePoll();
    }
    if (this.opts.polling === "adaptive") {
      // Keep polling, unarmed, for a short bounded time after any activity (a post, a send
      // completion or an arrival): the next completion often follows closely, and in a
      // request/response exchange the answer arrives while nothing is outstanding here.
      // Then fall back to completion events.
      const now = performance.now();
      if (budget < POLL_BUDGET) this.lastActivity = now;
      if (now - this.lastActivity < this.opts.spinUs / 1000) return this.schedulePoll();
    }
    // Arm, then poll once more: a completion between the last poll and the arm raises no event.
    this.cq.requestNotify();
    while ((n = this.cq.poll(this.cbuf)) > 0) for (let i = 0; i < n; i++) this.onCompletion(i);
  }

  private schedulePoll(): void {
    if (this.pollScheduled || this.closed) return;
    this.pollScheduled = true;
    setImmediate(() => {
      this.pollScheduled = false;
      this.syncPolls = 0;
      this.pollNow();
    });
  }

  private onCompletion(i: number): void {
    const b = this.cbuf;
    const id = b.wrId[i]!;
    const status = b.status[i]!;
    const op = this.slots[id];
    if (!op) return;
    this.slots[id] = null;
    this.freeSlots.push(id);
    if (op.kind === "recv") {
      const mem = this.recvSlots.get(id)!;
      this.recvSlots.delete(id);
      if (status !== WcStatus.SUCCESS) {
        mem.release();
        if (status !== WcStatus.WR_FLUSH_ERR) this.failFromStatus(status, "receive");
        else this.fail(this.failure ?? new RdmaError("CONNECTION_CLOSED", "the connection was closed by the peer"));
        return;
      }
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
    if (this.creditQ.length || this.ctrlQ.length || this.dataQ.length) this.flush();
  }

  private settleSend(op: Op, status: number): void {
    this.sqOutstanding--;
    if (op.hdr) this.putHdr(op.hdr);
    for (const m of op.mems) m.opDone();
    if (op.signal && op.onAbort) op.signal.removeEventListener("abort", op.onAbort);
    if (status === WcStatus.SUCCESS) {
      let v: unknown;
      if (op.result) {
        const a = op.result.alloc;
        v = new DataView(a.buffer, a.bufOffset, 8).getBigUint64(0, true);
        op.result.release();
      }
      if (op.then) op.then(true);
      op.resolve?.(v);
    } else {
      op.result?.release();
      const err = this.failFromStatus(status, op.kind);
      if (op.then) op.then(false);
      op.reject?.(err);
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
    this.lastActivity = performance.now();
    if (opcode === WcOpcode.RECV_RDMA_WITH_IMM) {
      mem.release();
      this.repostRecv();
      this.writeImms.push(imm);
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
    if (m.credits > this.peer.recvDepth) {
      mem.release();
      this.protocolError(`peer returned ${m.credits} credits, more than its ${this.peer.recvDepth} receive buffers`);
      return;
    }
    this.credits += m.credits;
    if (m.credits > 0 && (this.creditQ.length || this.ctrlQ.length || this.dataQ.length)) this.flush();
    switch (m.type) {
      case MsgType.DATA: {
        if (byteLen - HDR !== m.a) {
          mem.release();
          return this.protocolError(`DATA message claims ${m.a} bytes but carries ${byteLen - HDR}`);
        }
        const lmr = new LocalMr(mem, HDR, m.a);
        this.incoming.push({ ready: true, mr: lmr, imm: m.flags & 1 ? m.imm : undefined });
        this.heldRecvs++;
        // The buffer now belongs to the user; post a new one unless too many are held unread.
        if (this.heldRecvs <= this.maxHeld()) this.repostRecv();
        else this.pendingReposts++;
        this.deliver();
        return;
      }
      case MsgType.RNDV:
        mem.release();
        if (m.a > this.opts.maxMessageSize) {
          return this.protocolError(`rendezvous message of ${m.a} bytes exceeds this side's maxMessageSize (${this.opts.maxMessageSize})`);
        }
        // An unread rendezvous message holds memory like an unread eager one: same throttle.
        if (this.heldRecvs < this.maxHeld()) this.repostRecv();
        else this.pendingReposts++;
        return this.onRendezvous(m);
      default:
        mem.release();
        this.repostRecv();
        return this.onControl(m);
    }
  }

  private onRendezvous(m: Msg): void {
    // `m` is the reused decode buffer: copy what the continuation needs.
    const { token, a: len, addr, rkey } = m;
    const entry: Incoming = { ready: false, mr: null, imm: m.b === 1 ? m.imm : undefined };
    this.incoming.push(entry);
    this.heldRecvs++;
    let dst: LocalMemory;
    try {
      dst = new LocalMemory(this.pool, this.pool.alloc(len));
    } catch (e) {
      return this.protocolError(`cannot allocate ${len} bytes for a rendezvous message: ${(e as Error).message}`);
    }
    const op = this.newOp("read");
    op.then = (ok) => {
      if (!ok) return dst.release();
      entry.ready = true;
      entry.mr = new LocalMr(dst, 0, len);
      this.sendCtrl({ type: MsgType.RNDV_DONE, token });
      this.deliver();
    };
    const a = dst.alloc;
    this.enqueue({ wr: { wrId: 0, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: len, lkey: a.mr.lkey }], remoteAddr: addr, rkey }, op, credit: 0, hdr: null });
  }

  private onControl(m: Msg): void {
    switch (m.type) {
      case MsgType.CREDIT:
        return;
      case MsgType.RNDV_DONE: {
        const r = this.rndvOut.get(m.token);
        if (!r) return this.protocolError(`RNDV_DONE for unknown rendezvous ${m.token}`);
        r.resolve();
        return;
      }
      case MsgType.MR_REQUEST:
        return this.onMrRequest(m.token, m.a, m.b);
      case MsgType.MR_GRANT: {
        const r = this.requests.get(m.token);
        if (!r) {
          // The request timed out or was aborted: give the memory straight back.
          this.sendCtrl({ type: MsgType.MR_RELEASE, token: m.token });
          return;
        }
        const lease = new RemoteLease(m.token, r.sentAt + Math.min(m.b, r.leaseMs), (t) => this.releaseRemote(t, "granted"));
        r.resolve(new RemoteMr(m.addr, m.a, m.rkey, lease, "granted"));
        return;
      }
      case MsgType.MR_DENY: {
        const r = this.requests.get(m.token);
        if (!r) return;
        const code: RdmaErrorCode = m.a === DenyReason.QUOTA ? "QUOTA_EXCEEDED" : "RESOURCE_EXHAUSTED";
        r.reject(new RdmaError(code, m.a === DenyReason.QUOTA ? "requestRemoteMr: the peer's quota for this connection is used up; release remote regions first" : "requestRemoteMr: the peer could not allocate the memory"));
        return;
      }
      case MsgType.MR_RELEASE: {
        const g = this.endGrant(m.token);
        g?.mem.release();
        return;
      }
      case MsgType.MR_LEND: {
        const lease = new RemoteLease(m.token, performance.now() + m.b, (t) => this.releaseRemote(t, "lent"));
        this.remoteMrs.push(new RemoteMr(m.addr, m.a, m.rkey, lease, "lent"));
        return;
      }
      case MsgType.MR_RETURN:
        return this.endLend(m.token, false);
      case MsgType.MR_GIVE_BACK: {
        if (m.a === 1) return this.endLend(m.token, true);
        const g = this.endGrant(m.token);
        if (g) this.localMrs.push(new LocalMr(g.mem, 0, g.length));
        return;
      }
      case MsgType.CLOSE:
        return this.onPeerClose();
      default:
        return this.protocolError(`unexpected control message ${m.type}`);
    }
  }

  private onMrRequest(token: number, size: number, leaseMs: number): void {
    if (size === 0 || size > this.pool.pd.device.attr.maxMrSize) return this.sendCtrl({ type: MsgType.MR_DENY, token, a: DenyReason.TOO_LARGE });
    if (this.quotaUsed + size > this.opts.quotaBytes) return this.sendCtrl({ type: MsgType.MR_DENY, token, a: DenyReason.QUOTA });
    let mem: LocalMemory;
    let mr: MemoryRegion;
    try {
      mem = new LocalMemory(this.pool, this.pool.alloc(size));
      // A registration over exactly the granted bytes: never the slab around them.
      mr = this.pool.grant(mem.alloc, 0, size, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC);
    } catch {
      return this.sendCtrl({ type: MsgType.MR_DENY, token, a: DenyReason.NO_MEMORY });
    }
    const lease = Math.min(leaseMs || this.opts.defaultLeaseMs, this.opts.maxLeaseMs);
    const g: Grant = { mem, mr, timer: null, length: size };
    // The lease runs on this side's monotonic clock from the moment of the grant.
    g.timer = setTimeout(() => {
      const x = this.endGrant(token);
      x?.mem.release();
    }, lease);
    g.timer.unref();
    this.grants.set(token, g);
    this.quotaUsed += size;
    this.sendCtrl({ type: MsgType.MR_GRANT, token, a: size, b: lease, addr: mr.addr, rkey: mr.rkey });
  }

  // ------------------------------------------------------------- lifecycle

  private onQpEvent(e: AsyncEvent): void {
    this.fail(new RdmaError("CONNECTION_CLOSED", `connection failed: ${e.reason}`));
  }

  private protocolError(reason: string): void {
    const err = new RdmaError("PROTOCOL", `malformed control message from the peer: ${reason}; connection closed`);
    this.fail(err);
  }

  private onPeerClose(): void {
    this.fail(new RdmaError("CONNECTION_CLOSED", "the peer closed the connection"));
  }

  /** Fails the connection: every pending operation and wait rejects with the cause. */
  fail(err: RdmaError): void {
    if (this.failure) return;
    this.failure = err;
    for (const r of [...this.requests.values()]) r.reject(err);
    for (const r of [...this.rndvOut.values()]) r.reject(err);
    for (const w of this.recvWaiters.splice(0)) {
      w.cleanup();
      w.reject(err);
    }
    this.writeImms.fail(err);
    this.localMrs.fail(err);
    this.remoteMrs.fail(err);
    for (const p of [...this.creditQ.splice(0), ...this.ctrlQ.splice(0), ...this.dataQ.splice(0)]) {
      p.hdr?.release();
      for (const m of p.op.mems) m.opDone();
      p.op.result?.release();
      p.op.then?.(false);
      p.op.reject?.(err);
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
    this.cq.requestNotify();
    if (this.drainDeadline === null) {
      this.drainDeadline = setTimeout(() => this.teardown(), 2000);
      this.drainDeadline.unref();
    }
  }

  private teardown(): void {
    if (this.closed) return;
    this.closed = true;
    if (this.keepalive) clearInterval(this.keepalive);
    if (this.drainDeadline) clearTimeout(this.drainDeadline);
    for (const t of [...this.grants.keys()]) this.endGrant(t)?.mem.release();
    for (const t of [...this.lends.keys()]) this.endLend(t, false);
    // Any op still pending (a completion that never came) is settled now.
    for (let i = 0; i < this.slots.length; i++) {
      const op = this.slots[i];
      if (!op) continue;
      this.slots[i] = null;
      op.hdr?.release();
      op.result?.release();
      op.reject?.(this.failure);
    }
    for (const m of this.recvSlots.values()) m.release();
    this.recvSlots.clear();
    for (const h of this.hdrFree.splice(0)) h.release();
    this.cq.onNotify = null;
    this.qp.onEvent = null;
    this.onClosed();
    for (const r of this.closedWaiters.splice(0)) r();
  }

  private readonly closedWaiters: (() => void)[] = [];

  /**
   * Graceful close: tells the peer (its pending receives reject with
   * CONNECTION_CLOSED), waits for that message to leave, then tears down.
   */
  async close(timeoutMs: number): Promise<void> {
    if (this.closing || this.failure) {
      if (this.failure && !this.closed) await this.waitClosed(timeoutMs);
      return;
    }
    this.closing = true;
    const op = this.newOp("msg");
    const sent = this.track<void>(op, undefined);
    this.sendCtrl({ type: MsgType.CLOSE }, op);
    let timer: NodeJS.Timeout | null = null;
    await Promise.race([sent.catch(() => {}), new Promise<void>((r) => (timer = setTimeout(r, timeoutMs)))]);
    if (timer) clearTimeout(timer);
    this.fail(new RdmaError("CONNECTION_CLOSED", "the connection was closed by this side"));
    await this.waitClosed(timeoutMs);
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

  get isClosed(): boolean {
    return this.closed;
  }

  stats(): { credits: number; sqOutstanding: number; grants: number; quotaUsed: number; lends: number } {
    return { credits: this.credits, sqOutstanding: this.sqOutstanding, grants: this.grants.size, quotaUsed: this.quotaUsed, lends: this.lends.size };
  }
}
