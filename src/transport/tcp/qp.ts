/**
 * The tcp provider's RC queue pair: a requester (send queue, go-back-N on RNR,
 * ACK timeout) and a responder (rkey/bounds/access checks, RNR NAK, in-order
 * placement), each on its own TCP stream (see codec.ts).
 */
import net from "node:net";
import { randomInt } from "node:crypto";
import { RdmaError, checkInt } from "../../errors.js";
import {
  Access,
  QpState,
  SendFlags,
  WcFlags,
  WcOpcode,
  WcStatus,
  WrOpcode,
  type AsyncEvent,
  type AsyncEventType,
  type Endpoint,
  type QpConnectAttr,
  type QpInitAttr,
  type QueuePair,
  type RecvWr,
  type SendWr,
  type Sge,
} from "../types.js";
import {
  FrameFlags,
  FrameType,
  HEADER_LEN,
  MAX_MESSAGE,
  Syndrome,
  ackTimeoutMs,
  decodeHeader,
  encodeHeader,
  newHeader,
  rnrTimerMs,
  type FrameHeader,
} from "./codec.js";
import { TcpMr, TcpMw, type TcpCq, type TcpDevice, type TcpPd } from "./device.js";

const PSN_MASK = 0xffffff;
/**
 * A piggybacked ACK rides on a request only while the requester stream has at
 * most this much queued before it: behind a long queue it would reach the peer
 * later than a standalone ACK on the idle response stream.
 */
const PIGGYBACK_MAX_QUEUED = 64 * 1024;
/**
 * Many small requests do not wait for the end of the turn: once the ACK owed
 * covers this many requests it goes out right after the chunk, so a requester
 * whose whole window arrived in one turn gets it back without a bubble.
 */
const ACK_EAGER_REQUESTS = 16;
/**
 * Default of QpConnectAttr.livenessMs: a requester with work outstanding
 * tolerates this long without hearing from a peer whose streams are up (its
 * event loop may be blocked or stopped: TCP itself retransmits, and a cut
 * stream is seen at once). Survives multi-second GC pauses and synchronous work.
 */
export const DEFAULT_LIVENESS_MS = 15_000;
/**
 * While a request payload of at least PROGRESS_MIN_PAYLOAD bytes is arriving,
 * the responder tells the requester it is alive (a duplicate cumulative ACK,
 * or the ACK it owes) at most every PROGRESS_INTERVAL_MS: progress restarts
 * the requester's no-progress timer, so no single transfer is limited in length.
 */
const PROGRESS_MIN_PAYLOAD = 1 << 20;
const PROGRESS_INTERVAL_MS = 4;
/**
 * A no-progress check that runs this much (or a quarter of the limit, if
 * less) later than scheduled means our own event loop was stalled: that time
 * is not counted against the peer.
 */
const STALL_CREDIT_MS = 100;
/**
 * The responder stops reading a peer's requests while more than this many
 * bytes of its responses wait in user space (the peer does not read them),
 * and reads again on 'drain'. Bounds what a peer can make us queue.
 */
const RESP_PAUSE_BYTES = 1 << 20;
/**
 * After ERR the QP finishes writing what it queued (a NAK) before closing its
 * streams; a peer that does not read gets its streams destroyed after this long.
 */
const ERR_LINGER_MS = 2_000;
const ENTRY_QUEUED = 0;
const ENTRY_SENT = 1;
const ENTRY_DONE = 2;

/** A send-queue entry: the WR's fields copied at post time (the caller may reuse its objects). */
interface SqEntry {
  wrId: number;
  opcode: number;
  signaled: boolean;
  fence: boolean;
  sges: Sge[];
  len: number;
  inline: Uint8Array | null;
  imm: number;
  hasImm: boolean;
  solicited: boolean;
  remoteAddr: number;
  rkey: number;
  compareAdd: bigint;
  swap: bigint;
  mw: TcpMw | null;
  bindRkey: number;
  bindMr: TcpMr | null;
  bindAddr: number;
  bindLen: number;
  bindAccess: number;
  invalidateRkey: number;
  psn: number;
  state: number;
  status: number;
  rnrTries: number;
  /** READ/ATOMIC: where the response lands, resolved at transmit, and whether those MRs are still registered. */
  targets: Uint8Array[] | null;
  guard: (() => boolean) | null;
}

interface RqEntry {
  wrId: number;
  sges: Sge[];
}

/** Frame counters of one tcp QP (for tests and benchmarks; not part of the seam). */
export interface TcpQpStats {
  /** Request frames written: SEND, WRITE, READ_REQ, ATOMIC (retransmissions after an RNR NAK included). */
  readonly requests: number;
  /** Standalone ACK frames (syndrome ACK) written by the responder. */
  readonly acks: number;
  /** Requests written that carried a piggybacked ACK. */
  readonly piggybackedAcks: number;
  /** Piggybacked ACKs received on the responder stream. */
  readonly piggybackedAcksReceived: number;
  /** Received piggybacked ACKs that overtook a READ/ATOMIC response and were held until it arrived. */
  readonly piggybackedAcksHeld: number;
  /** Duplicate ACKs the responder wrote to signal progress during a long request payload. */
  readonly progressAcks: number;
  /** Times the responder stopped reading requests because its responses were not being read. */
  readonly requestPauses: number;
}

function isReadOrAtomic(opcode: number): boolean {
  return opcode === WrOpcode.RDMA_READ || opcode === WrOpcode.ATOMIC_CMP_AND_SWP || opcode === WrOpcode.ATOMIC_FETCH_AND_ADD;
}

const WC_OF_WR: Record<number, number> = {
  [WrOpcode.RDMA_WRITE]: WcOpcode.RDMA_WRITE,
  [WrOpcode.RDMA_WRITE_WITH_IMM]: WcOpcode.RDMA_WRITE,
  [WrOpcode.SEND]: WcOpcode.SEND,
  [WrOpcode.SEND_WITH_IMM]: WcOpcode.SEND,
  [WrOpcode.RDMA_READ]: WcOpcode.RDMA_READ,
  [WrOpcode.ATOMIC_CMP_AND_SWP]: WcOpcode.COMP_SWAP,
  [WrOpcode.ATOMIC_FETCH_AND_ADD]: WcOpcode.FETCH_ADD,
  [WrOpcode.LOCAL_INV]: WcOpcode.LOCAL_INV,
  [WrOpcode.BIND_MW]: WcOpcode.BIND_MW,
};

/** A guard that holds while every MR in `mrs` is registered. */
function mrsAlive(mrs: TcpMr[]): () => boolean {
  const list = mrs.slice();
  return () => {
    for (const m of list) if (m.deregistered) return false;
    return true;
  };
}

/** psn a is before b in 24-bit serial arithmetic. */
function psnBefore(a: number, b: number): boolean {
  return ((b - a) & PSN_MASK) !== 0 && ((b - a) & PSN_MASK) < 0x800000;
}

/**
 * Incremental frame reader: header first (possibly split across chunks), then
 * the payload copied straight into its placement (registered memory) as bytes
 * arrive, with no reassembly buffer.
 */
export class FrameReader {
  private readonly hdrBuf = Buffer.alloc(HEADER_LEN);
  private hdrFill = 0;
  readonly h: FrameHeader = newHeader();
  private remaining = 0;
  /** Payload bytes of the current frame still to come (0 between frames). */
  get payloadLeft(): number {
    return this.remaining;
  }
  private targets: Uint8Array[] | null = null;
  /** Checked before every placement: false once the target memory was deregistered. */
  private guard: (() => boolean) | null = null;
  private ti = 0;
  private toff = 0;
  stopped = false;
  /** Set when the handler wants the rest of the current chunk (parking a socket). */
  leftover: Buffer | null = null;

  constructor(
    public onHeader: (h: FrameHeader) => void,
    public onPayloadDone: (h: FrameHeader) => void,
    public onMalformed: (reason: string) => void,
    /** The target memory went away mid-payload: the rest of it is discarded. */
    public onRevoked: (h: FrameHeader) => void = () => {},
  ) {}

  /** Called from onHeader: where the payload goes (null = discard), and what keeps it valid. */
  place(targets: Uint8Array[] | null, guard: (() => boolean) | null = null): void {
    this.targets = targets;
    this.guard = guard;
    this.ti = 0;
    this.toff = 0;
  }

  feed(chunk: Buffer): void {
    let off = 0;
    const len = chunk.length;
    while (off < len && !this.stopped) {
      if (this.remaining > 0) {
        const n = Math.min(this.remaining, len - off);
        if (this.targets !== null) {
          if (this.guard !== null && !this.guard()) {
            // Deregistered while its payload was arriving: no byte may land after deregister returned.
            this.targets = null;
            this.onRevoked(this.h);
          } else this.scatter(chunk, off, n);
        }
        off += n;
        this.remaining -= n;
        if (this.remaining === 0) this.onPayloadDone(this.h);
        continue;
      }
      let src: Buffer;
      let at: number;
      if (this.hdrFill === 0 && len - off >= HEADER_LEN) {
        src = chunk;
        at = off;
        off += HEADER_LEN;
      } else {
        const n = Math.min(HEADER_LEN - this.hdrFill, len - off);
        chunk.copy(this.hdrBuf, this.hdrFill, off, off + n);
        this.hdrFill += n;
        off += n;
        if (this.hdrFill < HEADER_LEN) return;
        this.hdrFill = 0;
        src = this.hdrBuf;
        at = 0;
      }
      const err = decodeHeader(src, at, this.h);
      if (err !== null) {
        this.stopped = true;
        this.onMalformed(err);
        return;
      }
      this.targets = null;
      this.guard = null;
      this.remaining = this.h.payloadLen;
      this.onHeader(this.h);
      if (this.stopped) {
        if (off < len) this.leftover = chunk.subarray(off);
        return;
      }
      if (this.remaining === 0) this.onPayloadDone(this.h);
    }
  }

  private scatter(chunk: Buffer, off: number, n: number): void {
    const ts = this.targets!;
    while (n > 0 && this.ti < ts.length) {
      const t = ts[this.ti]!;
      const k = Math.min(n, t.length - this.toff);
      t.set(chunk.subarray(off, off + k), this.toff);
      this.toff += k;
      off += k;
      n -= k;
      if (this.toff === t.length) {
        this.ti++;
        this.toff = 0;
      }
    }
  }
}

export class TcpQueuePair implements QueuePair {
  readonly pd: TcpPd;
  readonly qpNum: number;
  state: QpState = QpState.RESET;
  readonly sendCq: TcpCq;
  readonly recvCq: TcpCq;
  readonly caps: { maxSendWr: number; maxRecvWr: number; maxSendSge: number; maxRecvSge: number; maxInlineData: number };
  onEvent: ((e: AsyncEvent) => void) | null = null;
  private readonly device: TcpDevice;
  private readonly sqSigAll: boolean;
  private readonly qpAccess: number;

  // requester
  private sq: SqEntry[] = [];
  private sqHead = 0;
  private txIdx = 0;
  private ackIdx = 0;
  private nextPsn = randomInt(0, PSN_MASK);
  private readonly initialPsn = this.nextPsn;
  private outstandingRd = 0;
  private reqSock: net.Socket | null = null;
  private reqReader: FrameReader | null = null;
  private drainWait = false;
  private rnrWait: NodeJS.Timeout | null = null;
  private pendingLocalError: SqEntry | null = null;
  private ackTimer: NodeJS.Timeout | null = null;
  /** Set while a due no-progress verdict waits one turn for I/O already received (our own loop may have stalled). */
  private ackConfirm: NodeJS.Immediate | null = null;
  private lastProgress = 0;
  private respTargetEntry: SqEntry | null = null;
  /**
   * Highest piggybacked ACK PSN not yet applied in full (-1: none): it overtook
   * the response to a READ/ATOMIC, and entries after that one complete only
   * once the response is in (see ackToMark).
   */
  private ackMark = -1;

  // responder
  private rq: RqEntry[] = [];
  private rqHead = 0;
  private respSock: net.Socket | null = null;
  private respReader: FrameReader | null = null;
  /** Streams that arrived before connect(): the one matching the peer's endpoint is adopted, the rest dropped. */
  private parked: { sock: net.Socket; srcQp: number; psn: number; rest: Buffer | null }[] = [];
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
  /** READ/atomic responses written but not yet handed to the kernel: requests still outstanding at the peer. */
  private respUnflushed = 0;
  /** The request stream is paused until the response stream drains. */
  private respPaused = false;

  // connection attributes
  private remote: Endpoint | null = null;
  private timeoutMs = ackTimeoutMs(14);
  private retryCnt = 7;
  private rnrRetry = 7;
  private minRnrTimer = 12;
  private maxRdAtomic = 16;
  private livenessMs = DEFAULT_LIVENESS_MS;
  private maxDestRdAtomic = 16;
  readonly boundWindows = new Set<TcpMw>();
  private readonly counters = { requests: 0, acks: 0, piggybackedAcks: 0, piggybackedAcksReceived: 0, piggybackedAcksHeld: 0, progressAcks: 0, requestPauses: 0 };

  /** Frame counters (a snapshot). */
  get stats(): TcpQpStats {
    return { ...this.counters };
  }

  constructor(pd: TcpPd, init: QpInitAttr) {
    const a = pd.device.attr;
    this.pd = pd;
    this.device = pd.device;
    if (!init || typeof init !== "object") throw new RdmaError("INVALID_ARGUMENT", "createQp needs init attributes");
    this.sendCq = init.sendCq as TcpCq;
    this.recvCq = init.recvCq as TcpCq;
    if (!this.sendCq || this.sendCq.device !== this.device || !this.recvCq || this.recvCq.device !== this.device) {
      throw new RdmaError("INVALID_ARGUMENT", "send and receive CQs must belong to the QP's device");
    }
    if (this.sendCq.destroyed || this.recvCq.destroyed) throw new RdmaError("INVALID_STATE", "cannot create a QP on a destroyed CQ", { errno: "EINVAL" });
    this.caps = {
      maxSendWr: checkInt("maxSendWr", init.maxSendWr, 1, a.maxQpWr),
      maxRecvWr: checkInt("maxRecvWr", init.maxRecvWr, 1, a.maxQpWr),
      maxSendSge: checkInt("maxSendSge", init.maxSendSge ?? 1, 1, a.maxSge),
      maxRecvSge: checkInt("maxRecvSge", init.maxRecvSge ?? 1, 1, a.maxSge),
      maxInlineData: checkInt("maxInlineData", init.maxInlineData ?? 0, 0, a.maxInline),
    };
    this.sqSigAll = init.sqSigAll === true;
    checkInt("portNum", init.portNum ?? 1, 1, 1);
    this.qpAccess = checkInt("access", init.access ?? (Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC), 0, 31);
    this.qpNum = this.device.allocQpn();
    this.device.qps.set(this.qpNum, this);
    this.sendCq.qps.add(this);
    this.recvCq.qps.add(this);
    this.state = QpState.INIT;
  }

  private destroyed = false;

  private checkAlive(what: string): void {
    if (this.destroyed) throw new RdmaError("INVALID_STATE", `${what}: QP ${this.qpNum} was destroyed`, { errno: "EINVAL" });
  }

  localEndpoint(attr: { portNum?: number; gidIndex?: number } = {}): Endpoint {
    this.checkAlive("localEndpoint");
    if (attr === null || typeof attr !== "object") throw new RdmaError("INVALID_ARGUMENT", "localEndpoint takes { portNum?, gidIndex? }");
    checkInt("portNum", attr.portNum ?? 1, 1, this.device.attr.physPortCnt);
    // tcp has one address per device; the GID index is accepted (verbs programs pass one) and ignored.
    checkInt("gidIndex", attr.gidIndex ?? 0, 0, 255);
    return {
      provider: "tcp",
      qpNum: this.qpNum,
      psn: this.initialPsn,
      lid: 0,
      gid: this.device.host,
      port: this.device.port,
      mtu: 4096,
    };
  }

  connect(remote: Endpoint, attr: QpConnectAttr = {}): void {
    this.checkAlive("connect");
    if (this.state !== QpState.INIT) throw new RdmaError("INVALID_STATE", `QP ${this.qpNum} must be in INIT to connect (state ${this.state})`);
    if (!remote || remote.provider !== "tcp") throw new RdmaError("INVALID_ARGUMENT", `peer endpoint is not a tcp endpoint (got ${String(remote?.provider)})`);
    checkInt("remote.qpNum", remote.qpNum, 0, PSN_MASK);
    checkInt("remote.psn", remote.psn, 0, PSN_MASK);
    checkInt("remote.port", remote.port, 1, 65535);
    if (typeof remote.gid !== "string" || remote.gid.length === 0) throw new RdmaError("INVALID_ARGUMENT", "peer endpoint has no address");
    if (attr.mtu !== undefined && ![256, 512, 1024, 2048, 4096].includes(attr.mtu)) throw new RdmaError("INVALID_ARGUMENT", `mtu must be 256..4096 (a power of two), got ${attr.mtu}`);
    this.timeoutMs = ackTimeoutMs(checkInt("timeout", attr.timeout ?? 14, 0, 31));
    this.retryCnt = checkInt("retryCnt", attr.retryCnt ?? 7, 0, 7);
    this.rnrRetry = checkInt("rnrRetry", attr.rnrRetry ?? 7, 0, 7);
    this.minRnrTimer = checkInt("minRnrTimer", attr.minRnrTimer ?? 12, 0, 31);
    this.maxRdAtomic = checkInt("maxRdAtomic", attr.maxRdAtomic ?? 16, 1, this.device.attr.maxQpInitRdAtom);
    this.maxDestRdAtomic = checkInt("maxDestRdAtomic", attr.maxDestRdAtomic ?? 16, 0, this.device.attr.maxQpRdAtom);
    this.livenessMs = checkInt("livenessMs", attr.livenessMs ?? DEFAULT_LIVENESS_MS, 0, 2 ** 31 - 1);
    this.remote = { ...remote };
    this.ePsn = remote.psn;
    this.state = QpState.RTS;

    const sock = net.connect({ host: remote.gid, port: remote.port, noDelay: true });
    // Like an idle verbs QP, the streams do not keep the process alive; an armed CQ with a handler does.
    sock.unref();
    this.reqSock = sock;
    const reader = new FrameReader(
      (h) => this.onResponseHeader(h),
      (h) => this.onResponseDone(h),
      (reason) => this.protocolError("requester", reason),
      () => this.onResponseRevoked(),
    );
    this.reqReader = reader;
    sock.on("data", (chunk: Buffer) => {
      // Any byte from the peer on this stream (ACK, NAK, response, part of one) is progress.
      this.lastProgress = performance.now();
      reader.feed(chunk);
    });
    sock.on("drain", () => {
      this.drainWait = false;
      this.pump();
    });
    sock.on("error", (e) => this.connectionLost(`connection to peer ${remote.gid}:${remote.port} failed: ${e.message}`));
    sock.on("close", () => this.connectionLost("peer closed the connection"));
    sock.write(encodeHeader(FrameType.HELLO, 0, this.initialPsn, 0, 0, 0, 0, remote.qpNum, BigInt(this.qpNum), 0n));
    const parked = this.parked;
    this.parked = [];
    for (const p of parked) {
      if (p.srcQp === remote.qpNum && p.psn === remote.psn && !this.respSock) this.incoming(p.sock, p.srcQp, p.psn, p.rest);
      else p.sock.destroy();
    }
    this.lastProgress = performance.now();
    this.pump();
  }

  /** An incoming stream for this QP (the peer's requests). Parked, paused, until connect() when it arrives early. */
  incoming(sock: net.Socket, srcQp: number, psn: number, rest: Buffer | null): void {
    if (this.state === QpState.INIT) {
      // A stranger's HELLO must not evict the real peer's stream: keep a few, bounded.
      if (this.parked.length >= 4) {
        sock.destroy();
        return;
      }
      sock.pause();
      this.parked.push({ sock, srcQp, psn, rest });
      return;
    }
    if (this.state !== QpState.RTS || !this.remote || srcQp !== this.remote.qpNum || psn !== this.remote.psn || this.respSock) {
      sock.destroy();
      return;
    }
    this.respSock = sock;
    sock.unref();
    const reader = new FrameReader(
      (h) => this.onRequestHeader(h),
      (h) => this.onRequestDone(h),
      (reason) => this.protocolError("responder", reason),
      (h) => this.onRequestRevoked(h),
    );
    this.respReader = reader;
    const feed = (chunk: Buffer): void => {
      reader.feed(chunk);
      this.scheduleAck();
      if (reader.payloadLeft > 0) this.signalProgress(reader.h);
      this.throttleRequests(sock);
    };
    sock.on("data", feed);
    sock.on("drain", () => {
      if (!this.respPaused) return;
      this.respPaused = false;
      if (this.state === QpState.RTS) sock.resume();
    });
    sock.on("error", () => {});
    sock.on("close", () => this.connectionLost("peer closed the connection"));
    if (rest) feed(rest);
    sock.resume();
  }

  // ---------------------------------------------------------------- posting

  postSend(wrs: readonly SendWr[]): void {
    this.checkAlive("postSend");
    if (!Array.isArray(wrs)) throw new RdmaError("INVALID_ARGUMENT", "postSend takes an array of work requests");
    if (this.state === QpState.RESET || this.state === QpState.INIT || this.state === QpState.RTR) {
      throw new RdmaError("INVALID_STATE", `postSend needs the QP in RTS (state ${this.state}); connect() first`, { errno: "EINVAL" });
    }
    try {
      for (let i = 0; i < wrs.length; i++) {
        const e = this.makeEntry(wrs[i]!, i);
        if (this.sq.length - this.sqHead >= this.caps.maxSendWr) {
          throw new RdmaError("RESOURCE_EXHAUSTED", `work request #${i}: send queue full (${this.caps.maxSendWr} outstanding)`, { errno: "ENOMEM" });
        }
        this.sq.push(e);
        if (this.state === QpState.ERR) {
          e.state = ENTRY_DONE;
          e.status = WcStatus.WR_FLUSH_ERR;
        }
      }
    } finally {
      // WRs before a bad one stay posted, as with verbs' bad_wr.
      if (this.state === QpState.ERR) this.completeInOrder();
      else this.pump();
    }
  }

  postRecv(wrs: readonly RecvWr[]): void {
    this.checkAlive("postRecv");
    if (!Array.isArray(wrs)) throw new RdmaError("INVALID_ARGUMENT", "postRecv takes an array of work requests");
    if (this.state === QpState.RESET) throw new RdmaError("INVALID_STATE", "postRecv needs the QP in INIT or later", { errno: "EINVAL" });
    for (let i = 0; i < wrs.length; i++) {
      const wr = wrs[i]!;
      if (!wr || typeof wr.wrId !== "number") throw new RdmaError("INVALID_ARGUMENT", `receive work request #${i}: wrId must be a number`);
      const sges = this.copySges(wr.sgList, this.caps.maxRecvSge, i);
      if (this.rq.length - this.rqHead >= this.caps.maxRecvWr) {
        throw new RdmaError("RESOURCE_EXHAUSTED", `receive work request #${i}: receive queue full (${this.caps.maxRecvWr})`, { errno: "ENOMEM" });
      }
      if (this.state === QpState.ERR) {
        this.recvCq.push(wr.wrId, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0, 0, 0, this.qpNum);
        continue;
      }
      this.rq.push({ wrId: wr.wrId, sges });
    }
  }

  private copySges(list: readonly Sge[] | undefined, max: number, i: number): Sge[] {
    if (list === undefined) return [];
    if (!Array.isArray(list) || list.length > max) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: sgList must be an array of at most ${max} entries`);
    const out: Sge[] = [];
    for (const s of list) {
      if (!s || !Number.isSafeInteger(s.addr) || s.addr < 0 || !Number.isInteger(s.length) || s.length < 0 || s.length > MAX_MESSAGE || !Number.isInteger(s.lkey) || s.lkey < 0 || s.lkey > 0xffffffff) {
        throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: bad scatter/gather element`);
      }
      out.push({ addr: s.addr, length: s.length, lkey: s.lkey >>> 0 });
    }
    return out;
  }

  private makeEntry(wr: SendWr, i: number): SqEntry {
    if (!wr || typeof wr.wrId !== "number") throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: wrId must be a number`);
    const op = wr.opcode;
    if (WC_OF_WR[op] === undefined) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: unknown opcode ${String(op)}`);
    const flags = wr.flags ?? 0;
    if (!Number.isInteger(flags) || flags < 0 || flags & ~(SendFlags.FENCE | SendFlags.SIGNALED | SendFlags.SOLICITED | SendFlags.INLINE)) {
      throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: unknown send flags ${String(flags)}`);
    }
    if (wr.imm !== undefined && (!Number.isInteger(wr.imm) || wr.imm < 0 || wr.imm > 0xffffffff)) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: imm must be a u32`);
    const needsRemote = op === WrOpcode.RDMA_WRITE || op === WrOpcode.RDMA_WRITE_WITH_IMM || op === WrOpcode.RDMA_READ || op === WrOpcode.ATOMIC_CMP_AND_SWP || op === WrOpcode.ATOMIC_FETCH_AND_ADD;
    if (needsRemote && (wr.remoteAddr === undefined || wr.rkey === undefined)) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: this opcode needs remoteAddr and rkey`);
    if (wr.rkey !== undefined && (!Number.isInteger(wr.rkey) || wr.rkey < 0 || wr.rkey > 0xffffffff)) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: rkey must be a u32`);
    if (op === WrOpcode.LOCAL_INV && (!Number.isInteger(wr.invalidateRkey) || wr.invalidateRkey! < 0 || wr.invalidateRkey! > 0xffffffff)) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: LOCAL_INV needs invalidateRkey (u32)`);
    const sges = this.copySges(wr.sgList, this.caps.maxSendSge, i);
    let len = 0;
    for (const s of sges) len += s.length;
    if (len > MAX_MESSAGE) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: message of ${len} bytes exceeds 2^31`);
    const e: SqEntry = {
      wrId: wr.wrId,
      opcode: op,
      signaled: this.sqSigAll || (flags & SendFlags.SIGNALED) !== 0,
      fence: (flags & SendFlags.FENCE) !== 0,
      sges,
      len,
      inline: null,
      imm: (wr.imm ?? 0) >>> 0,
      hasImm: op === WrOpcode.SEND_WITH_IMM || op === WrOpcode.RDMA_WRITE_WITH_IMM,
      solicited: (flags & SendFlags.SOLICITED) !== 0,
      remoteAddr: wr.remoteAddr ?? 0,
      rkey: (wr.rkey ?? 0) >>> 0,
      compareAdd: wr.compareAdd ?? 0n,
      swap: wr.swap ?? 0n,
      mw: null,
      bindRkey: 0,
      bindMr: null,
      bindAddr: 0,
      bindLen: 0,
      bindAccess: 0,
      invalidateRkey: (wr.invalidateRkey ?? 0) >>> 0,
      psn: -1,
      state: ENTRY_QUEUED,
      status: WcStatus.SUCCESS,
      rnrTries: 0,
      targets: null,
      guard: null,
    };
    switch (op) {
      case WrOpcode.RDMA_WRITE:
      case WrOpcode.RDMA_WRITE_WITH_IMM:
      case WrOpcode.RDMA_READ:
        if (!Number.isSafeInteger(e.remoteAddr) || e.remoteAddr < 0) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: remoteAddr must be a non-negative integer`);
        break;
      case WrOpcode.ATOMIC_CMP_AND_SWP:
      case WrOpcode.ATOMIC_FETCH_AND_ADD:
        if (sges.length !== 1 || len !== 8) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: an atomic needs one 8-byte scatter/gather element`);
        if (typeof e.compareAdd !== "bigint" || typeof e.swap !== "bigint") throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: atomic operands must be bigint`);
        if (!Number.isSafeInteger(e.remoteAddr) || e.remoteAddr < 0) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: remoteAddr must be a non-negative integer`);
        break;
      case WrOpcode.BIND_MW: {
        const b = wr.bind;
        if (!(wr.mw instanceof TcpMw) || !b || !(b.mr instanceof TcpMr) || !Number.isInteger(wr.bindRkey) || !Number.isSafeInteger(b.addr) || !Number.isInteger(b.length) || !Number.isInteger(b.access)) {
          throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: BIND_MW needs a memory window, bindRkey and bind { mr, addr, length, access }`);
        }
        e.mw = wr.mw as TcpMw;
        e.bindRkey = wr.bindRkey! >>> 0;
        e.bindMr = b.mr as TcpMr;
        e.bindAddr = b.addr;
        e.bindLen = b.length;
        e.bindAccess = b.access;
        break;
      }
      default:
        break;
    }
    if (flags & SendFlags.INLINE && (op === WrOpcode.SEND || op === WrOpcode.SEND_WITH_IMM || op === WrOpcode.RDMA_WRITE || op === WrOpcode.RDMA_WRITE_WITH_IMM)) {
      if (len > this.caps.maxInlineData) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: ${len} inline bytes exceed maxInlineData ${this.caps.maxInlineData}`, { errno: "EINVAL" });
      // Inline data is copied now: the caller may reuse its buffer as soon as postSend returns.
      const data = new Uint8Array(len);
      let o = 0;
      for (const s of sges) {
        const v = this.localView(s, false);
        if (v === null) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: inline scatter/gather element is not inside a registered MR`);
        data.set(v, o);
        o += s.length;
      }
      e.inline = data;
    }
    return e;
  }

  /** The MRs the last localView() calls resolved to (for placement guards). */
  private resolved: TcpMr[] = [];

  /** The bytes an SGE names, or null for a local protection error. */
  private localView(s: Sge, needWrite: boolean): Uint8Array | null {
    if (s.length === 0) return new Uint8Array(0);
    const t = this.device.keys.get(s.lkey);
    if (!t || !("lkey" in t) || t.lkey !== s.lkey || t.pd !== this.pd || t.deregistered) return null;
    this.resolved.push(t);
    if (needWrite && !(t.access & Access.LOCAL_WRITE)) return null;
    const off = s.addr - t.addr;
    if (off < 0 || off + s.length > t.length) return null;
    return t.view.subarray(off, off + s.length);
  }

  // -------------------------------------------------------------- requester

  private pump(): void {
    const sock = this.reqSock;
    if (this.state !== QpState.RTS || sock === null || this.drainWait || this.rnrWait !== null || this.pendingLocalError) return;
    // The ACK timer measures from the first request after an idle period, not from the last response.
    const wasIdle = this.firstSent() === null;
    // One writev for the whole posted list: the tcp provider's "one doorbell" (per-WR corks nest inside).
    sock.cork();
    try {
      this.pumpLoop(sock);
    } finally {
      sock.uncork();
    }
    if (this.wrotePending) {
      this.wrotePending = false;
      if (wasIdle) this.lastProgress = performance.now();
      this.armAckTimer();
    }
    this.completeInOrder();
  }

  private wrotePending = false;

  private pumpLoop(sock: net.Socket): void {
    let wrote = false;
    while (this.txIdx < this.sq.length) {
      const e = this.sq[this.txIdx]!;
      if (e.state === ENTRY_DONE) {
        this.txIdx++;
        continue;
      }
      const isRd = e.opcode === WrOpcode.RDMA_READ || e.opcode === WrOpcode.ATOMIC_CMP_AND_SWP || e.opcode === WrOpcode.ATOMIC_FETCH_AND_ADD;
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
      if (sock.writableNeedDrain) {
        this.drainWait = true;
        break;
      }
    }
    if (wrote) this.wrotePending = true;
  }

  /**
   * The ACK owed to the peer, taken for the request header about to be written
   * (-1: none to carry). Only called right before the header is written, so a
   * request that does not go out (flow control, RNR wait) never swallows it.
   */
  private takePiggyback(sock: net.Socket): number {
    const p = this.ackPending;
    if (p < 0 || sock.writableLength > PIGGYBACK_MAX_QUEUED) return -1;
    this.clearAckOwed();
    this.counters.piggybackedAcks++;
    return p;
  }

  private transmit(sock: net.Socket, e: SqEntry, isRd: boolean): boolean {
    let flags = (e.hasImm ? FrameFlags.IMM : 0) | (e.solicited ? FrameFlags.SOLICITED : 0);
    if (isRd) {
      const targets: Uint8Array[] = [];
      this.resolved = [];
      for (const s of e.sges) {
        const v = this.localView(s, true);
        if (v === null) return false;
        targets.push(v);
      }
      e.targets = targets;
      e.guard = mrsAlive(this.resolved);
      this.counters.requests++;
      if (e.opcode === WrOpcode.RDMA_READ) {
        const ack = this.takePiggyback(sock);
        sock.write(encodeHeader(FrameType.READ_REQ, ack >= 0 ? FrameFlags.ACK : 0, e.psn, 0, e.rkey, e.remoteAddr, 0, e.len, 0n, ack >= 0 ? BigInt(ack) : 0n));
      } else {
        // An atomic's operand2 is its swap value: no room for an ACK.
        const op = e.opcode === WrOpcode.ATOMIC_CMP_AND_SWP ? 0 : 1;
        sock.write(encodeHeader(FrameType.ATOMIC, 0, e.psn, 0, e.rkey, e.remoteAddr, 0, op, e.compareAdd, e.swap));
      }
      return true;
    }
    const type = e.opcode === WrOpcode.SEND || e.opcode === WrOpcode.SEND_WITH_IMM ? FrameType.SEND : FrameType.WRITE;
    let views: Uint8Array[] | null = null;
    if (e.inline === null) {
      views = [];
      this.resolved = [];
      for (const s of e.sges) {
        const v = this.localView(s, false);
        if (v === null) return false;
        if (v.length > 0) views.push(v);
      }
    }
    this.counters.requests++;
    const ack = this.takePiggyback(sock);
    if (ack >= 0) flags |= FrameFlags.ACK;
    // Header and payload go out as one writev (cork), the payload straight from the registered memory.
    sock.cork();
    sock.write(encodeHeader(type, flags, e.psn, e.len, e.rkey, e.remoteAddr, e.imm, 0, 0n, ack >= 0 ? BigInt(ack) : 0n));
    if (e.inline !== null) {
      if (e.inline.length > 0) sock.write(e.inline);
    } else {
      // Each MR stays allocated until the kernel has copied its bytes, even if deregistered meanwhile.
      for (let i = 0; i < views!.length; i++) {
        const mr = this.resolved[i]!;
        mr.retainForWrite();
        sock.write(views![i]!, mr.writeDone);
      }
    }
    sock.uncork();
    return true;
  }

  private executeLocal(e: SqEntry): void {
    e.state = ENTRY_DONE;
    if (e.opcode === WrOpcode.BIND_MW) {
      const mw = e.mw!;
      const mr = e.bindMr!;
      if (
        mw.deallocated ||
        mw.pd !== this.pd ||
        mw.type !== 2 ||
        !mr ||
        mr.deregistered ||
        mr.pd !== this.pd ||
        !(mr.access & Access.MW_BIND) ||
        e.bindRkey >>> 8 !== mw.nextRkey() >>> 8 ||
        e.bindAddr < mr.addr ||
        e.bindAddr + e.bindLen > mr.addr + mr.length ||
        (e.bindAccess & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) && !(mr.access & Access.LOCAL_WRITE))
      ) {
        e.status = WcStatus.MW_BIND_ERR;
        return;
      }
      if (mw.qp) mw.qp.boundWindows.delete(mw);
      mw.bind(this, e.bindRkey, mr, e.bindAddr, e.bindLen, e.bindAccess);
      this.boundWindows.add(mw);
      return;
    }
    // LOCAL_INV of a type-2 window's rkey
    const t = this.device.keys.get(e.invalidateRkey);
    if (!t || "lkey" in t || t.pd !== this.pd || t.type !== 2) {
      e.status = WcStatus.LOC_PROT_ERR;
      return;
    }
    this.boundWindows.delete(t);
    t.unbind();
  }

  private completeInOrder(): void {
    while (this.sqHead < this.sq.length) {
      const e = this.sq[this.sqHead]!;
      if (e.state !== ENTRY_DONE) break;
      this.sqHead++;
      if (e.signaled || e.status !== WcStatus.SUCCESS) {
        const byteLen = e.opcode === WrOpcode.ATOMIC_CMP_AND_SWP || e.opcode === WrOpcode.ATOMIC_FETCH_AND_ADD ? 8 : e.opcode === WrOpcode.RDMA_READ ? e.len : 0;
        this.sendCq.push(e.wrId, e.status, WC_OF_WR[e.opcode]!, 0, byteLen, 0, this.qpNum);
      }
      if (e.status !== WcStatus.SUCCESS && e.status !== WcStatus.WR_FLUSH_ERR) {
        if (this.pendingLocalError === e) this.pendingLocalError = null;
        this.enterError(`work request ${e.wrId} failed with status ${e.status}`, false);
      }
    }
    if (this.ackIdx < this.sqHead) this.ackIdx = this.sqHead;
    if (this.sqHead > 1024 && this.sqHead * 2 > this.sq.length) {
      this.sq = this.sq.slice(this.sqHead);
      this.txIdx -= this.sqHead;
      this.ackIdx -= this.sqHead;
      this.sqHead = 0;
    }
  }

  /** The oldest transmitted, unfinished entry. */
  private firstSent(): SqEntry | null {
    while (this.ackIdx < this.txIdx) {
      const e = this.sq[this.ackIdx]!;
      if (e.state === ENTRY_SENT) return e;
      this.ackIdx++;
    }
    return null;
  }

  /** Everything sent before `psn` that needs no response is acknowledged (a NAK or response implies it). */
  private ackBefore(psn: number, inclusive: boolean): void {
    for (let i = this.ackIdx; i < this.txIdx; i++) {
      const e = this.sq[i]!;
      if (e.state !== ENTRY_SENT) continue;
      const before = psnBefore(e.psn, psn) || (inclusive && e.psn === psn);
      if (!before) break;
      if (isReadOrAtomic(e.opcode)) {
        // A response that never came, yet later requests were acknowledged: the responder broke the protocol.
        this.protocolError("requester", `acknowledgement for PSN ${psn} skips the response to PSN ${e.psn}`);
        return;
      }
      e.state = ENTRY_DONE;
    }
  }

  /**
   * A cumulative ACK piggybacked on one of the peer's requests. It came on the
   * other stream than the responses, so it may overtake the response to a READ
   * or atomic: complete up to the first such unanswered entry and remember the
   * PSN; onResponseDone carries on from there (ackToMark).
   */
  private onPiggybackedAck(psn: number): void {
    this.counters.piggybackedAcksReceived++;
    if (!psnBefore(psn, this.nextPsn)) {
      return this.protocolError("requester", `piggybacked ACK for PSN ${psn}, which was never sent (next PSN ${this.nextPsn})`, "responder");
    }
    this.lastProgress = performance.now();
    if (this.ackMark < 0 || psnBefore(this.ackMark, psn)) this.ackMark = psn;
    if (!this.ackToMark()) this.counters.piggybackedAcksHeld++;
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
      const e = this.sq[i]!;
      if (e.state !== ENTRY_SENT) continue;
      if (psnBefore(mark, e.psn)) break;
      // Its response is still on the way on the other stream: keep the mark until it is in.
      if (isReadOrAtomic(e.opcode)) return false;
      e.state = ENTRY_DONE;
    }
    this.ackMark = -1;
    return true;
  }

  private onResponseHeader(h: FrameHeader): void {
    if (this.state !== QpState.RTS) {
      this.reqReader?.place(null);
      return;
    }
    if (!psnBefore(h.psn, this.nextPsn)) {
      const what = h.type === FrameType.ACK ? (h.aux === Syndrome.ACK ? "ACK" : "NAK") : "response";
      return this.protocolError("requester", `${what} for PSN ${h.psn}, which was never sent (next PSN ${this.nextPsn})`);
    }
    this.lastProgress = performance.now();
    switch (h.type) {
      case FrameType.ACK: {
        if (h.aux === Syndrome.ACK) {
          this.ackBefore(h.psn, true);
          this.completeInOrder();
          this.pump();
          return;
        }
        this.ackBefore(h.psn, false);
        if (this.state !== QpState.RTS) return;
        const e = this.firstSent();
        if (!e || e.psn !== h.psn) return this.protocolError("requester", `NAK for PSN ${h.psn} that is not outstanding`);
        if (h.aux === Syndrome.RNR_NAK) return this.onRnrNak(e, Number(h.op2));
        e.state = ENTRY_DONE;
        e.status = h.aux === Syndrome.NAK_REM_ACCESS ? WcStatus.REM_ACCESS_ERR : h.aux === Syndrome.NAK_INV_REQ ? WcStatus.REM_INV_REQ_ERR : WcStatus.REM_OP_ERR;
        this.completeInOrder();
        return;
      }
      case FrameType.READ_RESP:
      case FrameType.ATOMIC_RESP: {
        this.ackBefore(h.psn, false);
        if (this.state !== QpState.RTS) return;
        const e = this.firstSent();
        const want = h.type === FrameType.READ_RESP ? WrOpcode.RDMA_READ : -1;
        if (!e || e.psn !== h.psn || (want >= 0 ? e.opcode !== want : e.opcode !== WrOpcode.ATOMIC_CMP_AND_SWP && e.opcode !== WrOpcode.ATOMIC_FETCH_AND_ADD)) {
          return this.protocolError("requester", `response for PSN ${h.psn} matches no outstanding request`);
        }
        if (h.type === FrameType.READ_RESP) {
          if (h.payloadLen !== e.len) return this.protocolError("requester", `read response of ${h.payloadLen} bytes for a ${e.len}-byte read`);
          this.reqReader!.place(e.targets, e.guard);
        }
        this.respTargetEntry = e;
        return;
      }
      default:
        return this.protocolError("requester", `unexpected frame type ${h.type} on the requester stream`);
    }
  }

  private onResponseDone(h: FrameHeader): void {
    const e = this.respTargetEntry;
    if (e === null || this.state !== QpState.RTS) return;
    this.respTargetEntry = null;
    if (h.type === FrameType.ATOMIC_RESP) {
      const t = e.targets![0]!;
      // The original value lands in host byte order (little-endian), as an HCA writes it.
      new DataView(t.buffer, t.byteOffset, 8).setBigUint64(0, h.op1, true);
    }
    e.state = ENTRY_DONE;
    e.targets = null;
    this.outstandingRd--;
    // A piggybacked ACK that overtook this response may now apply past it.
    this.ackToMark();
    this.completeInOrder();
    this.pump();
  }

  /** A READ's local target was deregistered while the response arrived: local protection error. */
  private onResponseRevoked(): void {
    const e = this.respTargetEntry;
    if (e === null || this.state !== QpState.RTS) return;
    this.respTargetEntry = null;
    e.state = ENTRY_DONE;
    e.status = WcStatus.LOC_PROT_ERR;
    e.targets = null;
    this.outstandingRd--;
    this.completeInOrder();
  }

  private onRnrNak(e: SqEntry, timerCode: number): void {
    e.rnrTries++;
    if (this.rnrRetry !== 7 && e.rnrTries > this.rnrRetry) {
      e.state = ENTRY_DONE;
      e.status = WcStatus.RNR_RETRY_EXC_ERR;
      this.completeInOrder();
      return;
    }
    // Go back N: the responder discards everything after the NAKed PSN; resend from it after the RNR timer.
    const idx = this.sq.indexOf(e, this.ackIdx);
    for (let i = idx; i < this.txIdx; i++) {
      const x = this.sq[i]!;
      if (x.state === ENTRY_SENT) x.state = ENTRY_QUEUED;
    }
    this.txIdx = idx;
    this.outstandingRd = 0;
    const ms = rnrTimerMs(timerCode);
    this.rnrWait = setTimeout(() => {
      this.rnrWait = null;
      this.lastProgress = performance.now();
      this.pump();
    }, ms);
  }

  /** How long the requester waits without progress from the peer: max(timeout × (retryCnt+1), livenessMs). */
  private noProgressLimit(): number {
    if (this.timeoutMs === Infinity) return Infinity;
    return Math.max(this.timeoutMs * (this.retryCnt + 1), this.livenessMs);
  }

  private armAckTimer(): void {
    if (this.ackTimer !== null || this.ackConfirm !== null || this.timeoutMs === Infinity) return;
    const limit = this.noProgressLimit();
    const tick = Math.max(1, Math.min(this.timeoutMs, limit / 4));
    const stallCredit = Math.min(STALL_CREDIT_MS, limit / 4);
    let prev = performance.now();
    const check = (): void => {
      this.ackTimer = null;
      this.ackConfirm = null;
      // A tick that comes late means our own event loop did not run (blocked, descheduled): the peer
      // could not be heard meanwhile, so that time does not count against it.
      const now = performance.now();
      const late = now - prev - tick;
      if (late > stallCredit) this.lastProgress = Math.min(now, this.lastProgress + late);
      prev = now;
      if (this.state !== QpState.RTS) return;
      if (this.firstSent() === null) return;
      if (this.rnrWait === null && performance.now() - this.lastProgress >= limit) {
        // Timers run before I/O in a turn: after a stall of our own event loop the peer's answer may be
        // waiting in the socket. Read it first (the poll phase runs before setImmediate), then judge.
        // (Not unref'd: an unref'd immediate does not stop the poll phase from blocking, so it could wait for unrelated I/O.)
        this.ackConfirm = setImmediate(confirm);
        return;
      }
      this.ackTimer = setTimeout(check, tick);
      this.ackTimer.unref();
    };
    const confirm = (): void => {
      this.ackConfirm = null;
      if (this.state !== QpState.RTS) return;
      const e = this.firstSent();
      if (e === null) return;
      if (this.rnrWait === null && performance.now() - this.lastProgress >= limit) {
        e.state = ENTRY_DONE;
        e.status = WcStatus.RETRY_EXC_ERR;
        const why = this.livenessMs > this.timeoutMs * (this.retryCnt + 1) ? `livenessMs ${this.livenessMs}` : `timeout ${this.timeoutMs.toFixed(1)} ms × ${this.retryCnt + 1} tries`;
        this.enterError(`no response from the peer within ${limit.toFixed(0)} ms (${why}; its streams are still open)`, true, "QP_FATAL");
        return;
      }
      prev = performance.now();
      this.ackTimer = setTimeout(check, tick);
      this.ackTimer.unref();
    };
    this.ackTimer = setTimeout(check, tick);
    this.ackTimer.unref();
  }

  // -------------------------------------------------------------- responder

  private respond(type: FrameType, psn: number, aux: number, op1: bigint, op2: bigint, payload: Uint8Array | null, from: TcpMr | null = null): void {
    const s = this.respSock;
    if (!s || s.destroyed) return;
    // READ/atomic responses hold a responder resource until the kernel has them (see maxDestRdAtomic).
    const resource = type === FrameType.READ_RESP || type === FrameType.ATOMIC_RESP;
    if (resource) this.respUnflushed++;
    if (payload && payload.length > 0) {
      s.cork();
      s.write(encodeHeader(type, 0, psn, payload.length, 0, 0, 0, aux, op1, op2));
      if (from) {
        from.retainForWrite();
        s.write(
          payload,
          resource
            ? () => {
                from.writeDone();
                this.respFlushed();
              }
            : from.writeDone,
        );
      } else s.write(payload, resource ? this.respFlushed : undefined);
      s.uncork();
    } else {
      s.write(encodeHeader(type, 0, psn, 0, 0, 0, 0, aux, op1, op2), resource ? this.respFlushed : undefined);
    }
  }

  private readonly respFlushed = (): void => {
    this.respUnflushed--;
  };

  /**
   * Back-pressure on the responder: while more than RESP_PAUSE_BYTES of
   * responses and ACKs wait in user space for a peer that does not read them,
   * its request stream is not read either ('drain' resumes it).
   */
  private throttleRequests(sock: net.Socket): void {
    if (!this.respPaused && sock.writableLength > RESP_PAUSE_BYTES && this.state === QpState.RTS) {
      this.respPaused = true;
      this.counters.requestPauses++;
      sock.pause();
    }
  }

  private flushAck(): void {
    if (this.ackPending >= 0) {
      const p = this.ackPending;
      this.clearAckOwed();
      this.counters.acks++;
      this.respond(FrameType.ACK, p, Syndrome.ACK, 0n, 0n, null);
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
    setImmediate(this.ackAtTurnEnd);
  }

  /**
   * Mid-payload of a long request: tell the requester we are alive, at most
   * every PROGRESS_INTERVAL_MS, with the ACK we owe or else a duplicate of the
   * last cumulative ACK (ePsn - 1: everything before the current request is
   * placed and its responses are already queued ahead on this stream).
   */
  private signalProgress(h: FrameHeader): void {
    if (this.respDiscard || this.state !== QpState.RTS || h.payloadLen < PROGRESS_MIN_PAYLOAD) return;
    const now = performance.now();
    if (now - this.progressAt < PROGRESS_INTERVAL_MS) return;
    this.progressAt = now;
    this.counters.progressAcks++;
    if (this.ackPending >= 0) this.flushAck();
    else this.respond(FrameType.ACK, (this.ePsn - 1) & PSN_MASK, Syndrome.ACK, 0n, 0n, null);
  }

  private readonly ackAtTurnEnd = (): void => {
    this.ackScheduled = false;
    if (this.state === QpState.RTS) this.flushAck();
  };

  /** NAK and move the responder to ERR (class C/D errors in IBA terms). */
  private nak(psn: number, syndrome: number, reason: string): void {
    this.flushAck();
    this.respond(FrameType.ACK, psn, syndrome, 0n, 0n, null);
    this.respReader?.place(null);
    this.respDiscard = true;
    this.enterError(reason, true);
  }

  private remoteGuard: (() => boolean) | null = null;
  private remoteMr: TcpMr | null = null;

  /** Resolve a remote access: the bytes, or null after sending the NAK. */
  private remoteView(h: FrameHeader, len: number, need: number): Uint8Array | null {
    if (len === 0) return new Uint8Array(0);
    const t = this.device.keys.get(h.rkey);
    let view: Uint8Array | null = null;
    this.remoteGuard = null;
    this.remoteMr = null;
    if (t && t.pd === this.pd) {
      if ("lkey" in t) {
        const off = h.raddr - t.addr;
        if (!t.deregistered && t.access & need && off >= 0 && off + len <= t.length) {
          view = t.view.subarray(off, off + len);
          this.remoteMr = t;
          this.remoteGuard = () => !t.deregistered;
        }
      } else if (t.mr && (t.type === 1 || t.qp === this) && t.access & need && h.raddr >= t.addr && h.raddr + len <= t.addr + t.length) {
        const off = h.raddr - t.mr.addr;
        view = t.mr.view.subarray(off, off + len);
        const mr = t.mr;
        this.remoteMr = mr;
        const key = h.rkey;
        // The window may be invalidated or its MR deregistered mid-payload.
        this.remoteGuard = () => !mr.deregistered && t.rkey === key;
      }
    }
    if (view === null) this.nak(h.psn, Syndrome.NAK_REM_ACCESS, `remote access denied: rkey 0x${h.rkey.toString(16)} [0x${h.raddr.toString(16)}, +${len})`);
    return view;
  }

  private takeRecv(h: FrameHeader, len: number): RqEntry | null | "rnr" {
    if (this.rqHead >= this.rq.length) {
      // Receiver not ready: NAK with our RNR timer; the requester resends from this PSN.
      this.flushAck();
      this.respond(FrameType.ACK, h.psn, Syndrome.RNR_NAK, 0n, BigInt(this.minRnrTimer), null);
      this.rnrNakPsn = h.psn;
      this.respReader?.place(null);
      return "rnr";
    }
    const r = this.rq[this.rqHead++]!;
    if (this.rqHead > 1024 && this.rqHead * 2 > this.rq.length) {
      this.rq = this.rq.slice(this.rqHead);
      this.rqHead = 0;
    }
    let cap = 0;
    for (const s of r.sges) cap += s.length;
    if (len > cap) {
      this.recvCq.push(r.wrId, WcStatus.LOC_LEN_ERR, WcOpcode.RECV, 0, 0, 0, this.qpNum);
      this.nak(h.psn, Syndrome.NAK_INV_REQ, `a ${len}-byte message does not fit the ${cap}-byte receive buffer`);
      return null;
    }
    return r;
  }

  private onRequestHeader(h: FrameHeader): void {
    const reader = this.respReader!;
    // The ACK for our own requests counts even when the request carrying it is discarded (RNR, ERR).
    if (h.flags & FrameFlags.ACK && this.state === QpState.RTS) this.onPiggybackedAck(Number(h.op2));
    if (this.state !== QpState.RTS) {
      reader.place(null);
      this.respDiscard = true;
      return;
    }
    if (this.rnrNakPsn >= 0) {
      if (h.psn !== this.rnrNakPsn) {
        reader.place(null);
        this.respDiscard = true;
        return;
      }
      this.rnrNakPsn = -1;
    }
    if (h.psn !== this.ePsn) return this.protocolError("responder", `PSN ${h.psn} out of sequence (expected ${this.ePsn})`);
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
        const targets: Uint8Array[] = [];
        let left = h.payloadLen;
        this.resolved = [];
        for (const s of r.sges) {
          if (left === 0) break;
          const v = this.localView(s, true);
          if (v === null) {
            this.recvCq.push(r.wrId, WcStatus.LOC_PROT_ERR, WcOpcode.RECV, 0, 0, 0, this.qpNum);
            return this.nak(h.psn, Syndrome.NAK_REM_OP, "receive buffer is not inside a registered MR with LOCAL_WRITE");
          }
          const take = Math.min(left, v.length);
          targets.push(take === v.length ? v : v.subarray(0, take));
          left -= take;
        }
        this.curRecv = r;
        reader.place(targets, mrsAlive(this.resolved));
        return;
      }
      case FrameType.WRITE: {
        if (!(this.qpAccess & Access.REMOTE_WRITE)) return this.nak(h.psn, Syndrome.NAK_INV_REQ, "QP does not allow remote write");
        const v = this.remoteView(h, h.payloadLen, Access.REMOTE_WRITE);
        if (v === null) return;
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
        reader.place([v], this.remoteGuard);
        return;
      }
      case FrameType.READ_REQ: {
        if (!this.responderResource(h)) return;
        if (!(this.qpAccess & Access.REMOTE_READ)) return this.nak(h.psn, Syndrome.NAK_INV_REQ, "QP does not allow remote read");
        const v = this.remoteView(h, h.aux, Access.REMOTE_READ);
        if (v === null) return;
        // The response acknowledges everything before it.
        this.clearAckOwed();
        this.respond(FrameType.READ_RESP, h.psn, 0, 0n, 0n, v, this.remoteMr);
        return;
      }
      case FrameType.ATOMIC: {
        if (!this.responderResource(h)) return;
        if (!(this.qpAccess & Access.REMOTE_ATOMIC)) return this.nak(h.psn, Syndrome.NAK_INV_REQ, "QP does not allow remote atomics");
        // IBA: atomics need an 8-byte aligned target; rxe answers a misaligned one with NAK invalid request.
        if (h.raddr % 8 !== 0) return this.nak(h.psn, Syndrome.NAK_INV_REQ, `atomic target 0x${h.raddr.toString(16)} is not 8-byte aligned`);
        const v = this.remoteView(h, 8, Access.REMOTE_ATOMIC);
        if (v === null) return;
        const dv = new DataView(v.buffer, v.byteOffset, 8);
        const orig = dv.getBigUint64(0, true);
        if (h.aux === 0) {
          if (orig === h.op1) dv.setBigUint64(0, h.op2, true);
        } else dv.setBigUint64(0, BigInt.asUintN(64, orig + h.op1), true);
        this.clearAckOwed();
        this.respond(FrameType.ATOMIC_RESP, h.psn, 0, orig, 0n, null);
        return;
      }
      default:
        return this.protocolError("responder", `unexpected frame type ${h.type} on the responder stream`);
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
  private responderResource(h: FrameHeader): boolean {
    if (this.respUnflushed < this.maxDestRdAtomic) return true;
    this.nak(
      h.psn,
      Syndrome.NAK_INV_REQ,
      this.maxDestRdAtomic === 0
        ? "RDMA READ/atomic request, but this QP has no responder resources (maxDestRdAtomic 0)"
        : `more RDMA READ/atomic requests outstanding than maxDestRdAtomic ${this.maxDestRdAtomic} (${this.respUnflushed} responses not yet taken by the peer)`,
    );
    return false;
  }

  /** The target of an incoming WRITE/SEND went away mid-payload: remote access error, as an HCA would answer. */
  private onRequestRevoked(h: FrameHeader): void {
    if (this.respDiscard || this.state !== QpState.RTS) return;
    if (this.curRecv) this.recvCq.push(this.curRecv.wrId, WcStatus.LOC_PROT_ERR, WcOpcode.RECV, 0, 0, 0, this.qpNum);
    this.curRecv = null;
    this.nak(h.psn, h.type === FrameType.SEND ? Syndrome.NAK_REM_OP : Syndrome.NAK_REM_ACCESS, "target memory was deregistered while its data arrived");
  }

  private onRequestDone(h: FrameHeader): void {
    if (this.respDiscard || this.state !== QpState.RTS) return;
    this.ePsn = (this.ePsn + 1) & PSN_MASK;
    const r = this.curRecv;
    if (r !== null) {
      this.curRecv = null;
      const imm = h.flags & FrameFlags.IMM ? h.imm : 0;
      const flags = h.flags & FrameFlags.IMM ? WcFlags.WITH_IMM : 0;
      const op = this.curWriteImm ? WcOpcode.RECV_RDMA_WITH_IMM : WcOpcode.RECV;
      this.recvCq.push(r.wrId, WcStatus.SUCCESS, op, flags, h.payloadLen, imm, this.qpNum);
    }
    if (h.type === FrameType.SEND || h.type === FrameType.WRITE) {
      this.ackPending = h.psn;
      this.ackOwedRequests++;
    }
  }

  // ----------------------------------------------------------------- errors

  private emit(type: AsyncEventType, reason: string): void {
    const h = this.onEvent;
    if (h) queueMicrotask(() => h({ type, reason, qpNum: this.qpNum }));
  }

  /** A malformed or hostile frame: ERR with a reason; never touches memory it should not. */
  private protocolError(side: "requester" | "responder", reason: string, stream: "requester" | "responder" = side): void {
    if (this.state === QpState.ERR) return;
    if (side === "requester") {
      const e = this.firstSent();
      if (e) {
        e.state = ENTRY_DONE;
        e.status = WcStatus.BAD_RESP_ERR;
      }
    }
    this.enterError(`malformed frame from peer on the ${stream} stream: ${reason}`, true, "QP_FATAL");
  }

  private connectionLost(reason: string): void {
    if (this.state === QpState.ERR || this.state === QpState.RESET) return;
    // The oldest WR that went out at least once (also one waiting out an RNR timer) reports why.
    const e = this.oldestStarted();
    if (e) {
      e.state = ENTRY_DONE;
      e.status = WcStatus.RETRY_EXC_ERR;
    }
    this.enterError(reason, true, "QP_FATAL");
  }

  private oldestStarted(): SqEntry | null {
    for (let i = this.sqHead; i < this.sq.length; i++) {
      const e = this.sq[i]!;
      if (e.state === ENTRY_DONE) continue;
      return e.psn >= 0 ? e : null;
    }
    return null;
  }

  fatal(type: AsyncEventType, reason: string): void {
    this.enterError(reason, true, type);
  }

  setError(): void {
    this.checkAlive("setError");
    // Requests this side accepted stay acknowledged (a NIC ACKs them on arrival).
    if (this.state === QpState.RTS || this.state === QpState.RTR) this.flushAck();
    this.enterError("moved to ERR by the application", false);
  }

  private enterError(reason: string, notify: boolean, type: AsyncEventType = "QP_FATAL"): void {
    if (this.state === QpState.ERR) return;
    this.state = QpState.ERR;
    if (this.rnrWait) clearTimeout(this.rnrWait);
    this.rnrWait = null;
    if (this.ackTimer) clearTimeout(this.ackTimer);
    this.ackTimer = null;
    if (this.ackConfirm) clearImmediate(this.ackConfirm);
    this.ackConfirm = null;
    this.ackMark = -1;
    // Flush: every unfinished WR completes with WR_FLUSH_ERR, in order.
    for (let i = this.sqHead; i < this.sq.length; i++) {
      const e = this.sq[i]!;
      if (e.state !== ENTRY_DONE) {
        e.state = ENTRY_DONE;
        e.status = WcStatus.WR_FLUSH_ERR;
      }
    }
    this.pendingLocalError = null;
    this.completeInOrder();
    for (let i = this.rqHead; i < this.rq.length; i++) this.recvCq.push(this.rq[i]!.wrId, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0, 0, 0, this.qpNum);
    this.rq = [];
    this.rqHead = 0;
    // The peer learns at once (its streams close) instead of after its ACK timeout.
    // Finish what we queued (a NAK, say), then stop reading: a peer that keeps streaming is not served.
    for (const sock of [this.reqSock, this.respSock]) {
      if (!sock) continue;
      sock.end(() => sock.destroy());
      // A peer that does not read would keep the stream (and what we queued) forever.
      setTimeout(() => sock.destroy(), ERR_LINGER_MS).unref();
    }
    for (const p of this.parked) p.sock.destroy();
    this.parked = [];
    if (notify) this.emit(type, reason);
  }

  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    if (this.device.qps.get(this.qpNum) !== this) return;
    // The ACK this side still owes goes out first: the peer's last requests
    // (e.g. a message sent just before its CLOSE) were accepted here, and a
    // live peer must see them complete, not retry into a closed stream.
    if (this.state === QpState.RTS || this.state === QpState.RTR) this.flushAck();
    const resp = this.respSock;
    if (resp && !resp.destroyed && resp.writableLength > 0) {
      // bytes still in user space: let them leave, bounded
      this.respSock = null;
      resp.end();
      setTimeout(() => resp.destroy(), 2000).unref();
    }
    this.state = QpState.ERR;
    if (this.rnrWait) clearTimeout(this.rnrWait);
    if (this.ackTimer) clearTimeout(this.ackTimer);
    if (this.ackConfirm) clearImmediate(this.ackConfirm);
    this.rnrWait = this.ackTimer = null;
    this.ackConfirm = null;
    for (const mw of this.boundWindows) mw.unbind();
    this.boundWindows.clear();
    this.reqSock?.destroy();
    this.respSock?.destroy();
    for (const p of this.parked) p.sock.destroy();
    this.reqSock = this.respSock = null;
    this.parked = [];
    this.sq = [];
    this.rq = [];
    this.device.qps.delete(this.qpNum);
    this.sendCq.qps.delete(this);
    this.recvCq.qps.delete(this);
    this.pd.released("qp");
  }
}
