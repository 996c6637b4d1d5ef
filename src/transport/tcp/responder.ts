/**
 * The responder half of a tcp QP: the receive queue, the peer's requests
 * (the QP's reader hands it those frames; qp.ts) and this QP's responses and
 * ACKs to them, written on the QP's one stream.
 *
 * Invariants it owns:
 * - requests are taken strictly in PSN order; after an RNR NAK everything up
 *   to the NAKed PSN's retransmission is discarded;
 * - every request is validated at its header, before any payload byte is
 *   placed: rkey → MR or window of this PD, access flags, bounds to the byte,
 *   the QP's access flags, 8-byte alignment for atomics; a violation answers
 *   with the NAK verbs would send and moves the QP to ERR;
 * - at most `maxDestRdAtomic` READ/atomic responses are outstanding (counted
 *   as responses the kernel has not taken yet, asked of the socket when a
 *   request arrives; taken.ts); one more is NAK invalid request;
 * - ACKs are coalesced: one cumulative ACK per chunk, carried by our next
 *   request (piggybacked) or sent alone at the end of the event-loop turn, at
 *   once past ACK_EAGER_REQUESTS; during a long payload a progress ACK at most
 *   every PROGRESS_INTERVAL_MS;
 * - back-pressure: while more than RESP_PAUSE_BYTES of responses wait for a
 *   peer that does not read them, and this QP's own requests wait for
 *   nothing, the stream is not read (so neither are the peer's requests).
 *   While our own requests are outstanding it is always read: their
 *   responses and ACKs share the stream, and two sides both paused would wait
 *   for each other forever. What a peer can then make us queue is still
 *   bounded: READ/atomic responses by maxDestRdAtomic, ACKs by coalescing.
 */
import type * as net from "node:net";
import { RdmaError } from "../../errors.js";
import { Access, QpState, WcFlags, WcOpcode, WcStatus, type Sge } from "../types.js";
import { dvOf } from "./bytes.js";
import { FrameFlags, FrameType, HEADER_LEN, Syndrome, encodeHeader, type DecodedHeader } from "./codec.js";
import type { FrameReader } from "./frame-reader.js";
import { sgeMr, type TcpMr, type TcpMw } from "./memory.js";
import { PSN_MASK, type QpCore } from "./qp-core.js";
import { RecvQueue, type RqEntry } from "./recv-queue.js";
import { VisitList } from "./ring.js";
import { kernelTaken } from "./taken.js";

/**
 * Many small requests do not wait for the end of the turn: once the ACK owed
 * covers this many requests it goes out right after the chunk, so a requester
 * whose whole window arrived in one turn gets it back without a bubble.
 */
const ACK_EAGER_REQUESTS = 16;
/**
 * While a request payload of at least PROGRESS_MIN_PAYLOAD bytes is arriving,
 * the responder tells the requester it is alive (a duplicate cumulative ACK,
 * or the ACK it owes) at most every PROGRESS_INTERVAL_MS: progress restarts
 * the requester's no-progress timer, so no single transfer is limited in length.
 */
const PROGRESS_MIN_PAYLOAD = 1 << 20;
const PROGRESS_INTERVAL_MS = 4;
/**
 * The responder stops reading the stream while more than this many bytes of
 * its responses and ACKs wait in user space (the peer does not read them) and
 * the QP's own requests wait for nothing; it reads again once they drain, or
 * as soon as the QP sends a request. Bounds what a peer can make us queue.
 */
const RESP_PAUSE_BYTES = 1 << 20;

const NO_BYTES = new Uint8Array(0);

/**
 * Responders owing an ACK at the end of this event-loop turn: one
 * setImmediate serves all of them (an Immediate is an object per call; every
 * QP that took requests in a turn shares one).
 */
const dueAcks = new VisitList<Responder>();
let dueAcksScheduled = false;
const ackNow = (r: Responder): void => r.ackAtTurnEnd();

function acksAtTurnEnd(): void {
  dueAcksScheduled = false;
  dueAcks.run(ackNow);
}

export class Responder {
  private readonly rq = new RecvQueue();
  /** The QP's stream (null until it is up, and after destroy). */
  sock: net.Socket | null = null;
  private reader: FrameReader | null = null;
  private ePsn = 0;
  private rnrNakPsn = -1;
  /** Cumulative ACK PSN owed to the peer (-1: none): piggybacked on our next request, or sent alone at the end of the turn. */
  private ackPending = -1;
  private ackScheduled = false;
  /** Requests the owed ACK covers (reset whenever it is sent, carried or implied). */
  private ackOwedRequests = 0;
  private curRecv: RqEntry | null = null;
  private curWriteImm = false;
  private respDiscard = false;
  /** When the responder last signalled progress during a long request payload (see PROGRESS_INTERVAL_MS). */
  private progressAt = 0;
  /**
   * Where each READ/atomic response not yet known to be taken by the kernel
   * ends in the stream (taken.ts's offsets), oldest first: requests certainly
   * still outstanding at the peer. At most maxDestRdAtomic entries.
   */
  private respEnds: number[] = [];
  /** The furthest response end whose write callback ran (what is known without asking the socket). */
  private respCalledBack = 0;
  /** The stream is paused until our responses drain (or our requester sends). */
  private respPaused = false;
  /** Bytes of responses and ACKs written and not yet taken by the kernel (our own requests are not counted). */
  private respQueued = 0;
  private minRnrTimer = 12;
  private maxDestRdAtomic = 16;
  /** What remoteTarget resolved: the MR and the offset in it, and the window it went through (null: none) with its key. */
  private remoteMr: TcpMr | null = null;
  private remoteOff = 0;
  private remoteWin: TcpMw | null = null;
  private remoteKey = 0;

  /**
   * @param access the QP's access flags (which remote operations the peer may target at it).
   * @param onPiggybackedAck the requester's handler for an ACK a request carried.
   * @param requesterBusy whether the QP's own requests await responses or ACKs (then the stream is never paused).
   */
  constructor(
    private readonly qp: QpCore,
    private readonly access: number,
    private readonly onPiggybackedAck: (psn: number) => void,
    private readonly requesterBusy: () => boolean,
  ) {}

  /** RTR: the peer's first PSN, our RNR timer and responder resources. */
  configure(peerPsn: number, minRnrTimer: number, maxDestRdAtomic: number): void {
    this.ePsn = peerPsn;
    this.minRnrTimer = minRnrTimer;
    this.maxDestRdAtomic = maxDestRdAtomic;
  }

  /** Takes the QP's stream (the peer's requests reach onRequestHeader/onRequestDone through `reader`). */
  attach(sock: net.Socket, reader: FrameReader): void {
    this.sock = sock;
    this.reader = reader;
  }

  /** After each chunk the stream delivered: the owed ACK, progress during a long request, back-pressure. */
  afterChunk(): void {
    const reader = this.reader!;
    this.scheduleAck();
    if (reader.payloadLeft > 0 && (reader.h.type === FrameType.SEND || reader.h.type === FrameType.WRITE)) this.signalProgress(reader.h);
    if (!this.respPaused && this.respQueued > RESP_PAUSE_BYTES) this.throttle();
  }

  /** The stream drained: read again if we paused. */
  onDrain(): void {
    this.respQueued = 0;
    this.unpause();
  }

  /** Our requester wrote requests: their responses must be read, so a paused stream reads again. */
  requesterSent(): void {
    if (this.respPaused) this.unpause();
  }

  private unpause(): void {
    if (!this.respPaused) return;
    this.respPaused = false;
    if (this.qp.state === QpState.RTS) this.sock?.resume();
  }

  // ---------------------------------------------------------- receive queue

  /** Queues receive WR #i (already validated). Throws RESOURCE_EXHAUSTED when the queue is full. */
  enqueue(wrId: number, sgList: readonly Sge[] | undefined, i: number, maxRecvWr: number): void {
    if (this.rq.length >= maxRecvWr) {
      throw new RdmaError("RESOURCE_EXHAUSTED", `receive work request #${i}: receive queue full (${maxRecvWr})`, { errnoName: "ENOMEM" });
    }
    if (this.qp.state === QpState.ERR) {
      this.qp.recvCq.push(wrId, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0, 0, 0, this.qp.qpNum);
      return;
    }
    this.rq.post(wrId, sgList);
  }

  /** A receive taken off the queue is finished: its completion, then its record is free (recv-queue.ts). */
  private completeRecv(r: RqEntry, status: number, opcode: number, flags: number, byteLen: number, imm: number): void {
    this.qp.recvCq.push(r.wrId, status, opcode, flags, byteLen, imm, this.qp.qpNum);
    this.rq.release(r);
  }

  /**
   * The QP entered ERR: every posted receive completes with WR_FLUSH_ERR, in
   * order, beginning with the one whose message was arriving (taken off the
   * queue, not completed: as on an HCA, it is flushed, not lost).
   */
  flush(): void {
    const cur = this.curRecv;
    this.curRecv = null;
    if (cur !== null) this.completeRecv(cur, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0, 0, 0);
    for (let r = this.rq.shift(); r !== null; r = this.rq.shift()) this.completeRecv(r, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0, 0, 0);
  }

  /** The QP is destroyed (it closes the stream itself). */
  destroy(): void {
    this.sock = null;
    this.curRecv = null;
    this.rq.clear();
  }

  /**
   * Requests this side accepted stay acknowledged when the QP leaves RTS (a
   * NIC ACKs them on arrival): the ACK still owed goes out now. A message the
   * peer sent just before its CLOSE must complete there, not retry into a
   * closed stream.
   */
  flushOwedAck(): void {
    if (this.qp.state === QpState.RTS || this.qp.state === QpState.RTR) this.flushAck();
  }

  // ------------------------------------------------------------------ ACKs

  /**
   * The ACK owed to the peer, taken for the request header about to be written
   * (-1: none to carry). Only called right before the header is written, so a
   * request that does not go out (flow control, RNR wait) never swallows it.
   */
  readonly takePiggyback = (_sock: net.Socket): number => {
    const p = this.ackPending;
    if (p < 0) return -1;
    this.clearAckOwed();
    this.qp.counters.piggybackedAcks++;
    return p;
  };

  private respond(type: FrameType, psn: number, aux: number, op1: bigint | number, op2: number, payload: Uint8Array | null, from: TcpMr | null = null): void {
    const s = this.sock;
    if (!s || s.destroyed) return;
    const n = payload === null ? 0 : payload.length;
    // READ/atomic responses hold a responder resource until the kernel has them (see responderResource).
    const resource = type === FrameType.READ_RESP || type === FrameType.ATOMIC_RESP;
    const end = resource ? s.bytesWritten + HEADER_LEN + n : 0;
    if (resource) this.respEnds.push(end);
    this.respQueued += HEADER_LEN + n;
    if (n > 0) {
      s.cork();
      s.write(encodeHeader(type, 0, psn, n, 0, 0, 0, aux, op1, op2), this.hdrFlushed);
      from?.retainForWrite();
      s.write(payload!, () => {
        from?.writeDone();
        if (resource) this.calledBack(end);
        this.payloadFlushed(n);
      });
      s.uncork();
    } else {
      s.write(
        encodeHeader(type, 0, psn, 0, 0, 0, 0, aux, op1, op2),
        resource
          ? () => {
              this.calledBack(end);
              this.hdrFlushed();
            }
          : this.hdrFlushed,
      );
    }
  }

  /** A response's write callback ran: the kernel has it (what is known where the socket cannot be asked; taken.ts). */
  private calledBack(end: number): void {
    if (end > this.respCalledBack) this.respCalledBack = end;
  }

  private readonly hdrFlushed = (): void => {
    if (this.respQueued >= HEADER_LEN) this.respQueued -= HEADER_LEN;
    if (this.respPaused && this.respQueued <= RESP_PAUSE_BYTES) this.unpause();
  };

  private payloadFlushed(n: number): void {
    this.respQueued = this.respQueued >= n ? this.respQueued - n : 0;
    if (this.respPaused && this.respQueued <= RESP_PAUSE_BYTES) this.unpause();
  }

  /**
   * Back-pressure on the responder: while more than RESP_PAUSE_BYTES of
   * responses and ACKs wait in user space for a peer that does not read them,
   * the stream is not read, unless our own requests await their responses
   * (they share the stream: pausing then could deadlock two busy sides).
   */
  private throttle(): void {
    if (this.qp.state !== QpState.RTS || this.requesterBusy()) return;
    this.respPaused = true;
    this.qp.counters.requestPauses++;
    this.sock?.pause();
  }

  private flushAck(): void {
    if (this.ackPending >= 0) {
      const p = this.ackPending;
      this.clearAckOwed();
      this.qp.counters.acks++;
      this.respond(FrameType.ACK, p, Syndrome.ACK, 0, 0, null);
    }
  }

  private clearAckOwed(): void {
    this.ackPending = -1;
    this.ackOwedRequests = 0;
  }

  /**
   * After a chunk of requests: the ACK they earned goes out alone at the end
   * of this event-loop turn, unless a request of ours carries it first
   * (transmit clears ackPending, so the deferred flush finds nothing). Runs of
   * small requests (ACK_EAGER_REQUESTS) are acknowledged right after the chunk.
   */
  private scheduleAck(): void {
    if (this.ackPending < 0) return;
    if (this.ackOwedRequests >= ACK_EAGER_REQUESTS) return this.flushAck();
    if (this.ackScheduled) return;
    this.ackScheduled = true;
    dueAcks.add(this);
    if (!dueAcksScheduled) {
      dueAcksScheduled = true;
      setImmediate(acksAtTurnEnd);
    }
  }

  /**
   * Mid-payload of a long request: tell the requester we are alive, at most
   * every PROGRESS_INTERVAL_MS, with the ACK we owe or else a duplicate of the
   * last cumulative ACK (ePsn - 1: everything before the current request is
   * placed and its responses are already queued ahead on this stream).
   */
  private signalProgress(h: DecodedHeader): void {
    if (this.respDiscard || this.qp.state !== QpState.RTS || h.payloadLen < PROGRESS_MIN_PAYLOAD) return;
    const now = performance.now();
    if (now - this.progressAt < PROGRESS_INTERVAL_MS) return;
    this.progressAt = now;
    this.qp.counters.progressAcks++;
    if (this.ackPending >= 0) this.flushAck();
    else this.respond(FrameType.ACK, (this.ePsn - 1) & PSN_MASK, Syndrome.ACK, 0, 0, null);
  }

  /** The end of the turn in which an ACK was scheduled (acksAtTurnEnd). */
  ackAtTurnEnd(): void {
    this.ackScheduled = false;
    if (this.qp.state === QpState.RTS) this.flushAck();
  }

  /** NAK and move the responder to ERR (class C/D errors in IBA terms). */
  private nak(psn: number, syndrome: number, reason: string): void {
    this.flushAck();
    this.respond(FrameType.ACK, psn, syndrome, 0, 0, null);
    this.reader?.discard();
    this.respDiscard = true;
    this.qp.enterError(reason, true);
  }

  // -------------------------------------------------------------- requests

  /**
   * Resolves a remote access into remoteMr/remoteOff (and remoteWin/remoteKey
   * through a window); false after sending the NAK. A zero-length access
   * names no memory (remoteMr null).
   */
  private remoteTarget(h: DecodedHeader, len: number, need: number): boolean {
    this.remoteMr = null;
    this.remoteOff = 0;
    this.remoteWin = null;
    if (len === 0) return true;
    const t = this.qp.pd.device.keys.get(h.rkey);
    if (t && t.pd === this.qp.pd) {
      if ("lkey" in t) {
        const off = h.raddr - t.addr;
        if (!t.unusable && t.access & need && off >= 0 && off + len <= t.length) {
          this.remoteMr = t;
          this.remoteOff = off;
        }
      } else if (t.mr && !t.mr.unusable && (t.type === 1 || t.qp === this.qp) && t.access & need && h.raddr >= t.addr && h.raddr + len <= t.addr + t.length) {
        this.remoteMr = t.mr;
        this.remoteOff = h.raddr - t.mr.addr;
        // The window may be invalidated or its MR deregistered mid-payload.
        this.remoteWin = t;
        this.remoteKey = h.rkey;
      }
    }
    if (this.remoteMr !== null) return true;
    this.nak(h.psn, Syndrome.NAK_REM_ACCESS, `remote access denied: rkey 0x${h.rkey.toString(16)} [0x${h.raddr.toString(16)}, +${len})`);
    return false;
  }

  private takeRecv(h: DecodedHeader, len: number): RqEntry | null | "rnr" {
    const r = this.rq.shift();
    if (r === null) {
      // Receiver not ready: NAK with our RNR timer; the requester resends from this PSN.
      this.flushAck();
      this.respond(FrameType.ACK, h.psn, Syndrome.RNR_NAK, 0, this.minRnrTimer, null);
      this.rnrNakPsn = h.psn;
      this.reader?.discard();
      return "rnr";
    }
    let cap = 0;
    for (let k = 0; k < r.nsge; k++) cap += r.sges[k]!.length;
    if (len > cap) {
      this.completeRecv(r, WcStatus.LOC_LEN_ERR, WcOpcode.RECV, 0, 0, 0);
      this.nak(h.psn, Syndrome.NAK_INV_REQ, `a ${len}-byte message does not fit the ${cap}-byte receive buffer`);
      return null;
    }
    return r;
  }

  onRequestHeader(h: DecodedHeader): void {
    const reader = this.reader!;
    // The ACK for our own requests counts even when the request carrying it is discarded (RNR, ERR).
    if (h.flags & FrameFlags.ACK && this.qp.state === QpState.RTS) this.onPiggybackedAck(h.op2Lo);
    if (this.qp.state !== QpState.RTS) {
      reader.discard();
      this.respDiscard = true;
      return;
    }
    if (this.rnrNakPsn >= 0) {
      if (h.psn !== this.rnrNakPsn) {
        reader.discard();
        this.respDiscard = true;
        return;
      }
      this.rnrNakPsn = -1;
    }
    if (h.psn !== this.ePsn) return this.qp.protocolError("responder", `PSN ${h.psn} out of sequence (expected ${this.ePsn})`);
    this.respDiscard = false;
    if (h.payloadLen >= PROGRESS_MIN_PAYLOAD) this.progressAt = performance.now();
    this.curRecv = null;
    this.curWriteImm = false;
    switch (h.type) {
      case FrameType.SEND: {
        const r = this.takeRecv(h, h.payloadLen);
        if (r === "rnr") {
          this.respDiscard = true;
          return;
        }
        if (r === null) return;
        reader.placeBegin();
        let left = h.payloadLen;
        for (let k = 0; k < r.nsge && left > 0; k++) {
          const s = r.sges[k]!;
          if (s.length === 0) continue;
          const mr = sgeMr(this.qp.pd, s, true);
          if (mr === null) {
            this.completeRecv(r, WcStatus.LOC_PROT_ERR, WcOpcode.RECV, 0, 0, 0);
            return this.nak(h.psn, Syndrome.NAK_REM_OP, "receive buffer is not inside a registered MR with LOCAL_WRITE");
          }
          const take = Math.min(left, s.length);
          reader.placeSeg(mr, s.addr - mr.addr, take);
          left -= take;
        }
        this.curRecv = r;
        return;
      }
      case FrameType.WRITE: {
        if (!(this.access & Access.REMOTE_WRITE)) return this.nak(h.psn, Syndrome.NAK_INV_REQ, "QP does not allow remote write");
        if (!this.remoteTarget(h, h.payloadLen, Access.REMOTE_WRITE)) return;
        if (h.flags & FrameFlags.IMM) {
          const r = this.takeRecv(h, 0);
          if (r === "rnr") {
            this.respDiscard = true;
            return;
          }
          if (r === null) return;
          this.curRecv = r;
          this.curWriteImm = true;
        }
        reader.placeBegin();
        const mr = this.remoteMr;
        if (mr !== null) {
          reader.placeSeg(mr, this.remoteOff, h.payloadLen);
          if (this.remoteWin !== null) reader.placeWindow(this.remoteWin, this.remoteKey);
        }
        return;
      }
      case FrameType.READ_REQ: {
        if (!this.responderResource(h)) return;
        if (!(this.access & Access.REMOTE_READ)) return this.nak(h.psn, Syndrome.NAK_INV_REQ, "QP does not allow remote read");
        if (!this.remoteTarget(h, h.aux, Access.REMOTE_READ)) return;
        const mr = this.remoteMr;
        const v = mr === null ? NO_BYTES : mr.view.subarray(this.remoteOff, this.remoteOff + h.aux);
        // The response acknowledges everything before it.
        this.clearAckOwed();
        this.respond(FrameType.READ_RESP, h.psn, 0, 0, 0, v, mr);
        return;
      }
      case FrameType.ATOMIC: {
        if (!this.responderResource(h)) return;
        if (!(this.access & Access.REMOTE_ATOMIC)) return this.nak(h.psn, Syndrome.NAK_INV_REQ, "QP does not allow remote atomics");
        // IBA: atomics need an 8-byte aligned target; rxe answers a misaligned one with NAK invalid request.
        if (h.raddr % 8 !== 0) return this.nak(h.psn, Syndrome.NAK_INV_REQ, `atomic target 0x${h.raddr.toString(16)} is not 8-byte aligned`);
        if (!this.remoteTarget(h, 8, Access.REMOTE_ATOMIC)) return;
        const mr = this.remoteMr!;
        const dv = dvOf(mr.view, mr.dvc);
        const at = mr.view.byteOffset + this.remoteOff;
        const orig = dv.getBigUint64(at, true);
        if (h.aux === 0) {
          if (orig === h.op1) dv.setBigUint64(at, h.op2, true);
        } else dv.setBigUint64(at, BigInt.asUintN(64, orig + h.op1), true);
        this.clearAckOwed();
        this.respond(FrameType.ATOMIC_RESP, h.psn, 0, orig, 0, null);
        return;
      }
      default:
        return this.qp.protocolError("responder", `unexpected frame type ${h.type} for the responder`);
    }
  }

  /**
   * IBA: a requester may have at most the responder's maxDestRdAtomic READs
   * and atomics outstanding; more is a class C error (NAK invalid request,
   * REM_INV_REQ_ERR at the requester, both QPs to ERR), as rxe answers
   * RESPST_ERR_TOO_MANY_RDMA_ATM_REQ. A response the kernel has not taken yet
   * cannot have reached the requester, so its request is certainly still
   * outstanding there: counting those never refuses a requester within the limit.
   */
  private responderResource(h: DecodedHeader): boolean {
    const ends = this.respEnds;
    if (ends.length > 0) {
      const taken = Math.max(this.respCalledBack, this.sock === null ? -1 : kernelTaken(this.sock));
      let k = 0;
      while (k < ends.length && ends[k]! <= taken) k++;
      if (k > 0) ends.splice(0, k);
    }
    if (ends.length < this.maxDestRdAtomic) return true;
    this.nak(
      h.psn,
      Syndrome.NAK_INV_REQ,
      this.maxDestRdAtomic === 0
        ? "RDMA READ/atomic request, but this QP has no responder resources (maxDestRdAtomic 0)"
        : `more RDMA READ/atomic requests outstanding than maxDestRdAtomic ${this.maxDestRdAtomic} (${ends.length} responses not yet taken by the peer's kernel)`,
    );
    return false;
  }

  /** The target of an incoming WRITE/SEND went away mid-payload: remote access error, as an HCA would answer. */
  onRequestRevoked(h: DecodedHeader): void {
    if (this.respDiscard || this.qp.state !== QpState.RTS) return;
    const r = this.curRecv;
    this.curRecv = null;
    if (r !== null) this.completeRecv(r, WcStatus.LOC_PROT_ERR, WcOpcode.RECV, 0, 0, 0);
    this.nak(h.psn, h.type === FrameType.SEND ? Syndrome.NAK_REM_OP : Syndrome.NAK_REM_ACCESS, "target memory was deregistered while its data arrived");
  }

  onRequestDone(h: DecodedHeader): void {
    if (this.respDiscard || this.qp.state !== QpState.RTS) return;
    this.ePsn = (this.ePsn + 1) & PSN_MASK;
    const r = this.curRecv;
    if (r !== null) {
      this.curRecv = null;
      const imm = h.flags & FrameFlags.IMM ? h.imm : 0;
      const flags = h.flags & FrameFlags.IMM ? WcFlags.WITH_IMM : 0;
      const op = this.curWriteImm ? WcOpcode.RECV_RDMA_WITH_IMM : WcOpcode.RECV;
      this.completeRecv(r, WcStatus.SUCCESS, op, flags, h.payloadLen, imm);
    }
    if (h.type === FrameType.SEND || h.type === FrameType.WRITE) {
      this.ackPending = h.psn;
      this.ackOwedRequests++;
    }
  }
}
