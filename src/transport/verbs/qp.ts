/**
 * Queue pairs of the verbs provider (RC): creation, connection, and the hot
 * path, where work requests are validated and encoded into a shared buffer
 * (codec.ts) and posted with one native call per list. The PD and device are
 * seen through QpPd and QpDevice (VerbsPd and VerbsDevice in device.ts
 * implement them), so this module does not import device.ts.
 */
import { randomInt } from "node:crypto";
import { markAsUntransferable } from "node:worker_threads";
import { RdmaError, checkInt } from "../../errors.js";
import {
  Access,
  QpState,
  SendFlags,
  WrOpcode,
  type AsyncEvent,
  type DeviceAttr,
  type Endpoint,
  type QpConnectAttr,
  type QpInitAttr,
  type QueuePair,
  type RecvWr,
  type SendWr,
  type Sge,
} from "../types.js";
import { RECV_WR_BYTES, SEND_WR_BYTES, WrBuffer } from "./codec.js";
import { validateRecvWr, validateSendWr } from "../validate.js";
import { VerbsCq, type CqDevice } from "./cq.js";
import { errnoError, nativeError } from "./errors.js";
import { VerbsMr, VerbsMw, type MrDevice, type MrPd, type WindowQp } from "./mr.js";
import { POST_BAD_BUFFER, POST_BAD_RECORD, POST_DESTROYED, type MrHandle, type MwHandle, type PdHandle, type QpHandle } from "./native.js";

/** What a QP needs from its device. */
export interface QpDevice extends MrDevice, CqDevice {
  readonly attr: DeviceAttr;
  /** qpNum -> QP, for async events and error tracking from completions. */
  readonly qps: Map<number, WeakRef<VerbsQp>>;
  checkOpen(): void;
  /** Port facts for endpoints (the default GID index, LID and active MTU). */
  portInfo(portNum: number): { defaultGid: number; lid: number; mtu: number };
}

/** What a QP needs from its protection domain. */
export interface QpPd extends MrPd {
  readonly device: QpDevice;
  readonly handle: PdHandle;
}

function u32(name: string, v: unknown, i: number): number {
  if (typeof v !== "number" || !Number.isInteger(v) || v < 0 || v > 0xffffffff) {
    // Accept negative int32 (e.g. a key from `x | 0`): keys are bit patterns.
    if (typeof v === "number" && Number.isInteger(v) && v >= -0x80000000 && v < 0) return v >>> 0;
    throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: ${name} must be a 32-bit unsigned integer, got ${String(v)}`);
  }
  return v;
}

function addr(name: string, v: unknown, i: number): number {
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: ${name} must be a non-negative integer, got ${String(v)}`);
  return v;
}

const MTUS = [256, 512, 1024, 2048, 4096];

export class VerbsQp implements QueuePair, WindowQp {
  readonly pd: QpPd;
  readonly qpNum: number;
  readonly sendCq: VerbsCq;
  readonly recvCq: VerbsCq;
  readonly caps: { maxSendWr: number; maxRecvWr: number; maxSendSge: number; maxRecvSge: number; maxInlineData: number };
  onEvent: ((e: AsyncEvent) => void) | null = null;
  readonly handle: QpHandle;
  /** An error completion or fatal event was seen: the QP is in ERR even if the kernel has not said so yet. */
  sawError = false;
  private readonly device: QpDevice;
  private readonly portNum: number;
  private readonly psn = randomInt(0, 0x1000000);
  private connected = false;
  private destroyed = false;
  private readonly sendBuf: WrBuffer;
  private readonly recvBuf: WrBuffer;
  /** Windows bound through this QP (the addon deallocates them before destroying it). */
  readonly boundWindows = new Set<VerbsMw>();

  constructor(pd: QpPd, init: QpInitAttr) {
    const dev = pd.device;
    const a = dev.attr;
    this.pd = pd;
    this.device = dev;
    if (!init || typeof init !== "object") throw new RdmaError("INVALID_ARGUMENT", "createQp needs init attributes");
    const scq = init.sendCq;
    const rcq = init.recvCq;
    if (!(scq instanceof VerbsCq) || !(rcq instanceof VerbsCq) || scq.device !== dev || rcq.device !== dev) {
      throw new RdmaError("INVALID_ARGUMENT", "send and receive CQs must belong to the QP's device");
    }
    if (scq.destroyed || rcq.destroyed) throw new RdmaError("INVALID_STATE", "completion queue is destroyed");
    this.sendCq = scq;
    this.recvCq = rcq;
    const maxSendWr = checkInt("maxSendWr", init.maxSendWr, 1, a.maxQpWr);
    const maxRecvWr = checkInt("maxRecvWr", init.maxRecvWr, 1, a.maxQpWr);
    const maxSendSge = checkInt("maxSendSge", init.maxSendSge ?? 1, 1, a.maxSge);
    const maxRecvSge = checkInt("maxRecvSge", init.maxRecvSge ?? 1, 1, a.maxSge);
    const maxInline = checkInt("maxInlineData", init.maxInlineData ?? 0, 0, a.maxInline);
    this.portNum = checkInt("portNum", init.portNum ?? 1, 1, a.physPortCnt);
    const access = checkInt("access", init.access ?? (Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC), 0, 31);
    let r;
    try {
      r = dev.addon.createQp(pd.handle, scq.handle, rcq.handle, maxSendWr, maxRecvWr, maxSendSge, maxRecvSge, maxInline, init.sqSigAll === true ? 1 : 0, this.portNum, access);
    } catch (e) {
      throw nativeError(e, "ibv_create_qp");
    }
    this.handle = r[0];
    this.qpNum = r[1];
    this.caps = { maxSendWr: r[2], maxRecvWr: r[3], maxSendSge: r[4], maxRecvSge: r[5], maxInlineData: r[6] };
    // One record more than the queue holds (as the addon allocates): a list that
    // overfills the queue is still one ibv_post_send, which names the first WR
    // that does not fit (ENOMEM); longer lists can never be posted whole.
    this.sendBuf = new WrBuffer(this.caps.maxSendWr + 1, this.caps.maxSendSge, SEND_WR_BYTES);
    this.recvBuf = new WrBuffer(this.caps.maxRecvWr + 1, this.caps.maxRecvSge, RECV_WR_BYTES);
    markAsUntransferable(this.sendBuf.buffer);
    markAsUntransferable(this.recvBuf.buffer);
    dev.qps.set(this.qpNum, new WeakRef(this));
  }

  get state(): QpState {
    if (this.destroyed || this.device.closed) return QpState.ERR;
    let s: number;
    try {
      s = this.device.addon.queryQpState(this.handle);
    } catch (e) {
      throw nativeError(e, "ibv_query_qp");
    }
    if (s < 0) return QpState.ERR;
    if (this.sawError && s !== QpState.RESET && s !== QpState.INIT) return QpState.ERR;
    return s as QpState;
  }

  private checkLive(): void {
    if (this.destroyed) throw new RdmaError("INVALID_STATE", `QP ${this.qpNum} is destroyed`);
    this.device.checkOpen();
  }

  localEndpoint(attr: { portNum?: number; gidIndex?: number } = {}): Endpoint {
    this.checkLive();
    const port = checkInt("portNum", attr.portNum ?? this.portNum, 1, this.device.attr.physPortCnt);
    const info = this.device.portInfo(port);
    const gidIndex = attr.gidIndex ?? info.defaultGid;
    let gid: string;
    try {
      gid = this.device.addon.queryGid(this.device.ctx, port, checkInt("gidIndex", gidIndex, 0, 0xffff));
    } catch (e) {
      throw nativeError(e, "ibv_query_gid");
    }
    return { provider: "verbs", qpNum: this.qpNum, psn: this.psn, lid: info.lid, gid, port: 0, mtu: info.mtu };
  }

  connect(remote: Endpoint, attr: QpConnectAttr = {}): void {
    this.checkLive();
    if (this.connected) throw new RdmaError("INVALID_STATE", `QP ${this.qpNum} must be in INIT to connect (already connected)`);
    if (!remote || remote.provider !== "verbs") throw new RdmaError("INVALID_ARGUMENT", `peer endpoint is not a verbs endpoint (got ${String(remote?.provider)})`);
    checkInt("remote.qpNum", remote.qpNum, 0, 0xffffff);
    checkInt("remote.psn", remote.psn, 0, 0xffffff);
    checkInt("remote.lid", remote.lid, 0, 0xffff);
    if (typeof remote.gid !== "string" || remote.gid.length === 0) throw new RdmaError("INVALID_ARGUMENT", "peer endpoint has no GID");
    if (attr.mtu !== undefined && !MTUS.includes(attr.mtu)) throw new RdmaError("INVALID_ARGUMENT", `mtu must be 256..4096 (a power of two), got ${attr.mtu}`);
    const port = checkInt("portNum", attr.portNum ?? this.portNum, 1, this.device.attr.physPortCnt);
    const info = this.device.portInfo(port);
    const gidIndex = checkInt("gidIndex", attr.gidIndex ?? info.defaultGid, 0, 0xffff);
    let mtu = Math.min(attr.mtu ?? 4096, info.mtu, MTUS.includes(remote.mtu) ? remote.mtu : 4096);
    if (!MTUS.includes(mtu)) mtu = 1024;
    const a = this.device.attr;
    const timeout = checkInt("timeout", attr.timeout ?? 14, 0, 31);
    const retryCnt = checkInt("retryCnt", attr.retryCnt ?? 7, 0, 7);
    const rnrRetry = checkInt("rnrRetry", attr.rnrRetry ?? 7, 0, 7);
    const minRnrTimer = checkInt("minRnrTimer", attr.minRnrTimer ?? 12, 0, 31);
    const maxRdAtomic = checkInt("maxRdAtomic", attr.maxRdAtomic ?? Math.min(16, a.maxQpInitRdAtom), 0, a.maxQpInitRdAtom);
    const maxDestRdAtomic = checkInt("maxDestRdAtomic", attr.maxDestRdAtomic ?? Math.min(16, a.maxQpRdAtom), 0, a.maxQpRdAtom);
    try {
      this.device.addon.connectQp(
        this.handle,
        port,
        gidIndex,
        mtu,
        remote.qpNum,
        remote.psn,
        this.psn,
        remote.lid,
        remote.gid,
        timeout,
        retryCnt,
        rnrRetry,
        minRnrTimer,
        maxRdAtomic,
        maxDestRdAtomic,
      );
    } catch (e) {
      throw nativeError(e, `connecting QP ${this.qpNum} to ${remote.gid} QP ${remote.qpNum}`);
    }
    this.connected = true;
  }

  setError(): void {
    this.checkLive();
    try {
      this.device.addon.setQpError(this.handle);
    } catch (e) {
      throw nativeError(e, "ibv_modify_qp(ERR)");
    }
  }

  // ---------------------------------------------------------------- posting

  postSend(wrs: readonly SendWr[]): void {
    if (!Array.isArray(wrs)) throw new RdmaError("INVALID_ARGUMENT", "postSend takes an array of work requests");
    this.checkLive();
    if (!this.connected) throw new RdmaError("INVALID_STATE", `postSend needs the QP in RTS (state ${this.state}); connect() first`, { errnoName: "EINVAL" });
    const buf = this.sendBuf;
    let base = 0;
    while (base < wrs.length) {
      const n = Math.min(buf.capacity, wrs.length - base);
      let objs: (MwHandle | MrHandle)[] | undefined;
      let sge = 0;
      let encoded = 0;
      let invalid: RdmaError | null = null;
      for (let k = 0; k < n; k++) {
        try {
          objs = this.encodeSend(buf, k, wrs[base + k]!, base + k, sge, objs);
        } catch (e) {
          invalid = e instanceof RdmaError ? e : new RdmaError("INVALID_ARGUMENT", `work request #${base + k}: ${(e as Error).message}`);
          break;
        }
        sge += wrs[base + k]!.sgList?.length ?? 0;
        encoded++;
      }
      // WRs before a bad one are posted, as with verbs' bad_wr.
      if (encoded > 0) this.submitSend(buf, encoded, objs, base, wrs);
      if (invalid) throw invalid;
      base += n;
    }
  }

  private submitSend(buf: WrBuffer, count: number, objs: (MwHandle | MrHandle)[] | undefined, base: number, wrs: readonly SendWr[]): void {
    const rc = this.device.addon.postSend(this.handle, buf.buffer, count, objs);
    const posted = rc === 0 ? count : buf.badIndex;
    // Window bookkeeping for what reached the send queue.
    for (let k = 0; k < posted; k++) {
      const wr = wrs[base + k]!;
      if (wr.opcode === WrOpcode.BIND_MW) {
        // Mirrors the addon: a window bound through this QP is deallocated with it.
        const mw = wr.mw as VerbsMw;
        mw.key = wr.bindRkey! >>> 0;
        mw.bound = true;
        if (mw.qp !== this) mw.qp?.boundWindows.delete(mw);
        mw.qp = this;
        this.boundWindows.add(mw);
      } else if (wr.opcode === WrOpcode.LOCAL_INV) {
        for (const mw of this.boundWindows) if (mw.key === wr.invalidateRkey! >>> 0) mw.bound = false;
      }
    }
    if (rc === 0) return;
    const i = base + posted;
    if (rc === POST_DESTROYED) throw new RdmaError("INVALID_STATE", `QP ${this.qpNum} is destroyed`);
    if (rc === POST_BAD_BUFFER || rc === POST_BAD_RECORD) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: rejected by the native encoder`);
    if (rc === 12 /* ENOMEM */) throw new RdmaError("RESOURCE_EXHAUSTED", `work request #${i}: send queue full (${this.caps.maxSendWr} outstanding)`, { errnoName: "ENOMEM" });
    throw errnoError(this.device.addon, rc, `work request #${i}: ibv_post_send failed`);
  }

  private encodeSges(buf: WrBuffer, list: readonly Sge[] | undefined, max: number, i: number, at: number): number {
    if (list === undefined) return 0;
    if (!Array.isArray(list) || list.length > max) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: sgList must be an array of at most ${max} entries`);
    for (let j = 0; j < list.length; j++) {
      const s = list[j];
      if (!s || typeof s !== "object") throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: bad scatter/gather element`);
      const len = s.length;
      if (typeof len !== "number" || !Number.isInteger(len) || len < 0 || len > 0xffffffff) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: sge.length must be a 32-bit unsigned integer, got ${String(len)}`);
      buf.sge(at + j, addr("sge.addr", s.addr, i), len, u32("sge.lkey", s.lkey, i));
    }
    return list.length;
  }

  /** Validates and encodes WR `wr` as record k; returns the (possibly created) handle array for BIND_MW. */
  private encodeSend(buf: WrBuffer, k: number, wr: SendWr, i: number, sgeAt: number, objs: (MwHandle | MrHandle)[] | undefined): (MwHandle | MrHandle)[] | undefined {
    if (!wr || typeof wr !== "object" || typeof wr.wrId !== "number") throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: wrId must be a number`);
    // The rules every provider applies the same way (transport/validate.ts), then what only verbs needs.
    validateSendWr(wr, i, this.caps);
    const op = wr.opcode;
    if (typeof op !== "number" || !Number.isInteger(op) || op < 0 || op > WrOpcode.BIND_MW) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: unknown opcode ${String(op)}`);
    const flags = wr.flags ?? 0;
    if (typeof flags !== "number" || !Number.isInteger(flags) || flags < 0 || flags > 15) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: flags must be SendFlags bits, got ${String(flags)}`);
    const nsge = this.encodeSges(buf, wr.sgList, this.caps.maxSendSge, i, sgeAt);
    buf.send(k, wr.wrId, op, flags, sgeAt, nsge);
    switch (op) {
      case WrOpcode.SEND:
        break;
      case WrOpcode.SEND_WITH_IMM:
        buf.imm(k, u32("imm", wr.imm ?? 0, i));
        break;
      case WrOpcode.RDMA_WRITE_WITH_IMM:
        buf.imm(k, u32("imm", wr.imm ?? 0, i));
        buf.remote(k, addr("remoteAddr", wr.remoteAddr, i), u32("rkey", wr.rkey, i));
        break;
      case WrOpcode.RDMA_WRITE:
      case WrOpcode.RDMA_READ:
        buf.remote(k, addr("remoteAddr", wr.remoteAddr, i), u32("rkey", wr.rkey, i));
        break;
      case WrOpcode.ATOMIC_CMP_AND_SWP:
      case WrOpcode.ATOMIC_FETCH_AND_ADD: {
        if (nsge !== 1 || wr.sgList![0]!.length !== 8) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: an atomic needs one 8-byte scatter/gather element`);
        const ca = wr.compareAdd ?? 0n;
        const sw = wr.swap ?? 0n;
        if (typeof ca !== "bigint" || typeof sw !== "bigint") throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: atomic operands must be bigint`);
        buf.remote(k, addr("remoteAddr", wr.remoteAddr, i), u32("rkey", wr.rkey, i));
        buf.atomic(k, ca, sw);
        break;
      }
      case WrOpcode.LOCAL_INV:
        buf.imm(k, u32("invalidateRkey", wr.invalidateRkey, i));
        break;
      case WrOpcode.BIND_MW: {
        const mw = wr.mw;
        const b = wr.bind;
        if (!(mw instanceof VerbsMw) || !b || typeof b !== "object" || !(b.mr instanceof VerbsMr)) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: BIND_MW needs mw, bindRkey and bind (a verbs window and MR)`);
        if (mw.deallocated) throw new RdmaError("INVALID_STATE", `work request #${i}: the memory window is deallocated`);
        if (b.mr.deregistered) throw new RdmaError("INVALID_STATE", `work request #${i}: the bind's MR is deregistered`);
        if (mw.pd.device !== this.device || b.mr.pd.device !== this.device) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: window and MR must belong to the QP's device`);
        const list = objs ?? [];
        list.push(mw.handle, b.mr.handle);
        buf.bind(k, u32("bindRkey", wr.bindRkey, i), addr("bind.addr", b.addr, i), addr("bind.length", b.length, i), checkInt("bind.access", b.access, 0, 31), list.length - 2, list.length - 1);
        return list;
      }
      default:
        throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: unknown opcode ${String(op)}`);
    }
    if (flags & SendFlags.INLINE && op <= WrOpcode.SEND_WITH_IMM) this.checkInline(wr.sgList, i);
    return objs;
  }

  /**
   * Inline data is copied by the provider library from the SGEs' addresses at
   * post time, without an lkey check: so the bytes must be inside a live MR
   * of this device (a bad address would otherwise crash the process).
   */
  private checkInline(list: readonly Sge[] | undefined, i: number): void {
    let len = 0;
    for (const s of list ?? []) {
      len += s.length;
      if (s.length === 0) continue;
      const m = this.device.mrs.get(s.lkey >>> 0)?.deref();
      if (!m || m.deregistered || s.addr < m.addr || s.addr + s.length > m.addr + m.length) {
        throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: inline scatter/gather element is not inside a registered MR`);
      }
    }
    if (len > this.caps.maxInlineData) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: ${len} inline bytes exceed maxInlineData ${this.caps.maxInlineData}`, { errnoName: "EINVAL" });
  }

  postRecv(wrs: readonly RecvWr[]): void {
    if (!Array.isArray(wrs)) throw new RdmaError("INVALID_ARGUMENT", "postRecv takes an array of work requests");
    this.checkLive();
    const buf = this.recvBuf;
    let base = 0;
    while (base < wrs.length) {
      const n = Math.min(buf.capacity, wrs.length - base);
      let sge = 0;
      let encoded = 0;
      let invalid: RdmaError | null = null;
      for (let k = 0; k < n; k++) {
        const wr = wrs[base + k]!;
        try {
          if (!wr || typeof wr !== "object" || typeof wr.wrId !== "number") throw new RdmaError("INVALID_ARGUMENT", `receive work request #${base + k}: wrId must be a number`);
          validateRecvWr(wr, base + k, this.caps);
          const c = this.encodeSges(buf, wr.sgList, this.caps.maxRecvSge, base + k, sge);
          buf.recv(k, wr.wrId, sge, c);
          sge += c;
        } catch (e) {
          invalid = e instanceof RdmaError ? e : new RdmaError("INVALID_ARGUMENT", `receive work request #${base + k}: ${(e as Error).message}`);
          break;
        }
        encoded++;
      }
      if (encoded > 0) {
        const rc = this.device.addon.postRecv(this.handle, buf.buffer, encoded);
        if (rc !== 0) {
          const i = base + buf.badIndex;
          if (rc === POST_DESTROYED) throw new RdmaError("INVALID_STATE", `QP ${this.qpNum} is destroyed`);
          if (rc < 0) throw new RdmaError("INVALID_ARGUMENT", `receive work request #${i}: rejected by the native encoder`);
          if (rc === 12) throw new RdmaError("RESOURCE_EXHAUSTED", `receive work request #${i}: receive queue full (${this.caps.maxRecvWr})`, { errnoName: "ENOMEM" });
          throw errnoError(this.device.addon, rc, `receive work request #${i}: ibv_post_recv failed`);
        }
        if (this.sawError) this.kickFlush();
      }
      if (invalid) throw invalid;
      base += n;
    }
  }

  /**
   * Makes the device flush receives posted while the QP is in ERR. Verbs
   * completes them with WR_FLUSH_ERR; rxe (kernel 6.1) flushes the receive
   * queue only when its responder runs, and a user-space post_recv on rxe
   * writes the shared queue without any doorbell, so a receive posted after
   * the error would sit there forever. ERR -> ERR is a legal transition that
   * runs the flush (rxe_qp_error). Called when an error completion is first
   * seen and after each receive post on a QP known to be in ERR.
   */
  kickFlush(): void {
    if (this.destroyed || this.device.closed) return;
    try {
      this.device.addon.setQpError(this.handle);
    } catch {
      /* best effort */
    }
  }

  /** The native QP is gone (device closed): windows bound through it went with it. */
  released(): void {
    this.destroyed = true;
    for (const mw of [...this.boundWindows]) mw.released();
    this.boundWindows.clear();
  }

  destroy(): void {
    if (this.destroyed) return;
    if (!this.device.closed) {
      try {
        // The addon deallocates type-2 windows bound through this QP first.
        this.device.addon.destroyQp(this.handle);
      } catch (e) {
        throw nativeError(e, "ibv_destroy_qp");
      }
    }
    this.released();
    if (this.device.qps.get(this.qpNum)?.deref() === this) this.device.qps.delete(this.qpNum);
  }
}
