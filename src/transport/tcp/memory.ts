/**
 * Memory of the tcp provider: MRs and memory windows, how a local SGE
 * resolves to bytes, and the rules of binding and invalidating a window.
 *
 * Every access to registered memory goes through an MR's view, at a range
 * that was checked here (local SGEs) or by the responder (remote keys);
 * placement stops once the MR is deregistered (frame-reader.ts).
 */
import { RdmaError } from "../../errors.js";
import { Access, type Device, type MemoryRegion, type MemoryWindow, type ProtectionDomain, type Sge } from "../types.js";
import { detachArrayBuffer } from "../buffers.js";
import type { DvCache } from "./bytes.js";

export const PAGE = 4096;

export type KeyTarget = TcpMr | TcpMw;

/** What MRs and windows need from their device (TcpDevice): its key table and address space. */
export interface MemoryDevice extends Device {
  /** lkey/rkey → MR or MW. One key space per device, as on an HCA. */
  readonly keys: Map<number, KeyTarget>;
  liveMrs: number;
  liveMws: number;
  allocKey(): number;
  releaseKey(key: number): void;
  allocAddr(length: number, offsetInPage: number): number;
}

/** What MRs and windows need from their protection domain (TcpPd). */
export interface MemoryPd extends ProtectionDomain {
  readonly device: MemoryDevice;
  released(kind: "mr" | "mw"): void;
}

/** The QP a type-2 window is bound to (only it may use the window's rkey). */
export interface WindowOwner {
  readonly boundWindows: Set<TcpMw>;
}

/**
 * Queued socket writes per backing ArrayBuffer, whichever registration they
 * went through: the owning MR's, or a grant's or share's over part of its
 * bytes (a READ response). The owner neither detaches nor renews its buffer
 * while any is queued, so no write can see bytes freed or reused under it.
 */
const buffersInWrites = new Map<ArrayBuffer, { n: number; then: (() => void)[] }>();

function retainBuffer(b: ArrayBuffer): void {
  const e = buffersInWrites.get(b);
  if (e) e.n++;
  else buffersInWrites.set(b, { n: 1, then: [] });
}

function releaseBuffer(b: ArrayBuffer): void {
  const e = buffersInWrites.get(b);
  if (!e || --e.n > 0) return;
  buffersInWrites.delete(b);
  for (const f of e.then) f();
}

function waitForWrites(b: ArrayBuffer, f: () => void): void {
  const e = buffersInWrites.get(b);
  if (e) e.then.push(f);
  else f();
}

export class TcpMr implements MemoryRegion {
  readonly pd: MemoryPd;
  readonly offset: number;
  readonly addr: number;
  readonly length: number;
  readonly lkey: number;
  readonly rkey: number;
  readonly access: number;
  deregistered = false;
  /**
   * Deregistered, or the caller detached its own buffer since registering it
   * (a transfer): no byte may be read from or placed in it. Such an access
   * fails like one to a deregistered MR instead of throwing in a socket callback.
   */
  get unusable(): boolean {
    return this.deregistered || (this.length > 0 && this.view.byteLength === 0);
  }
  /** Windows bound to this MR (deregistering it with windows bound fails, as in verbs). */
  boundWindows = 0;
  private _buffer: ArrayBuffer;
  private readonly owned: boolean;
  /** Byte view over the registered range, for placement. */
  view: Uint8Array;
  /** A DataView over `view`'s buffer for small copies (bytes.ts), renewed with the buffer. */
  readonly dvc: DvCache = { ab: null, dv: null };

  constructor(pd: MemoryPd, buffer: ArrayBuffer, offset: number, length: number, access: number, owned: boolean) {
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

  /** Detaching waits for queued socket writes from these bytes (buffersInWrites). */
  private detachPending = false;
  /** The buffer whose write count this MR's retains went to (fixed while any is pending). */
  private retainedIn: ArrayBuffer | null = null;

  /** A socket write from this MR's bytes is queued; `writeDone` runs when the kernel has them. */
  retainForWrite(): void {
    this.retainedIn = this._buffer;
    retainBuffer(this._buffer);
  }

  readonly writeDone = (): void => {
    releaseBuffer(this.retainedIn!);
  };

  deregister(): void {
    if (this.deregistered) return;
    if (this.boundWindows > 0) throw new RdmaError("INVALID_STATE", `MR has ${this.boundWindows} memory windows bound (verbs refuses with EBUSY)`, { errnoName: "EBUSY" });
    this.deregistered = true;
    this.pd.device.keys.delete(this.lkey);
    this.pd.device.releaseKey(this.lkey);
    this.pd.device.liveMrs--;
    this.pd.released("mr");
    if (this.owned) {
      // Memory the provider allocated: detach every JS view so it cannot be touched after free,
      // but only once no queued socket write still reads it (else the kernel would read freed
      // memory). Writes count per buffer: a READ response from a grant or share over this MR's
      // bytes retains them too.
      this.detach();
    }
  }

  renewBuffer(): boolean {
    if (!this.owned || this.deregistered || buffersInWrites.has(this._buffer) || this.boundWindows > 0) return false;
    // A transfer moves the bytes to a new ArrayBuffer (no copy) and detaches the old one.
    this._buffer = structuredClone(this._buffer, { transfer: [this._buffer] });
    this.view = new Uint8Array(this._buffer, this.offset, this.length);
    return true;
  }

  private detach(): void {
    if (buffersInWrites.has(this._buffer)) {
      // A write from these bytes (through this MR, or a grant or share over them) is queued.
      if (!this.detachPending) {
        this.detachPending = true;
        waitForWrites(this._buffer, () => {
          this.detachPending = false;
          this.detach();
        });
      }
      return;
    }
    detachArrayBuffer(this._buffer);
    this.view = new Uint8Array(0);
  }
}

export class TcpMw implements MemoryWindow {
  readonly pd: MemoryPd;
  readonly type: 1 | 2;
  private key: number;
  private bound = false;
  mr: TcpMr | null = null;
  addr = 0;
  length = 0;
  access = 0;
  /** Type 2 windows are bound to one QP; only that QP may use the rkey. */
  qp: WindowOwner | null = null;
  deallocated = false;

  constructor(pd: MemoryPd, type: 1 | 2) {
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
  bind(qp: WindowOwner, rkey: number, mr: TcpMr, addr: number, length: number, access: number): void {
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

/**
 * The MR a local SGE of at least one byte names, or null for a local
 * protection error: the lkey must name a live MR of `pd` (not a window),
 * with LOCAL_WRITE when `needWrite`, and the range must lie inside it. The
 * bytes are `mr.view[s.addr - mr.addr, +s.length)` (no view is made: the
 * per-message paths copy or place through the MR itself).
 */
export function sgeMr(pd: MemoryPd, s: Sge, needWrite: boolean): TcpMr | null {
  const t = pd.device.keys.get(s.lkey);
  if (!t || !("lkey" in t) || t.lkey !== s.lkey || t.pd !== pd || t.unusable) return null;
  if (needWrite && !(t.access & Access.LOCAL_WRITE)) return null;
  const off = s.addr - t.addr;
  if (off < 0 || off + s.length > t.length) return null;
  return t;
}

/**
 * BIND_MW at the head of `qp`'s send queue: a type-2 window of the QP's PD,
 * over an MR of that PD with MW_BIND, inside the MR, with the window's own
 * key index; remote write or atomic needs the MR's local write. False:
 * MW_BIND_ERR.
 */
export function bindWindow(qp: WindowOwner, pd: MemoryPd, mw: TcpMw, rkey: number, mr: TcpMr, addr: number, length: number, access: number): boolean {
  if (
    mw.deallocated ||
    mw.pd !== pd ||
    mw.type !== 2 ||
    !mr ||
    mr.unusable ||
    mr.pd !== pd ||
    !(mr.access & Access.MW_BIND) ||
    rkey >>> 8 !== mw.nextRkey() >>> 8 ||
    addr < mr.addr ||
    addr + length > mr.addr + mr.length ||
    (access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) && !(mr.access & Access.LOCAL_WRITE))
  ) {
    return false;
  }
  if (mw.qp) mw.qp.boundWindows.delete(mw);
  mw.bind(qp, rkey, mr, addr, length, access);
  qp.boundWindows.add(mw);
  return true;
}

/** LOCAL_INV of a type-2 window's rkey in `qp`'s PD. False: local protection error. */
export function invalidateWindow(qp: WindowOwner, pd: MemoryPd, rkey: number): boolean {
  const t = pd.device.keys.get(rkey);
  if (!t || "lkey" in t || t.pd !== pd || t.type !== 2) return false;
  qp.boundWindows.delete(t);
  t.unbind();
  return true;
}
