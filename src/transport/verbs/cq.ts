/**
 * Completion queues of the verbs provider: ibv_poll_cq into the caller's
 * arrays, and notifications through the CQ's completion channel. The device
 * is seen through CqDevice (VerbsDevice in device.ts implements it), so this
 * module does not import device.ts.
 */
import { RdmaError } from "../../errors.js";
import type { CompletionBuffer, CompletionQueue, Device } from "../types.js";
import { nativeError } from "./errors.js";
import type { ContextHandle, CqHandle, NativeAddon } from "./native.js";

/** What a CQ needs from its device. */
export interface CqDevice extends Device {
  readonly addon: NativeAddon;
  readonly ctx: ContextHandle;
  readonly closed: boolean;
  /** A completion with an error status means its QP went to ERR (RC semantics). */
  markError(qpNum: number): void;
}

export class VerbsCq implements CompletionQueue {
  readonly device: CqDevice;
  readonly depth: number;
  readonly handle: CqHandle;
  destroyed = false;
  private handler: (() => void) | null = null;
  /** Held here: the addon keeps only a weak reference to it (strong while armed). */
  private readonly notifyHandler: () => void;

  constructor(device: CqDevice, depth: number) {
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
    const had = this.handler !== null && this.keep;
    this.handler = typeof fn === "function" ? fn : null;
    const has = this.handler !== null && this.keep;
    if (had !== has && !this.destroyed && !this.device.closed) this.device.addon.keepAliveCq(this.handle, has);
  }

  private keep = true;

  setKeepAlive(on: boolean): void {
    const had = this.handler !== null && this.keep;
    this.keep = on;
    const has = this.handler !== null && this.keep;
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
