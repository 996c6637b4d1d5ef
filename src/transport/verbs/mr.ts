/**
 * Memory regions and memory windows of the verbs provider. Their PD and
 * device are seen through the interfaces below (VerbsPd and VerbsDevice in
 * device.ts implement them), so this module imports neither.
 */
import { RdmaError, checkInt } from "../../errors.js";
import type { Device, MemoryRegion, MemoryWindow, ProtectionDomain } from "../types.js";
import { setDetacher } from "../buffers.js";
import { nativeError } from "./errors.js";
import type { MrHandle, MwHandle, NativeAddon } from "./native.js";

/** What an MR or a window needs from its device. */
export interface MrDevice extends Device {
  readonly addon: NativeAddon;
  readonly closed: boolean;
  /** lkey -> MR, to validate inline sends (the library copies those bytes itself). */
  readonly mrs: Map<number, WeakRef<VerbsMr>>;
}

/** What an MR or a window needs from its protection domain. */
export interface MrPd extends ProtectionDomain {
  readonly device: MrDevice;
}

/** A QP a type-2 window is bound through (VerbsQp): it deallocates its windows before it goes. */
export interface WindowQp {
  readonly boundWindows: Set<VerbsMw>;
}

export class VerbsMr implements MemoryRegion {
  readonly pd: MrPd;
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

  constructor(pd: MrPd, handle: MrHandle, buffer: ArrayBuffer, offset: number, addr: number, length: number, lkey: number, rkey: number, access: number, owned: boolean) {
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
  readonly pd: MrPd;
  readonly handle: MwHandle;
  readonly type: 1 | 2;
  /** Last rkey the window had (its current one when bound). */
  key: number;
  bound = false;
  /** The QP the window was last bound through. */
  qp: WindowQp | null = null;
  private _deallocated = false;

  constructor(pd: MrPd, handle: MwHandle, type: 1 | 2, rkey: number) {
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
