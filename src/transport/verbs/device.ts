/**
 * The verbs provider's objects: Device, PD, MR, MW, CQ and QP over the
 * native addon (native.ts). Arguments are validated here and every failure
 * is an RdmaError; native errors carry their errno name.
 */
import { randomInt } from "node:crypto";
import { markAsUntransferable } from "node:worker_threads";
import { RdmaError, checkInt, type RdmaErrorCode } from "../../errors.js";
import {
  Access,
  QpState,
  SendFlags,
  WrOpcode,
  type AsyncEvent,
  type AsyncEventType,
  type CompletionBuffer,
  type CompletionQueue,
  type Device,
  type DeviceAttr,
  type Endpoint,
  type MemoryRegion,
  type MemoryWindow,
  type PortAttr,
  type ProtectionDomain,
  type QpConnectAttr,
  type QpInitAttr,
  type QueuePair,
  type RecvWr,
  type SendWr,
  type Sge,
} from "../types.js";
import { isDetached, setDetacher } from "../buffers.js";
import { RECV_WR_BYTES, SEND_WR_BYTES, WrBuffer } from "./codec.js";
import {
  POST_BAD_BUFFER,
  POST_BAD_RECORD,
  POST_DESTROYED,
  type ContextHandle,
  type CqHandle,
  type MrHandle,
  type MwHandle,
  type NativeAddon,
  type NativeDeviceAttr,
  type PdHandle,
  type QpHandle,
} from "./native.js";

const ERRNO_CODE: Record<string, RdmaErrorCode> = {
  EINVAL: "INVALID_ARGUMENT",
  EOPNOTSUPP: "INVALID_ARGUMENT",
  ENOMEM: "RESOURCE_EXHAUSTED",
  EAGAIN: "RESOURCE_EXHAUSTED",
  ENOSPC: "RESOURCE_EXHAUSTED",
  EBUSY: "INVALID_STATE",
  DESTROYED: "INVALID_STATE",
  EPERM: "DEVICE",
  EACCES: "DEVICE",
  ENODEV: "DEVICE",
};

/** A native error (Error with an errno name) as an RdmaError. */
export function nativeError(e: unknown, what: string): RdmaError {
  if (e instanceof RdmaError) return e;
  const errno = typeof (e as { errno?: unknown })?.errno === "string" ? ((e as { errno: string }).errno as string) : undefined;
  const msg = e instanceof Error ? e.message : String(e);
  return new RdmaError(errno ? (ERRNO_CODE[errno] ?? "DEVICE") : "DEVICE", `${what}: ${msg}`, errno === undefined ? { cause: e } : { errno, cause: e });
}

function errnoError(addon: NativeAddon, rc: number, what: string): RdmaError {
  const name = addon.errnoName(rc);
  return new RdmaError(ERRNO_CODE[name] ?? "DEVICE", `${what} (${name})`, { errno: name });
}

const IBV_DEVICE_MEM_WINDOW = 1 << 17;
const IBV_DEVICE_MEM_WINDOW_TYPE_2A = 1 << 23;
const IBV_DEVICE_MEM_WINDOW_TYPE_2B = 1 << 24;
const PORT_STATES: PortAttr["state"][] = ["NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER"];
const ATOMIC_CAPS: DeviceAttr["atomicCap"][] = ["NONE", "HCA", "GLOB"];

/** enum ibv_event_type -> the seam's event names (others are not delivered). */
const EVENT_TYPES: Record<number, AsyncEventType> = {
  0: "CQ_ERR",
  1: "QP_FATAL",
  2: "QP_REQ_ERR",
  3: "QP_ACCESS_ERR",
  4: "COMM_EST",
  8: "DEVICE_FATAL",
  9: "PORT_ACTIVE",
  10: "PORT_ERR",
};

function deviceAttr(a: NativeDeviceAttr): DeviceAttr {
  const mwTypes: (1 | 2)[] = [];
  if (a.maxMw > 0 && a.deviceCapFlags & IBV_DEVICE_MEM_WINDOW) mwTypes.push(1);
  if (a.maxMw > 0 && a.deviceCapFlags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) mwTypes.push(2);
  return {
    provider: "verbs",
    fwVer: a.fwVer,
    nodeGuid: a.nodeGuid,
    maxMrSize: a.maxMrSize,
    maxQp: a.maxQp,
    maxQpWr: a.maxQpWr,
    maxSge: a.maxSge,
    maxCq: a.maxCq,
    maxCqe: a.maxCqe,
    maxMr: a.maxMr,
    maxPd: a.maxPd,
    maxQpRdAtom: a.maxQpRdAtom,
    maxQpInitRdAtom: a.maxQpInitRdAtom,
    maxInline: a.maxInline,
    atomicCap: ATOMIC_CAPS[a.atomicCap] ?? "NONE",
    maxMw: a.maxMw,
    mwTypes,
    // Window bounds enforcement cannot be queried. rxe (vendor 0xffffff,
    // kernel 6.1) does not enforce them: a write past a window's end but
    // inside its MR completes (measured, ../shared/softroce/README.md). For
    // other devices we have not verified it, and wrongly claiming `true`
    // would turn windows into a hole in isolation, while `false` only costs
    // the library dedicated MRs for grants; so it is false everywhere.
    mwEnforcesBounds: false,
    physPortCnt: a.physPortCnt,
  };
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

export class VerbsDevice implements Device {
  readonly name: string;
  readonly attr: DeviceAttr;
  onEvent: ((e: AsyncEvent) => void) | null = null;
  readonly addon: NativeAddon;
  readonly ctx: ContextHandle;
  closed = false;
  /** qpNum -> QP, for async events and error tracking from completions. */
  readonly qps = new Map<number, WeakRef<VerbsQp>>();
  /** lkey -> MR, to validate inline sends (the library copies those bytes itself). */
  readonly mrs = new Map<number, WeakRef<VerbsMr>>();
  private readonly ports = new Map<number, { defaultGid: number; lid: number; mtu: number }>();
  /** Held here: the addon keeps only a weak reference to it. */
  private readonly asyncHandler: (type: number, qpNum: number, portNum: number, text: string) => void;

  constructor(addon: NativeAddon, name: string | undefined) {
    this.addon = addon;
    this.asyncHandler = (type, qpNum, portNum, text) => this.onAsync(type, qpNum, portNum, text);
    try {
      this.ctx = addon.open(name ?? null, this.asyncHandler);
    } catch (e) {
      throw nativeError(e, `cannot open RDMA device ${name ?? "(first)"}`);
    }
    try {
      this.attr = deviceAttr(addon.queryDevice(this.ctx));
    } catch (e) {
      addon.close(this.ctx);
      throw nativeError(e, "ibv_query_device");
    }
    this.name = name ?? addon.listDevices()[0]?.name ?? "verbs";
  }

  private onAsync(type: number, qpNum: number, portNum: number, text: string): void {
    const t = EVENT_TYPES[type];
    if (t === undefined) return;
    if (qpNum >= 0) {
      const qp = this.qps.get(qpNum)?.deref();
      if (!qp) return;
      if (t === "QP_FATAL" || t === "QP_REQ_ERR" || t === "QP_ACCESS_ERR") qp.sawError = true;
      qp.onEvent?.({ type: t, reason: `${text} (QP ${qpNum})`, qpNum });
      return;
    }
    this.onEvent?.({ type: t, reason: portNum > 0 ? `${text} (port ${portNum})` : text });
  }

  checkOpen(): void {
    if (this.closed) throw new RdmaError("INVALID_STATE", `device ${this.name} is closed`);
  }

  queryPort(portNum = 1): PortAttr {
    this.checkOpen();
    checkInt("portNum", portNum, 1, this.attr.physPortCnt);
    let p;
    try {
      p = this.addon.queryPort(this.ctx, portNum);
    } catch (e) {
      throw nativeError(e, "ibv_query_port");
    }
    return {
      portNum,
      state: PORT_STATES[p.state] ?? "NOP",
      activeMtu: p.activeMtu,
      maxMtu: p.maxMtu,
      linkLayer: p.linkLayer === 2 ? "Ethernet" : "InfiniBand",
      lid: p.lid,
      gidTblLen: p.gidTblLen,
      gids: p.gids.map((g) => (g.type === undefined ? { index: g.index, gid: g.gid } : { index: g.index, gid: g.gid, type: g.type })),
    };
  }

  /** Port facts for endpoints; the default GID is the first RoCE v2 IPv4-mapped one, else the first. */
  portInfo(portNum: number): { defaultGid: number; lid: number; mtu: number } {
    let p = this.ports.get(portNum);
    if (!p) {
      const a = this.queryPort(portNum);
      const v2 =
        a.gids.find((g) => g.type === "RoCE v2" && g.gid.startsWith("::ffff:")) ??
        a.gids.find((g) => g.type === "RoCE v2") ??
        (a.linkLayer === "Ethernet" ? a.gids.find((g) => g.type === undefined && g.gid.startsWith("::ffff:")) : undefined);
      p = { defaultGid: (v2 ?? a.gids[0])?.index ?? 0, lid: a.lid, mtu: a.activeMtu };
      this.ports.set(portNum, p);
    }
    return p;
  }

  allocPd(): ProtectionDomain {
    this.checkOpen();
    try {
      return new VerbsPd(this, this.addon.allocPd(this.ctx));
    } catch (e) {
      throw nativeError(e, "ibv_alloc_pd");
    }
  }

  createCq(depth: number): CompletionQueue {
    this.checkOpen();
    checkInt("cq depth", depth, 1, this.attr.maxCqe);
    return new VerbsCq(this, depth);
  }

  /** A completion with an error status means its QP went to ERR (RC semantics). */
  markError(qpNum: number): void {
    const qp = this.qps.get(qpNum)?.deref();
    if (qp && !qp.sawError) {
      qp.sawError = true;
      qp.kickFlush();
    }
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    for (const r of this.qps.values()) r.deref()?.released();
    this.qps.clear();
    this.mrs.clear();
    this.addon.close(this.ctx);
  }
}

export class VerbsPd implements ProtectionDomain {
  readonly device: VerbsDevice;
  readonly handle: PdHandle;
  deallocated = false;

  constructor(device: VerbsDevice, handle: PdHandle) {
    this.device = device;
    this.handle = handle;
  }

  checkOpen(): void {
    if (this.deallocated) throw new RdmaError("INVALID_STATE", "protection domain is deallocated");
    this.device.checkOpen();
  }

  registerMr(memory: number | ArrayBuffer, access: number, offset = 0, length?: number): MemoryRegion {
    this.checkOpen();
    checkInt("access", access, 0, 31);
    if (access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) && !(access & Access.LOCAL_WRITE)) {
      throw new RdmaError("INVALID_ARGUMENT", "remote write or atomic access requires LOCAL_WRITE (verbs refuses it with EINVAL)", { errno: "EINVAL" });
    }
    const addon = this.device.addon;
    const maxLen = Math.min(this.device.attr.maxMrSize, Number.MAX_SAFE_INTEGER);
    try {
      if (typeof memory === "number") {
        checkInt("length", memory, 1, maxLen);
        const [h, ab, a, lkey, rkey] = addon.regMr(this.handle, memory, access);
        setDetacher(ab, addon.detachBuffer);
        return new VerbsMr(this, h, ab, 0, a, memory, lkey, rkey, access, true);
      }
      if (!(memory instanceof ArrayBuffer)) throw new RdmaError("INVALID_ARGUMENT", "registerMr takes a length or an ArrayBuffer");
      if (isDetached(memory)) throw new RdmaError("INVALID_ARGUMENT", "cannot register a detached ArrayBuffer");
      if ((memory as ArrayBuffer & { resizable?: boolean }).resizable) throw new RdmaError("INVALID_ARGUMENT", "cannot register a resizable ArrayBuffer: its memory may move");
      checkInt("offset", offset, 0, memory.byteLength);
      const len = length ?? memory.byteLength - offset;
      checkInt("length", len, 1, Math.min(memory.byteLength - offset, maxLen));
      // The device now reads and writes these bytes: they must not move to another thread.
      markAsUntransferable(memory);
      const [h, a, lkey, rkey] = addon.regMrUser(this.handle, memory, offset, len, access);
      return new VerbsMr(this, h, memory, offset, a, len, lkey, rkey, access, false);
    } catch (e) {
      throw nativeError(e, "ibv_reg_mr");
    }
  }

  allocMw(type: 1 | 2 = 2): MemoryWindow {
    this.checkOpen();
    if (type !== 1 && type !== 2) throw new RdmaError("INVALID_ARGUMENT", `memory window type must be 1 or 2, got ${String(type)}`);
    if (!this.device.attr.mwTypes.includes(type)) throw new RdmaError("INVALID_ARGUMENT", `device ${this.device.name} has no type-${type} memory windows`);
    try {
      const [h, rkey] = this.device.addon.allocMw(this.handle, type);
      return new VerbsMw(this, h, type, rkey);
    } catch (e) {
      throw nativeError(e, "ibv_alloc_mw");
    }
  }

  createQp(init: QpInitAttr): QueuePair {
    this.checkOpen();
    return new VerbsQp(this, init);
  }

  dealloc(): void {
    if (this.deallocated || this.device.closed) {
      this.deallocated = true;
      return;
    }
    try {
      this.device.addon.deallocPd(this.handle);
    } catch (e) {
      throw nativeError(e, "ibv_dealloc_pd (MRs, windows or QPs still use the protection domain?)");
    }
    this.deallocated = true;
  }
}

export class VerbsMr implements MemoryRegion {
  readonly pd: VerbsPd;
  readonly handle: MrHandle;
  readonly buffer: ArrayBuffer;
  readonly offset: number;
  readonly addr: number;
  readonly length: number;
  readonly lkey: number;
  readonly rkey: number;
  readonly access: number;
  readonly owned: boolean;
  private _deregistered = false;

  constructor(pd: VerbsPd, handle: MrHandle, buffer: ArrayBuffer, offset: number, addr: number, length: number, lkey: number, rkey: number, access: number, owned: boolean) {
    this.pd = pd;
    this.handle = handle;
    this.buffer = buffer;
    this.offset = offset;
    this.addr = addr;
    this.length = length;
    this.lkey = lkey;
    this.rkey = rkey;
    this.access = access;
    this.owned = owned;
    pd.device.mrs.set(lkey, new WeakRef(this));
  }

  get deregistered(): boolean {
    return this._deregistered || this.pd.device.closed;
  }

  deregister(): void {
    if (this._deregistered) return;
    const dev = this.pd.device;
    try {
      dev.addon.deregMr(this.handle);
    } catch (e) {
      throw nativeError(e, "ibv_dereg_mr (memory windows still bound?)");
    }
    this._deregistered = true;
    if (dev.mrs.get(this.lkey)?.deref() === this) dev.mrs.delete(this.lkey);
  }

  /**
   * A new ArrayBuffer over bytes [offset, offset+length) of `buffer` (memory
   * the provider allocated only). It keeps the native memory alive for as
   * long as it exists, can be detached on its own, and is detached with every
   * other view when the MR is deregistered.
   */
  aliasBuffer(offset: number, length: number): ArrayBuffer {
    if (!this.owned) throw new RdmaError("INVALID_ARGUMENT", "aliasBuffer: only memory the provider allocated (registerMr with a length) can be aliased");
    if (this.deregistered) throw new RdmaError("INVALID_STATE", "aliasBuffer: the memory region is deregistered");
    checkInt("offset", offset, 0, this.length - 1);
    checkInt("length", length, 1, this.length - offset);
    const addon = this.pd.device.addon;
    let ab: ArrayBuffer;
    try {
      ab = addon.aliasMr(this.handle, offset, length);
    } catch (e) {
      throw nativeError(e, "aliasBuffer");
    }
    setDetacher(ab, addon.detachBuffer);
    return ab;
  }
}

export class VerbsMw implements MemoryWindow {
  readonly pd: VerbsPd;
  readonly handle: MwHandle;
  readonly type: 1 | 2;
  /** Last rkey the window had (its current one when bound). */
  key: number;
  bound = false;
  /** The QP the window was last bound through. */
  qp: VerbsQp | null = null;
  private _deallocated = false;

  constructor(pd: VerbsPd, handle: MwHandle, type: 1 | 2, rkey: number) {
    this.pd = pd;
    this.handle = handle;
    this.type = type;
    this.key = rkey >>> 0;
  }

  get deallocated(): boolean {
    return this._deallocated || this.pd.device.closed;
  }

  /** The window's rkey once a BIND_MW for it was posted (0 when unbound or invalidated). */
  get rkey(): number {
    return this.bound && !this.deallocated ? this.key : 0;
  }

  nextRkey(): number {
    return ((this.key & ~0xff) | ((this.key + 1) & 0xff)) >>> 0;
  }

  /** The native window is gone (its QP was destroyed, or the device closed). */
  released(): void {
    this._deallocated = true;
    this.bound = false;
    this.qp?.boundWindows.delete(this);
    this.qp = null;
  }

  dealloc(): void {
    if (this._deallocated) return;
    if (!this.pd.device.closed) {
      try {
        this.pd.device.addon.deallocMw(this.handle);
      } catch (e) {
        throw nativeError(e, "ibv_dealloc_mw");
      }
    }
    this.released();
  }
}

export class VerbsCq implements CompletionQueue {
  readonly device: VerbsDevice;
  readonly depth: number;
  readonly handle: CqHandle;
  destroyed = false;
  private handler: (() => void) | null = null;
  /** Held here: the addon keeps only a weak reference to it (strong while armed). */
  private readonly notifyHandler: () => void;

  constructor(device: VerbsDevice, depth: number) {
    this.device = device;
    this.notifyHandler = () => {
      if (!this.destroyed) this.handler?.();
    };
    try {
      const [h, cqe] = device.addon.createCq(device.ctx, depth, this.notifyHandler);
      this.handle = h;
      this.depth = cqe;
    } catch (e) {
      throw nativeError(e, "ibv_create_cq");
    }
  }

  /**
   * While a handler is set, an armed CQ keeps the process alive (a completion
   * is awaited, like a read on a socket); without one it does not, so a CQ
   * left armed by the arm-then-poll pattern never holds the process open.
   */
  get onNotify(): (() => void) | null {
    return this.handler;
  }

  set onNotify(fn: (() => void) | null) {
    const had = this.handler !== null;
    this.handler = typeof fn === "function" ? fn : null;
    const has = this.handler !== null;
    if (had !== has && !this.destroyed && !this.device.closed) this.device.addon.keepAliveCq(this.handle, has);
  }

  poll(out: CompletionBuffer, max?: number): number {
    if (this.destroyed || this.device.closed) throw new RdmaError("INVALID_STATE", "completion queue is destroyed");
    if (!out || typeof out !== "object" || typeof out.capacity !== "number" || !(out.wrId instanceof Float64Array)) throw new RdmaError("INVALID_ARGUMENT", "poll needs a CompletionBuffer");
    max ??= out.capacity;
    if (typeof max !== "number" || !(max >= 0)) throw new RdmaError("INVALID_ARGUMENT", `max must be a non-negative number, got ${String(max)}`);
    let n: number;
    try {
      n = this.device.addon.pollCq(this.handle, Math.min(max, out.capacity) >>> 0, out.wrId, out.status, out.opcode, out.flags, out.byteLen, out.imm, out.qpNum, out.vendorErr);
    } catch (e) {
      throw nativeError(e, "ibv_poll_cq");
    }
    const st = out.status;
    for (let i = 0; i < n; i++) if (st[i] !== 0) this.device.markError(out.qpNum[i]!);
    return n;
  }

  requestNotify(): void {
    if (this.destroyed || this.device.closed) throw new RdmaError("INVALID_STATE", "completion queue is destroyed");
    try {
      this.device.addon.reqNotifyCq(this.handle);
    } catch (e) {
      throw nativeError(e, "ibv_req_notify_cq");
    }
  }

  destroy(): void {
    if (this.destroyed) return;
    if (!this.device.closed) {
      try {
        this.device.addon.destroyCq(this.handle);
      } catch (e) {
        throw nativeError(e, "ibv_destroy_cq (QPs still use it?)");
      }
    }
    this.destroyed = true;
  }
}

const MTUS = [256, 512, 1024, 2048, 4096];

export class VerbsQp implements QueuePair {
  readonly pd: VerbsPd;
  readonly qpNum: number;
  readonly sendCq: VerbsCq;
  readonly recvCq: VerbsCq;
  readonly caps: { maxSendWr: number; maxRecvWr: number; maxSendSge: number; maxRecvSge: number; maxInlineData: number };
  onEvent: ((e: AsyncEvent) => void) | null = null;
  readonly handle: QpHandle;
  /** An error completion or fatal event was seen: the QP is in ERR even if the kernel has not said so yet. */
  sawError = false;
  private readonly device: VerbsDevice;
  private readonly portNum: number;
  private readonly psn = randomInt(0, 0x1000000);
  private connected = false;
  private destroyed = false;
  private readonly sendBuf: WrBuffer;
  private readonly recvBuf: WrBuffer;
  /** Windows bound through this QP (the addon deallocates them before destroying it). */
  readonly boundWindows = new Set<VerbsMw>();

  constructor(pd: VerbsPd, init: QpInitAttr) {
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
    if (!this.connected) throw new RdmaError("INVALID_STATE", `postSend needs the QP in RTS (state ${this.state}); connect() first`, { errno: "EINVAL" });
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
    if (rc === 12 /* ENOMEM */) throw new RdmaError("RESOURCE_EXHAUSTED", `work request #${i}: send queue full (${this.caps.maxSendWr} outstanding)`, { errno: "ENOMEM" });
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
    if (len > this.caps.maxInlineData) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: ${len} inline bytes exceed maxInlineData ${this.caps.maxInlineData}`, { errno: "EINVAL" });
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
          if (rc === 12) throw new RdmaError("RESOURCE_EXHAUSTED", `receive work request #${i}: receive queue full (${this.caps.maxRecvWr})`, { errno: "ENOMEM" });
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
