/**
 * The requester half of a tcp QP: the send queue, its requests on the QP's
 * one stream, and the peer's responses and ACKs to them (the QP's reader
 * hands it those frames; qp.ts).
 *
 * Invariants it owns:
 * - entries get consecutive PSNs when first transmitted and complete strictly
 *   in order (unsignaled ones silently unless they fail);
 * - an ACK completes what it covers; a NAK fails the entry it names; a
 *   READ/atomic response must match the oldest outstanding entry exactly
 *   (PSN, kind, length), anything else is a protocol error;
 * - a piggybacked ACK completes nothing past a READ/atomic whose response
 *   has not arrived yet (a peer that writes them out of order is obeyed no
 *   further than that);
 * - fences hold a WR until earlier READs/atomics finish; at most
 *   `maxRdAtomic` READs/atomics are outstanding;
 * - RNR NAK: go back N after the responder's timer, at most `rnrRetry` times
 *   (7 = infinite);
 * - liveness: liveness.ts (the no-progress timer this requester arms).
 */
import type * as net from "node:net";
import { randomInt } from "node:crypto";
import { RdmaError } from "../../errors.js";
import { QpState, WcStatus, WrOpcode, type SendWr } from "../types.js";
import { dvOf, type DvCache } from "./bytes.js";
import { FrameFlags, FrameType, HEADER_LEN, Syndrome, encodeHeader, rnrTimerMs, writeHeader, type DecodedHeader } from "./codec.js";
import type { FrameReader } from "./frame-reader.js";
import { NoProgressTimer } from "./liveness.js";
import { bindWindow, invalidateWindow, sgeMr } from "./memory.js";
import { PSN_MASK, psnBefore, type QpCore } from "./qp-core.js";
import { FreeList, RefRing } from "./ring.js";
import { ENTRY_DONE, ENTRY_QUEUED, ENTRY_SENT, clearEntry, copyFromMr, copyInline, fillEntry, newEntry, isReadOrAtomic, wcByteLen, wcOpcodeOf, type SqEntry } from "./send-queue.js";

/**
 * SEND and WRITE payloads up to this size are copied behind their header and
 * written as one buffer: cheaper than a writev of header and payload views
 * through the stream layer, and the source memory is not held by the socket.
 */
const SMALL_FRAME_COPY = 8192;
/**
 * The requester keeps writing posted requests until this many bytes wait in
 * the socket's user-space queue (Node's stream: not yet taken by the kernel),
 * then waits for 'drain'. The stream's own highWaterMark (16 KiB) made a 4 KiB
 * WRITE stream stop for a drain every 4 requests (one writev, a tick, an event
 * and a pump restart each) and a 64 KiB stream after every request. Payloads
 * above SMALL_FRAME_COPY are views of registered memory (not copies), so what
 * this bounds in copied bytes is at most this plus one small frame. 1 MiB
 * measured best of 256 KiB, 1 MiB and 4 MiB (4 KiB and 64 KiB WRITE
 * streams; a 1 MiB WRITE fills it alone), and matches the responder's
 * RESP_PAUSE_BYTES.
 */
export const REQUEST_QUEUE_BYTES = 1024 * 1024;
/**
 * Small frames are copied into a staging slab of this size, shared by every
 * QP of the process (as the codec's header arena is), and written from it.
 * The slab starts over from its first byte whenever none of its bytes is
 * pending or queued in a socket any more (its writes' callbacks have run:
 * the kernel has them), so a steady stream copies into memory that is already
 * mapped and cached; while writes from it are queued, a full slab is left to
 * them and another one taken: one whose writes are all done (kept, at most
 * FREE_SLABS of them), else a new one.
 */
const STAGE_BYTES = 64 * 1024;
/** Slabs whose writes are done, kept for reuse (process-wide: at most FREE_SLABS × STAGE_BYTES held idle). */
const FREE_SLABS = 8;
/** Free send-queue records kept per QP (what a burst made beyond it goes to the GC). */
const FREE_RECORDS = 64;

interface Slab {
  buf: Buffer;
  off: number;
  /** Requesters with frames pending in it (not written yet) plus its writes not yet done. */
  users: number;
  /** A DataView over `buf`'s bytes (small copies, bytes.ts). */
  readonly dvc: DvCache;
}

let stage: Slab | null = null;
const freeSlabs: Slab[] = [];
/** Staging slabs allocated so far (tests and benchmarks: a steady stream reuses a few). */
export const stageStats = { slabs: 0 };

/**
 * `n` bytes of the staging slab for a frame: their offset in `stage.buf`
 * (no view is made); the caller holds the slab (users) until its write is done.
 */
function stageBytes(n: number): number {
  let st = stage;
  if (st !== null && st.users === 0) st.off = 0;
  if (st === null || st.off + n > st.buf.length) {
    const free = n <= STAGE_BYTES ? freeSlabs.pop() : undefined;
    if (free !== undefined) st = stage = free;
    else {
      st = stage = { buf: Buffer.allocUnsafeSlow(Math.max(STAGE_BYTES, n)), off: 0, users: 0, dvc: { ab: null, dv: null } };
      stageStats.slabs++;
    }
  }
  const at = st.off;
  st.off += n;
  return at;
}

/** DataView over the codec's header arena (lone small frames are copied into it). */
const arenaDvc: DvCache = { ab: null, dv: null };

/** A write from `slab` is done (or failed): once none is left, a slab that is no longer the current one is kept for reuse. */
function releaseSlab(slab: Slab): void {
  if (--slab.users > 0 || slab === stage || freeSlabs.length >= FREE_SLABS || slab.buf.length !== STAGE_BYTES) return;
  slab.off = 0;
  freeSlabs.push(slab);
}

export class Requester {
  /** The send queue: sq.head is the oldest entry not yet completed, txIdx the next to transmit, ackIdx where to look for the oldest unacknowledged one. */
  private readonly sq = new RefRing<SqEntry>();
  private readonly records = new FreeList<SqEntry>(FREE_RECORDS);
  private txIdx = 0;
  private ackIdx = 0;
  private nextPsn = randomInt(0, PSN_MASK);
  /** The PSN of the first request (the peer's expected PSN; sent in the endpoint and the HELLO). */
  readonly initialPsn = this.nextPsn;
  private outstandingRd = 0;
  /** The QP's stream (null until it is up, and after destroy). */
  sock: net.Socket | null = null;
  private reader: FrameReader | null = null;
  private drainWait = false;
  /** The RNR timer, while it runs (tests read it through the QP). */
  rnrWait: NodeJS.Timeout | null = null;
  private pendingLocalError: SqEntry | null = null;
  private respTargetEntry: SqEntry | null = null;
  /**
   * Highest piggybacked ACK PSN not yet applied in full (-1: none): it overtook
   * the response to a READ/ATOMIC, and entries after that one complete only
   * once the response is in (see ackToMark).
   */
  private ackMark = -1;
  private wrotePending = false;
  /** This pump has more than one request to write: small frames are staged and joined (a lone one is written as it is). */
  private joining = false;
  /**
   * Small frames encoded back to back in the codec's header arena and not
   * written yet: one write covers them all (flushOut), at the latest when the
   * pump returns, so nothing else can write to the stream in between.
   */
  private outAb: ArrayBufferLike | null = null;
  private outStart = 0;
  private outEnd = 0;
  /** The staging slab the pending frames are in (held: users), or null (the codec's arena). */
  private outSlab: Slab | null = null;
  private rnrRetry = 7;
  private maxRdAtomic = 16;
  readonly liveness = new NoProgressTimer({
    outstanding: () => this.qp.state === QpState.RTS && this.firstSent() !== null,
    waitingOutRnr: () => this.rnrWait !== null,
    expire: (reason) => {
      const e = this.firstSent()!;
      e.state = ENTRY_DONE;
      e.status = WcStatus.RETRY_EXC_ERR;
      this.qp.enterError(reason, true, "QP_FATAL");
    },
  });

  /**
   * @param takePiggyback the responder's owed ACK for the request header about to be written (-1: none).
   * @param transmitted called after requests were written (the responder reads again if it paused: their responses must get in).
   */
  constructor(
    private readonly qp: QpCore,
    private readonly takePiggyback: (sock: net.Socket) => number,
    private readonly transmitted: () => void,
  ) {}

  /** Requests are posted and not finished: their responses and ACKs must keep being read. */
  get awaitingPeer(): boolean {
    return this.sq.length > 0;
  }

  configure(attr: { timeoutMs: number; retryCnt: number; rnrRetry: number; maxRdAtomic: number; livenessMs: number }): void {
    this.liveness.configure(attr.timeoutMs, attr.retryCnt, attr.livenessMs);
    this.rnrRetry = attr.rnrRetry;
    this.maxRdAtomic = attr.maxRdAtomic;
  }

  /** Takes the QP's stream (its frames reach onResponseHeader/onResponseDone through `reader`): requests leave on it. */
  attach(sock: net.Socket, reader: FrameReader): void {
    this.sock = sock;
    this.reader = reader;
  }

  /** The stream drained: send what waited for it. */
  onDrain(): void {
    this.drainWait = false;
    this.pump();
  }

  /** The QP reached RTS with its stream attached: send what was posted. */
  start(): void {
    this.liveness.progress();
    this.pump();
  }

  // ---------------------------------------------------------------- posting

  /** Queues send WR #i (already validated; `len` its message length). Throws RESOURCE_EXHAUSTED when the queue is full. */
  enqueue(wr: SendWr, i: number, len: number, maxSendWr: number, signalAll: boolean): void {
    const e = this.records.take() ?? newEntry();
    try {
      fillEntry(e, wr, i, len, this.qp.pd, signalAll);
    } catch (err) {
      clearEntry(e);
      this.records.give(e);
      throw err;
    }
    if (this.sq.length >= maxSendWr) {
      clearEntry(e);
      this.records.give(e);
      throw new RdmaError("RESOURCE_EXHAUSTED", `work request #${i}: send queue full (${maxSendWr} outstanding)`, { errnoName: "ENOMEM" });
    }
    this.sq.push(e);
    if (this.qp.state === QpState.ERR) {
      e.state = ENTRY_DONE;
      e.status = WcStatus.WR_FLUSH_ERR;
    }
  }

  /** After a post (also a partly failed one): send, or flush when the QP is in ERR. */
  posted(): void {
    if (this.qp.state === QpState.ERR) this.completeInOrder();
    else this.pump();
  }

  // ----------------------------------------------------------- transmission

  private pump(): void {
    const sock = this.sock;
    if (this.qp.state !== QpState.RTS || sock === null || this.drainWait || this.rnrWait !== null || this.pendingLocalError) return;
    // The ACK timer measures from the first request after an idle period, not from the last response.
    const wasIdle = this.firstSent() === null;
    // One writev for the whole posted list: the tcp provider's "one doorbell" (per-WR corks nest inside).
    // A single request is one write already: no cork (its buffering costs more than the write).
    // Small frames of the list are joined into as few writes as the header arena allows (out).
    const corked = this.sq.tail - this.txIdx !== 1;
    this.joining = corked;
    if (corked) sock.cork();
    try {
      this.pumpLoop(sock);
    } finally {
      this.flushOut(sock);
      if (corked) sock.uncork();
    }
    if (this.wrotePending) {
      this.wrotePending = false;
      if (wasIdle) this.liveness.progress();
      this.liveness.arm();
      this.transmitted();
    }
    this.completeInOrder();
  }

  private pumpLoop(sock: net.Socket): void {
    let wrote = false;
    while (this.txIdx < this.sq.tail) {
      const e = this.sq.at(this.txIdx);
      if (e.state === ENTRY_DONE) {
        this.txIdx++;
        continue;
      }
      const isRd = isReadOrAtomic(e.opcode);
      // Fence: wait for earlier READs and atomics to finish (their data may feed this WR).
      if (e.fence && this.outstandingRd > 0) break;
      if (isRd && this.outstandingRd >= this.maxRdAtomic) break;
      if (e.opcode === WrOpcode.BIND_MW || e.opcode === WrOpcode.LOCAL_INV) {
        this.executeLocal(e);
        this.txIdx++;
        if (e.status !== WcStatus.SUCCESS) {
          this.pendingLocalError = e;
          break;
        }
        continue;
      }
      if (e.psn < 0) {
        e.psn = this.nextPsn;
        this.nextPsn = (this.nextPsn + 1) & PSN_MASK;
      }
      if (!this.transmit(sock, e, isRd)) {
        e.state = ENTRY_DONE;
        e.status = WcStatus.LOC_PROT_ERR;
        this.txIdx++;
        this.pendingLocalError = e;
        break;
      }
      wrote = true;
      e.state = ENTRY_SENT;
      this.txIdx++;
      if (isRd) this.outstandingRd++;
      if (sock.writableLength + (this.outEnd - this.outStart) >= REQUEST_QUEUE_BYTES) {
        // The write below queues past the stream's highWaterMark, so 'drain' follows.
        this.drainWait = true;
        break;
      }
    }
    if (wrote) this.wrotePending = true;
  }

  /**
   * Writes frame bytes `b` (a view of the codec's arena, never reused) after the
   * frames pending: joined to them when it follows them in the same arena.
   */
  private out(sock: net.Socket, b: Buffer): void {
    this.outBytes(sock, b.buffer, b.byteOffset, b.length, null);
  }

  /** Writes the `n` frame bytes at `start` of `ab` (the codec's arena, or `slab`'s) after the frames pending, joined to them when they follow. */
  private outBytes(sock: net.Socket, ab: ArrayBufferLike, start: number, n: number, slab: Slab | null): void {
    if (this.outAb === ab && this.outEnd === start) {
      this.outEnd += n;
      return;
    }
    this.flushOut(sock);
    this.outAb = ab;
    this.outStart = start;
    this.outEnd = start + n;
    this.outSlab = slab;
    if (slab !== null) slab.users++;
  }

  /** Writes the pending frames as one buffer (a staging slab stays held until the kernel has them). */
  private flushOut(sock: net.Socket): void {
    const ab = this.outAb;
    if (ab === null) return;
    this.outAb = null;
    const bytes = Buffer.from(ab, this.outStart, this.outEnd - this.outStart);
    const slab = this.outSlab;
    if (slab === null) {
      sock.write(bytes);
      return;
    }
    this.outSlab = null;
    // The callback runs once the kernel has the bytes, or the write failed (the stream is gone): either way the slab is free of it.
    sock.write(bytes, () => releaseSlab(slab));
  }

  /**
   * Resolves the entry's local segments (its non-empty SGEs) into
   * e.targetMrs/Offs/Lens; false for a local protection error (an SGE outside
   * registered memory, or without LOCAL_WRITE where the response lands).
   */
  private resolve(e: SqEntry, needWrite: boolean): boolean {
    const pd = this.qp.pd;
    let nt = 0;
    for (let k = 0; k < e.nsge; k++) {
      const s = e.sges[k]!;
      if (s.length === 0) continue;
      const mr = sgeMr(pd, s, needWrite);
      if (mr === null) {
        e.ntargets = nt;
        return false;
      }
      e.targetMrs[nt] = mr;
      e.targetOffs[nt] = s.addr - mr.addr;
      e.targetLens[nt] = s.length;
      nt++;
    }
    e.ntargets = nt;
    return true;
  }

  /** Writes one request; false for a local protection error (an SGE outside registered memory). */
  private transmit(sock: net.Socket, e: SqEntry, isRd: boolean): boolean {
    let flags = (e.hasImm ? FrameFlags.IMM : 0) | (e.solicited ? FrameFlags.SOLICITED : 0);
    if (isRd) {
      if (!this.resolve(e, true)) return false;
      this.qp.counters.requests++;
      if (e.opcode === WrOpcode.RDMA_READ) {
        const ack = this.takePiggyback(sock);
        this.out(sock, encodeHeader(FrameType.READ_REQ, ack >= 0 ? FrameFlags.ACK : 0, e.psn, 0, e.rkey, e.remoteAddr, 0, e.len, 0, ack >= 0 ? ack : 0));
      } else {
        // An atomic's operand2 is its swap value: no room for an ACK.
        const op = e.opcode === WrOpcode.ATOMIC_CMP_AND_SWP ? 0 : 1;
        this.out(sock, encodeHeader(FrameType.ATOMIC, 0, e.psn, 0, e.rkey, e.remoteAddr, 0, op, e.compareAdd, e.swap));
      }
      return true;
    }
    const type = e.opcode === WrOpcode.SEND || e.opcode === WrOpcode.SEND_WITH_IMM ? FrameType.SEND : FrameType.WRITE;
    if (!e.inline && !this.resolve(e, false)) return false;
    this.qp.counters.requests++;
    const ack = this.takePiggyback(sock);
    if (ack >= 0) flags |= FrameFlags.ACK;
    const n = e.len;
    if (n <= SMALL_FRAME_COPY) {
      // A small frame is copied behind its header: one buffer (in a list, staged and written
      // with the frames before it), and the memory is free to reuse at once (no write to wait
      // for). A lone request (the latency path) is encoded in the codec's arena and written at
      // once: staging costs it more than it saves (write_lat 8 B measured +12 % staged).
      let b: Buffer;
      let o: number;
      if (this.joining) {
        o = stageBytes(HEADER_LEN + n);
        b = stage!.buf;
        writeHeader(b, o, type, flags, e.psn, n, e.rkey, e.remoteAddr, e.imm, 0, 0, ack >= 0 ? ack : 0);
      } else {
        b = encodeHeader(type, flags, e.psn, n, e.rkey, e.remoteAddr, e.imm, 0, 0, ack >= 0 ? ack : 0, n);
        o = 0;
      }
      const start = o;
      o += HEADER_LEN;
      if (n > 0) {
        const bdv = dvOf(b, this.joining ? stage!.dvc : arenaDvc);
        if (e.inline) copyInline(e, b, bdv, o);
        else
          for (let k = 0; k < e.ntargets; k++) {
            const len = e.targetLens[k]!;
            copyFromMr(e.targetMrs[k]!, e.targetOffs[k]!, b, bdv, o, len);
            o += len;
          }
      }
      if (this.joining) this.outBytes(sock, b.buffer, b.byteOffset + start, HEADER_LEN + n, stage);
      else {
        this.flushOut(sock);
        sock.write(b);
      }
      return true;
    }
    // Header and payload go out as one writev (cork), the payload straight from the registered memory.
    sock.cork();
    this.out(sock, encodeHeader(type, flags, e.psn, n, e.rkey, e.remoteAddr, e.imm, 0, 0, ack >= 0 ? ack : 0));
    this.flushOut(sock);
    if (e.inline) {
      // Never reached with the device's inline cap (below SMALL_FRAME_COPY); a copy: the socket must not hold the record's buffer.
      sock.write(Buffer.from(e.inlineBuf.subarray(0, n)));
    } else {
      // Each MR stays allocated until the kernel has copied its bytes, even if deregistered meanwhile.
      for (let k = 0; k < e.ntargets; k++) {
        const mr = e.targetMrs[k]!;
        const off = e.targetOffs[k]!;
        mr.retainForWrite();
        sock.write(mr.view.subarray(off, off + e.targetLens[k]!), mr.writeDone);
      }
    }
    sock.uncork();
    return true;
  }

  /** BIND_MW and LOCAL_INV run when they reach the head of the queue (nothing goes on the wire). */
  private executeLocal(e: SqEntry): void {
    e.state = ENTRY_DONE;
    if (e.opcode === WrOpcode.BIND_MW) {
      if (!bindWindow(this.qp, this.qp.pd, e.mw!, e.bindRkey, e.bindMr!, e.bindAddr, e.bindLen, e.bindAccess)) e.status = WcStatus.MW_BIND_ERR;
      return;
    }
    // LOCAL_INV of a type-2 window's rkey
    if (!invalidateWindow(this.qp, this.qp.pd, e.invalidateRkey)) e.status = WcStatus.LOC_PROT_ERR;
  }

  // ------------------------------------------------------------- completion

  /**
   * Retires finished entries at the head, in order: each one's completion is
   * generated (unsignaled successes silently), then its record is free.
   */
  private completeInOrder(): void {
    const sq = this.sq;
    while (sq.length > 0) {
      const e = sq.at(sq.head);
      if (e.state !== ENTRY_DONE) break;
      sq.shift();
      const status = e.status;
      const wrId = e.wrId;
      if (e.signaled || status !== WcStatus.SUCCESS) this.qp.sendCq.push(wrId, status, wcOpcodeOf(e), 0, wcByteLen(e), 0, this.qp.qpNum);
      if (this.pendingLocalError === e) this.pendingLocalError = null;
      if (this.respTargetEntry === e) this.respTargetEntry = null;
      // Nothing reads the record past this point (send-queue.ts): it is free for the next WR.
      clearEntry(e);
      this.records.give(e);
      if (status !== WcStatus.SUCCESS && status !== WcStatus.WR_FLUSH_ERR) this.qp.enterError(`work request ${wrId} failed with status ${status}`, false);
    }
    if (this.ackIdx < sq.head) this.ackIdx = sq.head;
    if (this.txIdx < sq.head) this.txIdx = sq.head;
    const k = sq.rebase();
    this.txIdx -= k;
    this.ackIdx -= k;
  }

  /** The oldest transmitted, unfinished entry. */
  private firstSent(): SqEntry | null {
    while (this.ackIdx < this.txIdx) {
      const e = this.sq.at(this.ackIdx);
      if (e.state === ENTRY_SENT) return e;
      this.ackIdx++;
    }
    return null;
  }

  /** Everything sent before `psn` that needs no response is acknowledged (a NAK or response implies it). */
  private ackBefore(psn: number, inclusive: boolean): void {
    for (let i = this.ackIdx; i < this.txIdx; i++) {
      const e = this.sq.at(i);
      if (e.state !== ENTRY_SENT) continue;
      const before = psnBefore(e.psn, psn) || (inclusive && e.psn === psn);
      if (!before) break;
      if (isReadOrAtomic(e.opcode)) {
        // A response that never came, yet later requests were acknowledged: the responder broke the protocol.
        this.qp.protocolError("requester", `acknowledgement for PSN ${psn} skips the response to PSN ${e.psn}`);
        return;
      }
      e.state = ENTRY_DONE;
    }
  }

  /**
   * A cumulative ACK piggybacked on one of the peer's requests. A peer may
   * write it before the response to an earlier READ or atomic: complete up to
   * the first such unanswered entry and remember the PSN; onResponseDone
   * carries on from there (ackToMark).
   */
  onPiggybackedAck(psn: number): void {
    this.qp.counters.piggybackedAcksReceived++;
    if (!psnBefore(psn, this.nextPsn)) {
      return this.qp.protocolError("requester", `piggybacked ACK for PSN ${psn}, which was never sent (next PSN ${this.nextPsn})`, "responder");
    }
    this.liveness.progress();
    if (this.ackMark < 0 || psnBefore(this.ackMark, psn)) this.ackMark = psn;
    if (!this.ackToMark()) this.qp.counters.piggybackedAcksHeld++;
    this.completeInOrder();
    this.pump();
  }

  /**
   * Applies ackMark: sent entries up to it are done, stopping at a READ/atomic
   * whose response has not arrived yet. False when it stopped there (the mark stays).
   */
  private ackToMark(): boolean {
    const mark = this.ackMark;
    if (mark < 0) return true;
    for (let i = this.ackIdx; i < this.txIdx; i++) {
      const e = this.sq.at(i);
      if (e.state !== ENTRY_SENT) continue;
      if (psnBefore(mark, e.psn)) break;
      // Its response is still on the way: keep the mark until it is in.
      if (isReadOrAtomic(e.opcode)) return false;
      e.state = ENTRY_DONE;
    }
    this.ackMark = -1;
    return true;
  }

  onResponseHeader(h: DecodedHeader): void {
    if (this.qp.state !== QpState.RTS) {
      this.reader?.discard();
      return;
    }
    if (!psnBefore(h.psn, this.nextPsn)) {
      const what = h.type === FrameType.ACK ? (h.aux === Syndrome.ACK ? "ACK" : "NAK") : "response";
      return this.qp.protocolError("requester", `${what} for PSN ${h.psn}, which was never sent (next PSN ${this.nextPsn})`);
    }
    this.liveness.progress();
    switch (h.type) {
      case FrameType.ACK: {
        if (h.aux === Syndrome.ACK) {
          this.ackBefore(h.psn, true);
          this.completeInOrder();
          this.pump();
          return;
        }
        this.ackBefore(h.psn, false);
        if (this.qp.state !== QpState.RTS) return;
        const e = this.firstSent();
        if (!e || e.psn !== h.psn) return this.qp.protocolError("requester", `NAK for PSN ${h.psn} that is not outstanding`);
        if (h.aux === Syndrome.RNR_NAK) return this.onRnrNak(e, h.op2Lo);
        e.state = ENTRY_DONE;
        e.status = h.aux === Syndrome.NAK_REM_ACCESS ? WcStatus.REM_ACCESS_ERR : h.aux === Syndrome.NAK_INV_REQ ? WcStatus.REM_INV_REQ_ERR : WcStatus.REM_OP_ERR;
        this.completeInOrder();
        return;
      }
      case FrameType.READ_RESP:
      case FrameType.ATOMIC_RESP: {
        this.ackBefore(h.psn, false);
        if (this.qp.state !== QpState.RTS) return;
        const e = this.firstSent();
        const want = h.type === FrameType.READ_RESP ? WrOpcode.RDMA_READ : -1;
        if (!e || e.psn !== h.psn || (want >= 0 ? e.opcode !== want : e.opcode !== WrOpcode.ATOMIC_CMP_AND_SWP && e.opcode !== WrOpcode.ATOMIC_FETCH_AND_ADD)) {
          return this.qp.protocolError("requester", `response for PSN ${h.psn} matches no outstanding request`);
        }
        if (h.type === FrameType.READ_RESP) {
          if (h.payloadLen !== e.len) return this.qp.protocolError("requester", `read response of ${h.payloadLen} bytes for a ${e.len}-byte read`);
          const reader = this.reader!;
          reader.placeBegin();
          for (let k = 0; k < e.ntargets; k++) reader.placeSeg(e.targetMrs[k]!, e.targetOffs[k]!, e.targetLens[k]!);
        }
        this.respTargetEntry = e;
        return;
      }
      default:
        return this.qp.protocolError("requester", `unexpected frame type ${h.type} for the requester`);
    }
  }

  onResponseDone(h: DecodedHeader): void {
    const e = this.respTargetEntry;
    if (e === null || this.qp.state !== QpState.RTS) return;
    this.respTargetEntry = null;
    if (h.type === FrameType.ATOMIC_RESP) {
      const mr = e.targetMrs[0]!;
      // Deregistered since the atomic went out: no byte may land after deregister returned.
      if (mr.unusable) {
        this.respTargetEntry = e;
        return this.onResponseRevoked();
      }
      // The original value lands in host byte order (little-endian), as an HCA writes it.
      const v = mr.view;
      dvOf(v, mr.dvc).setBigUint64(v.byteOffset + e.targetOffs[0]!, h.op1, true);
    }
    e.state = ENTRY_DONE;
    this.outstandingRd--;
    // A piggybacked ACK that overtook this response may now apply past it.
    this.ackToMark();
    this.completeInOrder();
    this.pump();
  }

  /** A READ's local target was deregistered while the response arrived: local protection error. */
  onResponseRevoked(): void {
    const e = this.respTargetEntry;
    if (e === null || this.qp.state !== QpState.RTS) return;
    this.respTargetEntry = null;
    e.state = ENTRY_DONE;
    e.status = WcStatus.LOC_PROT_ERR;
    this.outstandingRd--;
    this.completeInOrder();
  }

  /** RNR NAKs answered by a retry (QueuePair.rnrRetries). */
  rnrRetries = 0;

  private onRnrNak(e: SqEntry, timerCode: number): void {
    e.rnrTries++;
    if (this.rnrRetry !== 7 && e.rnrTries > this.rnrRetry) {
      e.state = ENTRY_DONE;
      e.status = WcStatus.RNR_RETRY_EXC_ERR;
      this.completeInOrder();
      return;
    }
    this.rnrRetries++;
    // Go back N: the responder discards everything after the NAKed PSN; resend from it after the RNR timer.
    let idx = this.ackIdx;
    while (this.sq.at(idx) !== e) idx++;
    for (let i = idx; i < this.txIdx; i++) {
      const x = this.sq.at(i);
      if (x.state === ENTRY_SENT) x.state = ENTRY_QUEUED;
    }
    this.txIdx = idx;
    this.outstandingRd = 0;
    const ms = rnrTimerMs(timerCode);
    this.rnrWait = setTimeout(() => {
      this.rnrWait = null;
      this.liveness.progress();
      this.pump();
    }, ms);
  }

  // ----------------------------------------------------------------- errors

  /** A malformed response: the oldest outstanding entry reports BAD_RESP_ERR (the QP then enters ERR). */
  failFirstSent(status: number): void {
    const e = this.firstSent();
    if (e) {
      e.state = ENTRY_DONE;
      e.status = status;
    }
  }

  /** A lost stream: the oldest WR that went out at least once (also one waiting out an RNR timer) reports why. */
  failOldestStarted(status: number): void {
    for (let i = this.sq.head; i < this.sq.tail; i++) {
      const e = this.sq.at(i);
      if (e.state === ENTRY_DONE) continue;
      if (e.psn >= 0) {
        e.state = ENTRY_DONE;
        e.status = status;
      }
      return;
    }
  }

  /** The QP entered ERR: timers stop and every unfinished WR completes with WR_FLUSH_ERR, in order. */
  flush(): void {
    if (this.rnrWait) clearTimeout(this.rnrWait);
    this.rnrWait = null;
    this.liveness.stop();
    this.ackMark = -1;
    for (let i = this.sq.head; i < this.sq.tail; i++) {
      const e = this.sq.at(i);
      if (e.state !== ENTRY_DONE) {
        e.state = ENTRY_DONE;
        e.status = WcStatus.WR_FLUSH_ERR;
      }
    }
    this.pendingLocalError = null;
    this.completeInOrder();
  }

  /** The QP is destroyed: no completions, no timers (the QP closes the stream). */
  destroy(): void {
    if (this.rnrWait) clearTimeout(this.rnrWait);
    this.rnrWait = null;
    this.liveness.stop();
    this.sock = null;
    this.sq.clear();
    this.records.clear();
    this.txIdx = this.ackIdx = 0;
    this.respTargetEntry = null;
    this.pendingLocalError = null;
  }
}
