/**
 * Device, PD, MR, MW and CQ of the tcp provider. The QP (the transport proper)
 * lives in qp.ts.
 */
import net from "node:net";
import { randomInt } from "node:crypto";
import { RdmaError, checkInt } from "../../errors.js";
import {
  Access,
  CompletionBuffer,
  type AsyncEvent,
  type CompletionQueue,
  type Device,
  type DeviceAttr,
  type MemoryRegion,
  type MemoryWindow,
  type PortAttr,
  type ProtectionDomain,
  type QpInitAttr,
  type QueuePair,
  type TcpDeviceOptions,
} from "../types.js";
import { TcpQueuePair } from "./qp.js";
import { HELLO_TIMEOUT_MS, MAX_PENDING_HELLO, MAX_PENDING_HELLO_PER_SOURCE, PendingStreams, acceptIncoming } from "./accept.js";
import { KeySpace } from "./keys.js";
import { detachArrayBuffer, isDetached } from "../buffers.js";

const PAGE = 4096;

export const TCP_DEVICE_ATTR: Omit<DeviceAttr, "nodeGuid"> = {
  provider: "tcp",
  fwVer: "tcp-1",
  maxMrSize: 2 ** 32,
  maxQp: 65536,
  maxQpWr: 16384,
  maxSge: 32,
  maxCq: 65536,
  maxCqe: 1 << 20,
  maxMr: 1 << 20,
  maxPd: 65536,
  maxQpRdAtom: 128,
  maxQpInitRdAtom: 128,
  maxInline: 1024,
  atomicCap: "HCA",
  maxMw: 1 << 16,
  mwTypes: [1, 2],
  mwEnforcesBounds: true,
  physPortCnt: 1,
};

export type KeyTarget = TcpMr | TcpMw;

export class TcpDevice implements Device {
  readonly name: string;
  readonly attr: DeviceAttr;
  onEvent: ((e: AsyncEvent) => void) | null = null;
  readonly host: string;
  port = 0;
  /** lkey/rkey → MR or MW. One key space per device, as on an HCA. */
  readonly keys = new Map<number, KeyTarget>();
  /** Key indices reserved by live MRs and windows (see keys.ts): crypto-random, never colliding, never 0. */
  readonly keySpace: KeySpace;
  /** Live MRs and windows on this device (bounded by attr.maxMr / attr.maxMw, as verbs does). */
  liveMrs = 0;
  liveMws = 0;
  readonly qps = new Map<number, TcpQueuePair>();
  readonly cqs = new Set<TcpCq>();
  /** Accepted streams still waiting for their HELLO, by source (accept.ts). */
  readonly pendingHello = new PendingStreams();
  /** Limits on those streams (defaults in accept.ts; documented in docs/architecture.md). */
  helloTimeoutMs = HELLO_TIMEOUT_MS;
  maxPendingHello = MAX_PENDING_HELLO;
  maxPendingHelloPerSource = MAX_PENDING_HELLO_PER_SOURCE;
  private server: net.Server | null = null;
  private nextQpn = randomInt(0x100, 0x8000);
  private nextAddr = 0x7f0000000000 + randomInt(0, 0x10000) * PAGE;
  closed = false;

  constructor(name: string, host: string) {
    this.name = name;
    this.host = host;
    this.attr = { ...TCP_DEVICE_ATTR, nodeGuid: randomGuid() };
    this.keySpace = new KeySpace(this.attr.maxMr + this.attr.maxMw);
  }

  async listen(port: number): Promise<void> {
    const server = net.createServer({ noDelay: true }, (sock) => acceptIncoming(this, sock));
    this.server = server;
    await new Promise<void>((resolve, reject) => {
      server.once("error", (e) => reject(new RdmaError("PROVIDER_UNAVAILABLE", `tcp device ${this.name} cannot listen on ${this.host}:${port}: ${e.message}`, { cause: e })));
      server.listen(port, this.host, () => resolve());
    });
    server.on("error", () => {});
    server.unref();
    const a = server.address();
    this.port = typeof a === "object" && a ? a.port : 0;
  }

  queryPort(portNum = 1): PortAttr {
    checkInt("portNum", portNum, 1, 1);
    return {
      portNum,
      state: this.closed ? "DOWN" : "ACTIVE",
      activeMtu: 4096,
      maxMtu: 4096,
      linkLayer: "TCP",
      lid: 0,
      gidTblLen: 1,
      gids: [{ index: 0, gid: `${this.host}:${this.port}` }],
    };
  }

  allocPd(): ProtectionDomain {
    this.checkOpen();
    return new TcpPd(this);
  }

  createCq(depth: number): CompletionQueue {
    this.checkOpen();
    checkInt("cq depth", depth, 1, this.attr.maxCqe);
    const cq = new TcpCq(this, depth);
    this.cqs.add(cq);
    return cq;
  }

  /** A fresh key for an MR or window (its index stays reserved until {@link releaseKey}). */
  allocKey(): number {
    return this.keySpace.alloc();
  }

  releaseKey(key: number): void {
    this.keySpace.release(key);
  }

  allocQpn(): number {
    const q = this.nextQpn;
    this.nextQpn = (this.nextQpn + 1) & 0xffffff || 0x100;
    return q;
  }

  /** A fresh range of the device's virtual address space (page aligned, guard page between). */
  allocAddr(length: number, offsetInPage: number): number {
    const base = this.nextAddr;
    this.nextAddr += Math.ceil((length + offsetInPage) / PAGE) * PAGE + PAGE;
    return base + offsetInPage;
  }

  checkOpen(): void {
    if (this.closed) throw new RdmaError("INVALID_STATE", `device ${this.name} is closed`);
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    for (const qp of [...this.qps.values()]) qp.destroy();
    for (const cq of this.cqs) cq.destroy();
    this.cqs.clear();
    this.server?.close();
    this.server = null;
    this.pendingHello.destroyAll();
  }
}

function randomGuid(): string {
  const parts: string[] = [];
  for (let i = 0; i < 4; i++) parts.push(randomInt(0, 0x10000).toString(16).padStart(4, "0"));
  return parts.join(":");
}

export class TcpPd implements ProtectionDomain {
  readonly device: TcpDevice;
  private mrs = 0;
  private qps = 0;
  private mws = 0;
  deallocated = false;

  constructor(device: TcpDevice) {
    this.device = device;
  }

  registerMr(memory: number | ArrayBuffer, access: number, offset = 0, length?: number): MemoryRegion {
    this.checkOpen();
    checkInt("access", access, 0, 31);
    if (access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) && !(access & Access.LOCAL_WRITE)) {
      throw new RdmaError("INVALID_ARGUMENT", "remote write or atomic access requires LOCAL_WRITE (verbs refuses it with EINVAL)", { errno: "EINVAL" });
    }
    let buffer: ArrayBuffer;
    let len: number;
    let owned: boolean;
    if (typeof memory === "number") {
      checkInt("length", memory, 1, this.device.attr.maxMrSize);
      buffer = new ArrayBuffer(memory);
      len = memory;
      offset = 0;
      owned = true;
    } else {
      if (!(memory instanceof ArrayBuffer)) throw new RdmaError("INVALID_ARGUMENT", "registerMr takes a length or an ArrayBuffer");
      if (isDetached(memory)) throw new RdmaError("INVALID_ARGUMENT", "cannot register a detached ArrayBuffer");
      if ((memory as ArrayBuffer & { resizable?: boolean }).resizable) throw new RdmaError("INVALID_ARGUMENT", "cannot register a resizable ArrayBuffer: its memory may move");
      buffer = memory;
      checkInt("offset", offset, 0, memory.byteLength);
      len = length ?? memory.byteLength - offset;
      checkInt("length", len, 1, Math.min(memory.byteLength - offset, this.device.attr.maxMrSize));
      owned = false;
    }
    if (this.device.liveMrs >= this.device.attr.maxMr) {
      throw new RdmaError("RESOURCE_EXHAUSTED", `device ${this.device.name} already has ${this.device.attr.maxMr} MRs registered (maxMr; verbs refuses with ENOMEM)`, { errno: "ENOMEM" });
    }
    const mr = new TcpMr(this, buffer, offset, len, access, owned);
    this.mrs++;
    return mr;
  }

  allocMw(type: 1 | 2 = 2): MemoryWindow {
    this.checkOpen();
    if (type !== 1 && type !== 2) throw new RdmaError("INVALID_ARGUMENT", `memory window type must be 1 or 2, got ${String(type)}`);
    if (this.device.liveMws >= this.device.attr.maxMw) {
      throw new RdmaError("RESOURCE_EXHAUSTED", `device ${this.device.name} already has ${this.device.attr.maxMw} memory windows (maxMw; verbs refuses with ENOMEM)`, { errno: "ENOMEM" });
    }
    const mw = new TcpMw(this, type);
    this.mws++;
    return mw;
  }

  createQp(init: QpInitAttr): QueuePair {
    this.checkOpen();
    const qp = new TcpQueuePair(this, init);
    this.qps++;
    return qp;
  }

  released(kind: "mr" | "qp" | "mw"): void {
    if (kind === "mr") this.mrs--;
    else if (kind === "qp") this.qps--;
    else this.mws--;
  }

  dealloc(): void {
    if (this.deallocated) return;
    // Closing the device released everything on it (as ibv_close_device does): nothing left to refuse.
    if (this.device.closed) {
      this.deallocated = true;
      return;
    }
    if (this.mrs || this.qps || this.mws) {
      throw new RdmaError("INVALID_STATE", `protection domain still has ${this.mrs} MRs, ${this.mws} MWs and ${this.qps} QPs (verbs refuses with EBUSY)`, { errno: "EBUSY" });
    }
    this.deallocated = true;
  }

  checkOpen(): void {
    if (this.deallocated) throw new RdmaError("INVALID_STATE", "protection domain is deallocated");
    this.device.checkOpen();
  }
}

export class TcpMr implements MemoryRegion {
  readonly pd: TcpPd;
  readonly offset: number;
  readonly addr: number;
  readonly length: number;
  readonly lkey: number;
  readonly rkey: number;
  readonly access: number;
  deregistered = false;
  /** Windows bound to this MR (deregistering it with windows bound fails, as in verbs). */
  boundWindows = 0;
  private _buffer: ArrayBuffer;
  private readonly owned: boolean;
  /** Byte view over the registered range, for placement. */
  view: Uint8Array;

  constructor(pd: TcpPd, buffer: ArrayBuffer, offset: number, length: number, access: number, owned: boolean) {
    this.pd = pd;
    this._buffer = buffer;
    this.offset = offset;
    this.length = length;
    this.access = access;
    this.owned = owned;
    this.addr = pd.device.allocAddr(length, offset % PAGE);
    this.lkey = this.rkey = pd.device.allocKey();
    this.view = new Uint8Array(buffer, offset, length);
    pd.device.keys.set(this.lkey, this);
    pd.device.liveMrs++;
  }

  get buffer(): ArrayBuffer {
    return this._buffer;
  }

  /** Socket writes still reading this MR's bytes (zero-copy payloads). */
  private pendingWrites = 0;
  private detachPending = false;

  /** A socket write from this MR's bytes is queued; `writeDone` runs when the kernel has them. */
  retainForWrite(): void {
    this.pendingWrites++;
  }

  readonly writeDone = (): void => {
    if (--this.pendingWrites === 0 && this.detachPending) this.detach();
  };

  deregister(): void {
    if (this.deregistered) return;
    if (this.boundWindows > 0) throw new RdmaError("INVALID_STATE", `MR has ${this.boundWindows} memory windows bound (verbs refuses with EBUSY)`, { errno: "EBUSY" });
    this.deregistered = true;
    this.pd.device.keys.delete(this.lkey);
    this.pd.device.releaseKey(this.lkey);
    this.pd.device.liveMrs--;
    this.pd.released("mr");
    if (this.owned) {
      // Memory the provider allocated: detach every JS view so it cannot be touched after free,
      // but only once no queued socket write still reads it (else the kernel would read freed memory).
      if (this.pendingWrites > 0) this.detachPending = true;
      else this.detach();
    }
  }

  private detach(): void {
    this.detachPending = false;
    detachArrayBuffer(this._buffer);
    this.view = new Uint8Array(0);
  }
}

export class TcpMw implements MemoryWindow {
  readonly pd: TcpPd;
  readonly type: 1 | 2;
  private key: number;
  private bound = false;
  mr: TcpMr | null = null;
  addr = 0;
  length = 0;
  access = 0;
  /** Type 2 windows are bound to one QP; only that QP may use the rkey. */
  qp: TcpQueuePair | null = null;
  deallocated = false;

  constructor(pd: TcpPd, type: 1 | 2) {
    this.pd = pd;
    this.type = type;
    // The index is the window's for life; binds change only the low byte (nextRkey).
    this.key = pd.device.allocKey();
    pd.device.liveMws++;
  }

  get rkey(): number {
    return this.bound ? this.key : 0;
  }

  nextRkey(): number {
    return ((this.key & ~0xff) | ((this.key + 1) & 0xff)) >>> 0;
  }

  /** Executed by the QP when a BIND_MW WR reaches the head of its send queue. */
  bind(qp: TcpQueuePair, rkey: number, mr: TcpMr, addr: number, length: number, access: number): void {
    this.unbind();
    this.key = rkey >>> 0;
    this.mr = mr;
    this.addr = addr;
    this.length = length;
    this.access = access;
    this.qp = this.type === 2 ? qp : null;
    this.bound = true;
    mr.boundWindows++;
    this.pd.device.keys.set(this.key, this);
  }

  unbind(): void {
    if (!this.bound) return;
    this.pd.device.keys.delete(this.key);
    if (this.mr) this.mr.boundWindows--;
    this.mr = null;
    this.qp = null;
    this.bound = false;
  }

  dealloc(): void {
    if (this.deallocated) return;
    this.unbind();
    this.deallocated = true;
    this.pd.device.releaseKey(this.key);
    this.pd.device.liveMws--;
    this.pd.released("mw");
  }
}

/** Completion ring: struct of arrays, `depth` entries; overflow is a CQ error as on an HCA. */
export class TcpCq implements CompletionQueue {
  readonly device: TcpDevice;
  readonly depth: number;
  private _onNotify: (() => void) | null = null;
  /** Keeps the event loop alive while armed with a handler, as a verbs CQ's channel watcher does. */
  private hold: NodeJS.Timeout | null = null;

  get onNotify(): (() => void) | null {
    return this._onNotify;
  }

  set onNotify(f: (() => void) | null) {
    this._onNotify = f;
    this.updateHold();
  }

  private updateHold(): void {
    const want = this.armed && this._onNotify !== null && !this.destroyed;
    if (want && this.hold === null) this.hold = setInterval(() => {}, 2 ** 30);
    else if (!want && this.hold !== null) {
      clearInterval(this.hold);
      this.hold = null;
    }
  }
  private readonly ring: CompletionBuffer;
  private head = 0;
  private count = 0;
  private armed = false;
  private scheduled = false;
  destroyed = false;
  /** QPs using this CQ, moved to ERR on overrun. */
  readonly qps = new Set<TcpQueuePair>();

  constructor(device: TcpDevice, depth: number) {
    this.device = device;
    this.depth = depth;
    this.ring = new CompletionBuffer(depth);
  }

  push(wrId: number, status: number, opcode: number, flags: number, byteLen: number, imm: number, qpNum: number): void {
    if (this.destroyed) return;
    if (this.count === this.depth) {
      const e: AsyncEvent = { type: "CQ_ERR", reason: `completion queue overrun (depth ${this.depth}): poll faster or create a deeper CQ` };
      this.device.onEvent?.(e);
      for (const qp of this.qps) qp.fatal("CQ_ERR", e.reason);
      return;
    }
    const r = this.ring;
    const i = (this.head + this.count) % this.depth;
    r.wrId[i] = wrId;
    r.status[i] = status;
    r.opcode[i] = opcode;
    r.flags[i] = flags;
    r.byteLen[i] = byteLen;
    r.imm[i] = imm;
    r.qpNum[i] = qpNum;
    r.vendorErr[i] = 0;
    this.count++;
    if (this.armed && !this.scheduled) {
      this.armed = false;
      this.scheduled = true;
      setImmediate(() => {
        this.scheduled = false;
        if (!this.destroyed) this._onNotify?.();
        this.updateHold();
      });
    }
  }

  poll(out: CompletionBuffer, max?: number): number {
    if (this.destroyed) throw new RdmaError("INVALID_STATE", "poll on a destroyed completion queue", { errno: "EINVAL" });
    if (!(out instanceof CompletionBuffer)) throw new RdmaError("INVALID_ARGUMENT", "poll needs a CompletionBuffer");
    if (max === undefined) max = out.capacity;
    else checkInt("max", max, 0, 2 ** 31);
    const n = Math.min(max, out.capacity, this.count);
    const r = this.ring;
    for (let k = 0; k < n; k++) {
      const i = this.head;
      out.wrId[k] = r.wrId[i]!;
      out.status[k] = r.status[i]!;
      out.opcode[k] = r.opcode[i]!;
      out.flags[k] = r.flags[i]!;
      out.byteLen[k] = r.byteLen[i]!;
      out.imm[k] = r.imm[i]!;
      out.qpNum[k] = r.qpNum[i]!;
      out.vendorErr[k] = r.vendorErr[i]!;
      this.head = (this.head + 1) % this.depth;
    }
    this.count -= n;
    return n;
  }

  requestNotify(): void {
    if (this.destroyed) throw new RdmaError("INVALID_STATE", "requestNotify on a destroyed completion queue", { errno: "EINVAL" });
    this.armed = true;
    this.updateHold();
  }

  destroy(): void {
    if (this.destroyed) return;
    if (this.qps.size > 0 && !this.device.closed) throw new RdmaError("INVALID_STATE", `completion queue still used by ${this.qps.size} QPs (verbs refuses with EBUSY)`, { errno: "EBUSY" });
    this.destroyed = true;
    // A destroyed CQ leaves the device's table (it held ~8 KiB per closed connection).
    this.device.cqs.delete(this);
    this.updateHold();
  }
}
