/**
 * The verbs provider's device and protection domain over the native addon
 * (native.ts); MRs and windows are in mr.ts, CQs in cq.ts, QPs in qp.ts.
 * Arguments are validated here and every failure is an RdmaError; native
 * errors carry their errno name (errors.ts).
 */
import { validateMrAccess, validateMrRange } from "../validate.js";
import { markAsUntransferable } from "node:worker_threads";
import { RdmaError, checkInt } from "../../errors.js";
import {
  Access,
  type AsyncEvent,
  type AsyncEventType,
  type CompletionQueue,
  type Device,
  type DeviceAttr,
  type MemoryRegion,
  type MemoryWindow,
  type PortAttr,
  type ProtectionDomain,
  type QpInitAttr,
  type QueuePair,
} from "../types.js";
import { isDetached, setDetacher } from "../buffers.js";
import { VerbsCq } from "./cq.js";
import { nativeError } from "./errors.js";
import { VerbsMr, VerbsMw } from "./mr.js";
import { VerbsQp, type QpDevice, type QpPd } from "./qp.js";
import type { ContextHandle, NativeAddon, NativeDeviceAttr, PdHandle } from "./native.js";

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

export class VerbsDevice implements Device, QpDevice {
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

export class VerbsPd implements ProtectionDomain, QpPd {
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

  registerMr(memory: number | ArrayBuffer | SharedArrayBuffer, access: number, offset = 0, length?: number): MemoryRegion {
    this.checkOpen();
    validateMrAccess(access);
    const addon = this.device.addon;
    const maxLen = Math.min(this.device.attr.maxMrSize, Number.MAX_SAFE_INTEGER);
    try {
      if (typeof memory === "number") {
        checkInt("length", memory, 1, maxLen);
        const [h, ab, a, lkey, rkey] = addon.regMr(this.handle, memory, access);
        setDetacher(ab, addon.detachBuffer);
        return new VerbsMr(this, h, ab, 0, a, memory, lkey, rkey, access, true);
      }
      if (memory instanceof SharedArrayBuffer) {
        // Shared memory stays where it is whatever thread uses it (it is never transferred or
        // detached): the device reads and writes the same bytes a worker sees.
        const { offset: off, length: len } = validateMrRange(memory, offset, length, maxLen);
        const [h, a, lkey, rkey] = addon.regMrUser(this.handle, new Uint8Array(memory), off, len, access);
        return new VerbsMr(this, h, memory as unknown as ArrayBuffer, off, a, len, lkey, rkey, access, false);
      }
      if (!(memory instanceof ArrayBuffer)) throw new RdmaError("INVALID_ARGUMENT", "registerMr takes a length, an ArrayBuffer or a SharedArrayBuffer");
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
