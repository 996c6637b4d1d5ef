/**
 * Device and PD of the tcp provider: the device's limits, key space, virtual
 * address space and listening port, and the PD's bookkeeping of what it
 * holds. MRs and windows live in memory.ts, the CQ in cq.ts, the QP (the
 * transport proper) in qp.ts.
 */
import * as net from "node:net";
import { randomInt } from "node:crypto";
import { RdmaError, checkInt } from "../../errors.js";
import {
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
} from "../types.js";
import { validateMrAccess, validateMrRange } from "../validate.js";
import { isDetached } from "../buffers.js";
import { TcpQueuePair } from "./qp.js";
import { TcpCq } from "./cq.js";
import { PAGE, TcpMr, TcpMw, type KeyTarget } from "./memory.js";
import { HELLO_TIMEOUT_MS, MAX_PENDING_HELLO, MAX_PENDING_HELLO_PER_SOURCE, PendingStreams, acceptIncoming } from "./accept.js";
import { KeySpace } from "./keys.js";

export { TcpMr, TcpMw, type KeyTarget } from "./memory.js";
export { TcpCq } from "./cq.js";

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
    // Accepted paused: read-path.ts gives the socket `onread` before its first read.
    const server = net.createServer({ noDelay: true, pauseOnConnect: true }, (sock) => acceptIncoming(this, sock));
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

  registerMr(memory: number | ArrayBuffer | SharedArrayBuffer, access: number, offset = 0, length?: number): MemoryRegion {
    this.checkOpen();
    validateMrAccess(access);
    if (memory instanceof ArrayBuffer && isDetached(memory)) throw new RdmaError("INVALID_ARGUMENT", "cannot register a detached ArrayBuffer");
    const range = validateMrRange(memory, offset, length, this.device.attr.maxMrSize);
    const owned = typeof memory === "number";
    // A SharedArrayBuffer is read and written in place like an ArrayBuffer (never detached: not owned).
    const buffer = typeof memory === "number" ? new ArrayBuffer(range.length) : (memory as ArrayBuffer);
    if (this.device.liveMrs >= this.device.attr.maxMr) {
      throw new RdmaError("RESOURCE_EXHAUSTED", `device ${this.device.name} already has ${this.device.attr.maxMr} MRs registered (maxMr; verbs refuses with ENOMEM)`, { errnoName: "ENOMEM" });
    }
    const mr = new TcpMr(this, buffer, range.offset, range.length, access, owned);
    this.mrs++;
    return mr;
  }

  allocMw(type: 1 | 2 = 2): MemoryWindow {
    this.checkOpen();
    if (type !== 1 && type !== 2) throw new RdmaError("INVALID_ARGUMENT", `memory window type must be 1 or 2, got ${String(type)}`);
    if (this.device.liveMws >= this.device.attr.maxMw) {
      throw new RdmaError("RESOURCE_EXHAUSTED", `device ${this.device.name} already has ${this.device.attr.maxMw} memory windows (maxMw; verbs refuses with ENOMEM)`, { errnoName: "ENOMEM" });
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
      throw new RdmaError("INVALID_STATE", `protection domain still has ${this.mrs} MRs, ${this.mws} MWs and ${this.qps} QPs (verbs refuses with EBUSY)`, { errnoName: "EBUSY" });
    }
    this.deallocated = true;
  }

  checkOpen(): void {
    if (this.deallocated) throw new RdmaError("INVALID_STATE", "protection domain is deallocated");
    this.device.checkOpen();
  }
}
