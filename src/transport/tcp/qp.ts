/**
 * The tcp provider's RC queue pair: state transitions, wiring and errors.
 *
 * A QP is two halves on one TCP stream (see codec.ts): the requester
 * (requester.ts) and the responder (responder.ts). The stream's reader hands
 * requests to the responder and responses and ACKs to the requester. One
 * side dials (the lower endpoint, dialsFirst); the other waits for the
 * peer's stream, handed over by the device's port (accept.ts), at most the
 * device's HELLO deadline. This file keeps what belongs to the QP as a whole:
 *
 * - states: created in INIT (receives may be posted), RTS after connect(),
 *   ERR on any error; checks of the caps and the connection attributes;
 * - the posting entry points, after the shared checks of ../validate.ts;
 * - the stream: dialing the peer or waiting for it (with a deadline),
 *   parking a peer's stream that arrives before connect() (at most
 *   PARKED_MAX, only the one matching the peer's endpoint is adopted);
 * - error and flush: after any error every outstanding and later WR
 *   completes with WR_FLUSH_ERR, receives included, and the stream closes
 *   so the peer learns at once.
 */
import type * as net from "node:net";
import { RdmaError, checkInt } from "../../errors.js";
import { QpState, WcStatus, type AsyncEvent, type AsyncEventType, type Device, type Endpoint, type QpConnectAttr, type QpInitAttr, type QueuePair, type RecvWr, type SendWr } from "../types.js";
import { validateQpAccess, validateQpCaps, validateRecvWr, validateSendWr } from "../validate.js";
import { FrameType, ackTimeoutMs, encodeHeader, type DecodedHeader } from "./codec.js";
import { DIRECT_MIN, FrameReader } from "./frame-reader.js";
import type { TcpCq } from "./cq.js";
import { DEFAULT_LIVENESS_MS } from "./liveness.js";
import type { TcpMw } from "./memory.js";
import { PSN_MASK, type QpCore, type QpCounters, type QpPd, type Side, type TcpQpStats } from "./qp-core.js";
import { ReadPort, dialData } from "./read-path.js";
import { Requester } from "./requester.js";
import { Responder } from "./responder.js";

export type { TcpQpStats } from "./qp-core.js";

/**
 * After ERR the QP finishes writing what it queued (a NAK) before closing its
 * stream; a peer that does not read gets its stream destroyed after this long.
 */
const ERR_LINGER_MS = 2_000;

/**
 * Which side of a connection dials its one stream: the one whose endpoint
 * compares lower by QP number, then port, then initial PSN, then address.
 * Both sides compute it from the same two endpoints (the address comes last:
 * a wildcard address may reach the peer rewritten).
 */
export function dialsFirst(local: { qpNum: number; port: number; psn: number; gid: string }, remote: { qpNum: number; port: number; psn: number; gid: string }): boolean {
  if (local.qpNum !== remote.qpNum) return local.qpNum < remote.qpNum;
  if (local.port !== remote.port) return local.port < remote.port;
  if (local.psn !== remote.psn) return local.psn < remote.psn;
  return local.gid <= remote.gid;
}

/** Request frames go to the responder; responses, ACKs (and anything else, refused there) to the requester. */
function isRequest(type: number): boolean {
  return type === FrameType.SEND || type === FrameType.WRITE || type === FrameType.READ_REQ || type === FrameType.ATOMIC;
}
/** Streams a QP keeps parked before connect(): a stranger's HELLO must not evict the real peer's stream. */
const PARKED_MAX = 4;

export class TcpQueuePair implements QueuePair, QpCore {
  readonly pd: QpPd;
  readonly qpNum: number;
  state: QpState = QpState.RESET;
  readonly sendCq: TcpCq;
  readonly recvCq: TcpCq;
  readonly caps: { maxSendWr: number; maxRecvWr: number; maxSendSge: number; maxRecvSge: number; maxInlineData: number };
  onEvent: ((e: AsyncEvent) => void) | null = null;
  readonly boundWindows = new Set<TcpMw>();
  readonly counters: QpCounters = { requests: 0, acks: 0, piggybackedAcks: 0, piggybackedAcksReceived: 0, piggybackedAcksHeld: 0, progressAcks: 0, requestPauses: 0 };
  private readonly sqSigAll: boolean;
  private readonly req: Requester;

  /** RNR NAKs this QP answered with a retry. */
  get rnrRetries(): number {
    return this.req.rnrRetries;
  }
  private readonly resp: Responder;
  /** Streams that arrived before connect(): the one matching the peer's endpoint is adopted, the rest dropped. */
  private parked: { sock: net.Socket; port: ReadPort; srcQp: number; psn: number; rest: Buffer | null }[] = [];
  private remote: Endpoint | null = null;
  private destroyed = false;
  /** The QP's one stream (dialed, or the peer's adopted), null until it is up. */
  private sock: net.Socket | null = null;
  /** The stream's reader (both halves share it). */
  private reader: FrameReader | null = null;
  /** This side dials (dialsFirst); otherwise it waits for the peer's stream. */
  private dials = false;
  /** The waiting side's deadline for the peer's stream. */
  private waitTimer: NodeJS.Timeout | null = null;
  /** A byte arrived on the stream (the peer speaks this wire version). */
  private heard = false;

  /** Frame counters (a snapshot). */
  get stats(): TcpQpStats {
    return { ...this.counters };
  }

  // Tests look at these through a cast (test/tcp/hostile.test.ts, peer-death.test.ts; `sock` above too).
  private get rnrWait(): NodeJS.Timeout | null {
    return this.req.rnrWait;
  }

  constructor(pd: QpPd, init: QpInitAttr) {
    this.pd = pd;
    const device = pd.device;
    if (!init || typeof init !== "object") throw new RdmaError("INVALID_ARGUMENT", "createQp needs init attributes");
    this.sendCq = init.sendCq as TcpCq;
    this.recvCq = init.recvCq as TcpCq;
    const dev: Device = device;
    if (!this.sendCq || this.sendCq.device !== dev || !this.recvCq || this.recvCq.device !== dev) {
      throw new RdmaError("INVALID_ARGUMENT", "send and receive CQs must belong to the QP's device");
    }
    if (this.sendCq.destroyed || this.recvCq.destroyed) throw new RdmaError("INVALID_STATE", "cannot create a QP on a destroyed CQ", { errnoName: "EINVAL" });
    this.caps = validateQpCaps(init, device.attr);
    this.sqSigAll = init.sqSigAll === true;
    checkInt("portNum", init.portNum ?? 1, 1, 1);
    const access = validateQpAccess(init.access);
    this.req = new Requester(
      this,
      (sock) => this.resp.takePiggyback(sock),
      () => this.resp.requesterSent(),
    );
    this.resp = new Responder(
      this,
      access,
      (psn) => this.req.onPiggybackedAck(psn),
      () => this.req.awaitingPeer,
    );
    this.qpNum = device.allocQpn();
    device.qps.set(this.qpNum, this);
    this.sendCq.qps.add(this);
    this.recvCq.qps.add(this);
    this.state = QpState.INIT;
  }

  private checkAlive(what: string): void {
    if (this.destroyed) throw new RdmaError("INVALID_STATE", `${what}: QP ${this.qpNum} was destroyed`, { errnoName: "EINVAL" });
  }

  localEndpoint(attr: { portNum?: number; gidIndex?: number } = {}): Endpoint {
    this.checkAlive("localEndpoint");
    if (attr === null || typeof attr !== "object") throw new RdmaError("INVALID_ARGUMENT", "localEndpoint takes { portNum?, gidIndex? }");
    checkInt("portNum", attr.portNum ?? 1, 1, this.pd.device.attr.physPortCnt);
    // tcp has one address per device; the GID index is accepted (verbs programs pass one) and ignored.
    checkInt("gidIndex", attr.gidIndex ?? 0, 0, 255);
    return {
      provider: "tcp",
      qpNum: this.qpNum,
      psn: this.req.initialPsn,
      lid: 0,
      gid: this.pd.device.host,
      port: this.pd.device.port,
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
    const a = this.pd.device.attr;
    const timeoutMs = ackTimeoutMs(checkInt("timeout", attr.timeout ?? 14, 0, 31));
    const retryCnt = checkInt("retryCnt", attr.retryCnt ?? 7, 0, 7);
    const rnrRetry = checkInt("rnrRetry", attr.rnrRetry ?? 7, 0, 7);
    const minRnrTimer = checkInt("minRnrTimer", attr.minRnrTimer ?? 12, 0, 31);
    const maxRdAtomic = checkInt("maxRdAtomic", attr.maxRdAtomic ?? 16, 1, a.maxQpInitRdAtom);
    const maxDestRdAtomic = checkInt("maxDestRdAtomic", attr.maxDestRdAtomic ?? 16, 0, a.maxQpRdAtom);
    const livenessMs = checkInt("livenessMs", attr.livenessMs ?? DEFAULT_LIVENESS_MS, 0, 2 ** 31 - 1);
    this.req.configure({ timeoutMs, retryCnt, rnrRetry, maxRdAtomic, livenessMs });
    this.resp.configure(remote.psn, minRnrTimer, maxDestRdAtomic);
    this.remote = { ...remote };
    this.state = QpState.RTS;

    const device = this.pd.device;
    this.dials = dialsFirst({ qpNum: this.qpNum, port: device.port, psn: this.req.initialPsn, gid: device.host }, remote);
    const parked = this.parked;
    this.parked = [];
    if (this.dials) {
      for (const p of parked) p.sock.destroy();
      const port = new ReadPort();
      const sock = dialData(remote.gid, remote.port, port);
      sock.write(encodeHeader(FrameType.HELLO, 0, this.req.initialPsn, 0, 0, 0, 0, remote.qpNum, this.qpNum, 0));
      this.attach(sock, port, null, `${remote.gid}:${remote.port}`);
      return;
    }
    for (const p of parked) {
      if (p.srcQp === remote.qpNum && p.psn === remote.psn && !this.sock) this.incoming(p.sock, p.port, p.srcQp, p.psn, p.rest);
      else p.sock.destroy();
    }
    if (this.sock) return;
    const ms = device.helloTimeoutMs;
    this.waitTimer = setTimeout(() => {
      this.waitTimer = null;
      if (this.state === QpState.RTS && !this.sock) {
        this.req.failOldestStarted(WcStatus.RETRY_EXC_ERR);
        this.enterError(`the peer ${remote.gid}:${remote.port} (QP ${remote.qpNum}) did not open its stream within ${ms} ms`, true, "QP_FATAL");
      }
    }, ms);
    this.waitTimer.unref();
  }

  /** The QP's one stream is up (dialed, or the peer's adopted): both halves use it, one reader feeds both. */
  private attach(sock: net.Socket, port: ReadPort, rest: Buffer | null, peer: string): void {
    if (this.waitTimer) clearTimeout(this.waitTimer);
    this.waitTimer = null;
    this.sock = sock;
    // Like an idle verbs QP, the stream does not keep the process alive; an armed CQ with a handler does.
    sock.unref();
    const req = this.req;
    const resp = this.resp;
    const reader = new FrameReader(
      (h) => {
        if (isRequest(h.type)) resp.onRequestHeader(h);
        else if (h.type === FrameType.HELLO) this.protocolError("responder", "unexpected frame type 1 (HELLO) after the stream's first frame");
        else req.onResponseHeader(h);
      },
      (h) => {
        if (isRequest(h.type)) resp.onRequestDone(h);
        else req.onResponseDone(h);
      },
      (reason, type) => this.protocolError(type >= FrameType.ACK && type <= FrameType.ATOMIC_RESP ? "requester" : "responder", reason),
      (h: DecodedHeader) => {
        if (isRequest(h.type)) resp.onRequestRevoked(h);
        else req.onResponseRevoked();
      },
    );
    this.reader = reader;
    req.attach(sock, reader);
    resp.attach(sock, reader);
    const feed = (buf: Buffer, start: number, end: number): void => {
      this.heard = true;
      reader.feed(buf, start, end);
      // A large payload still to come, and the read filled the buffer: the rest goes straight into its memory.
      if (port.more && port.direct !== null && reader.payloadLeft >= DIRECT_MIN) reader.pullDirect(port.direct);
      // Bytes of a response payload still arriving are progress too (a header is counted when it is taken).
      if (reader.payloadLeft > 0 && reader.h.type === FrameType.READ_RESP) req.liveness.progress();
      resp.afterChunk();
    };
    port.sink = feed;
    sock.on("drain", () => {
      resp.onDrain();
      req.onDrain();
    });
    sock.on("error", (e) => this.connectionLost(`connection to peer ${peer} failed: ${e.message}`));
    sock.on("close", () => this.connectionLost("peer closed the connection"));
    if (rest) feed(rest, 0, rest.length);
    sock.resume();
    req.start();
  }

  /** The peer's stream for this QP (its HELLO named us). Parked, paused, until connect() when it arrives early. */
  incoming(sock: net.Socket, port: ReadPort, srcQp: number, psn: number, rest: Buffer | null): void {
    if (this.state === QpState.INIT) {
      // A stranger's HELLO must not evict the real peer's stream: keep a few, bounded.
      if (this.parked.length >= PARKED_MAX) {
        sock.destroy();
        return;
      }
      sock.pause();
      this.parked.push({ sock, port, srcQp, psn, rest });
      return;
    }
    if (this.state !== QpState.RTS || this.dials || !this.remote || srcQp !== this.remote.qpNum || psn !== this.remote.psn || this.sock) {
      sock.destroy();
      return;
    }
    this.attach(sock, port, rest, `${sock.remoteAddress ?? "?"}:${sock.remotePort ?? "?"}`);
  }

  /**
   * A HELLO of another wire version naming this QP: when it comes from its
   * peer (the one it waits for, or the one it dialed and has not heard from:
   * a version-1 peer dials too), the QP fails with a reason naming both
   * versions (the device closes that stream).
   */
  refusedVersion(srcQp: number, psn: number, reason: string): void {
    if (this.state !== QpState.RTS || !this.remote || srcQp !== this.remote.qpNum || psn !== this.remote.psn) return;
    if (this.dials ? this.heard : this.sock !== null) return;
    this.enterError(`PROTOCOL: the peer's stream was refused: ${reason}`, true, "QP_FATAL");
  }

  // ---------------------------------------------------------------- posting

  postSend(wrs: readonly SendWr[]): void {
    this.checkAlive("postSend");
    if (!Array.isArray(wrs)) throw new RdmaError("INVALID_ARGUMENT", "postSend takes an array of work requests");
    if (this.state === QpState.RESET || this.state === QpState.INIT || this.state === QpState.RTR) {
      throw new RdmaError("INVALID_STATE", `postSend needs the QP in RTS (state ${this.state}); connect() first`, { errnoName: "EINVAL" });
    }
    try {
      for (let i = 0; i < wrs.length; i++) {
        const wr = wrs[i]!;
        this.req.enqueue(wr, i, validateSendWr(wr, i, this.caps), this.caps.maxSendWr, this.sqSigAll);
      }
    } finally {
      // WRs before a bad one stay posted, as with verbs' bad_wr.
      this.req.posted();
    }
  }

  postRecv(wrs: readonly RecvWr[]): void {
    this.checkAlive("postRecv");
    if (!Array.isArray(wrs)) throw new RdmaError("INVALID_ARGUMENT", "postRecv takes an array of work requests");
    if (this.state === QpState.RESET) throw new RdmaError("INVALID_STATE", "postRecv needs the QP in INIT or later", { errnoName: "EINVAL" });
    for (let i = 0; i < wrs.length; i++) {
      const wr = wrs[i]!;
      validateRecvWr(wr, i, this.caps);
      this.resp.enqueue(wr.wrId, wr.sgList, i, this.caps.maxRecvWr);
    }
  }

  // ----------------------------------------------------------------- errors

  private emit(type: AsyncEventType, reason: string): void {
    const h = this.onEvent;
    if (h) queueMicrotask(() => h({ type, reason, qpNum: this.qpNum }));
  }

  /** A malformed or hostile frame: ERR with a reason; never touches memory it should not. */
  protocolError(side: Side, reason: string, stream: Side = side): void {
    if (this.state === QpState.ERR) return;
    if (side === "requester") this.req.failFirstSent(WcStatus.BAD_RESP_ERR);
    this.enterError(`malformed frame from peer for the ${stream}: ${reason}`, true, "QP_FATAL");
  }

  connectionLost(reason: string): void {
    if (this.state === QpState.ERR || this.state === QpState.RESET) return;
    this.req.failOldestStarted(WcStatus.RETRY_EXC_ERR);
    this.enterError(reason, true, "QP_FATAL");
  }

  /** A CQ of this QP overran (cq.ts). */
  fatal(type: AsyncEventType, reason: string): void {
    this.enterError(reason, true, type);
  }

  setError(): void {
    this.checkAlive("setError");
    // Requests this side accepted stay acknowledged (a NIC ACKs them on arrival).
    this.resp.flushOwedAck();
    this.enterError("moved to ERR by the application", false);
  }

  enterError(reason: string, notify: boolean, type: AsyncEventType = "QP_FATAL"): void {
    if (this.state === QpState.ERR) return;
    this.state = QpState.ERR;
    // No byte of a frame still arriving lands after this: its WR (a receive, a READ) is flushed
    // below, and the application may reuse the buffer as soon as it polls that completion.
    this.reader?.discard();
    // Flush: every unfinished WR completes with WR_FLUSH_ERR, in order; then the receives.
    this.req.flush();
    this.resp.flush();
    if (this.waitTimer) clearTimeout(this.waitTimer);
    this.waitTimer = null;
    // The peer learns at once (its stream closes) instead of after its ACK timeout.
    // Finish what we queued (a NAK, say), then stop reading: a peer that keeps streaming is not served.
    const sock = this.sock;
    if (sock && !sock.destroyed) {
      sock.end(() => sock.destroy());
      // A peer that does not read would keep the stream (and what we queued) forever.
      const linger = setTimeout(() => sock.destroy(), ERR_LINGER_MS);
      linger.unref();
      sock.once("close", () => clearTimeout(linger));
    }
    for (const p of this.parked) p.sock.destroy();
    this.parked = [];
    if (notify) this.emit(type, reason);
  }

  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    const device = this.pd.device;
    if (device.qps.get(this.qpNum) !== this) return;
    this.resp.flushOwedAck();
    this.state = QpState.ERR;
    for (const mw of this.boundWindows) mw.unbind();
    this.boundWindows.clear();
    if (this.waitTimer) clearTimeout(this.waitTimer);
    this.waitTimer = null;
    this.reader?.discard();
    this.req.destroy();
    this.resp.destroy();
    const s = this.sock;
    this.sock = null;
    if (s && !s.destroyed) {
      if (s.writableLength === 0) s.destroy();
      else {
        // What we queued (the owed ACK, say) still leaves, within a bound.
        s.end(() => s.destroy());
        const linger = setTimeout(() => s.destroy(), ERR_LINGER_MS);
        linger.unref();
        s.once("close", () => clearTimeout(linger));
      }
    }
    for (const p of this.parked) p.sock.destroy();
    this.parked = [];
    device.qps.delete(this.qpNum);
    this.sendCq.qps.delete(this);
    this.recvCq.qps.delete(this);
    this.pd.released("qp");
  }
}
