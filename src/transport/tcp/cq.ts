/**
 * The tcp provider's completion queue: a ring of `depth` entries (struct of
 * arrays, as the seam's CompletionBuffer) with verbs-exact notification (arm,
 * then poll once more). Overrun is a CQ error, as on an HCA: every QP using
 * the CQ moves to ERR.
 *
 * Notification: a completion made while a socket's bytes are being handled
 * (inside {@link deliverAfter}) notifies an armed CQ when those bytes are
 * done, in the same callback: every completion of one read is seen in one
 * wake-up, with no event-loop hop. A completion made anywhere else (a flush
 * to ERR, a local error) notifies from a setImmediate. Either way the
 * notification comes after the call that armed the CQ returned, as on verbs.
 */
import { RdmaError, checkInt } from "../../errors.js";
import { CompletionBuffer, type AsyncEvent, type AsyncEventType, type CompletionQueue, type Device } from "../types.js";
import { VisitList } from "./ring.js";

/** What a CQ needs from its device (TcpDevice). */
export interface CqDevice extends Device {
  readonly closed: boolean;
  readonly cqs: Set<TcpCq>;
}

/** A QP using the CQ (moved to ERR when the CQ overruns). */
export interface CqUser {
  fatal(type: AsyncEventType, reason: string): void;
}

/** Socket reads being handled now (nested) and the CQs they completed into while armed. */
let reading = 0;
/** The CQs to notify at the end of the read (reused: no list per read). */
const toNotify = new VisitList<TcpCq>();
const notify = (cq: TcpCq): void => cq.notifyNow();

/**
 * Hands one socket read's bytes to `sink`, then notifies every armed CQ that
 * got a completion meanwhile, once each.
 */
export function deliverAfter(sink: (buf: Buffer, start: number, end: number) => void, buf: Buffer, start: number, end: number): void {
  reading++;
  try {
    sink(buf, start, end);
  } finally {
    if (--reading === 0 && toNotify.length > 0) toNotify.run(notify);
  }
}

/** Completion ring: struct of arrays, `depth` entries; overflow is a CQ error as on an HCA. */
export class TcpCq implements CompletionQueue {
  readonly device: CqDevice;
  readonly depth: number;
  /** Completions come from socket events handled on this thread: notification never misses one. */
  readonly eventDriven = true;
  private _onNotify: (() => void) | null = null;
  /**
   * Keeps the event loop alive while armed with a handler, as a verbs CQ's
   * channel watcher does: one timer per CQ, ref'd and unref'd (cheap) rather
   * than created per arm.
   */
  private hold: NodeJS.Timeout | null = null;
  private holding = false;

  get onNotify(): (() => void) | null {
    return this._onNotify;
  }

  set onNotify(f: (() => void) | null) {
    this._onNotify = f;
    this.updateHold();
  }

  private keep = true;

  setKeepAlive(on: boolean): void {
    this.keep = on;
    this.updateHold();
  }

  private updateHold(): void {
    const want = this.armed && this._onNotify !== null && !this.destroyed && this.keep;
    if (this.destroyed) {
      if (this.hold !== null) clearInterval(this.hold);
      this.hold = null;
      this.holding = false;
      return;
    }
    if (want === this.holding) return;
    this.holding = want;
    if (want) {
      if (this.hold === null) this.hold = setInterval(() => {}, 2 ** 30);
      else this.hold.ref();
    } else this.hold!.unref();
  }
  private readonly ring: CompletionBuffer;
  private head = 0;
  private count = 0;
  private armed = false;
  private scheduled = false;
  destroyed = false;
  /** QPs using this CQ, moved to ERR on overrun. */
  readonly qps = new Set<CqUser>();

  constructor(device: CqDevice, depth: number) {
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
      if (reading > 0) toNotify.add(this);
      else setImmediate(this.notifyLater);
    }
  }

  private readonly notifyLater = (): void => this.notifyNow();

  /** A notification that was scheduled: runs the handler (once per arm). */
  notifyNow(): void {
    this.scheduled = false;
    if (!this.destroyed) this._onNotify?.();
    this.updateHold();
  }

  poll(out: CompletionBuffer, max?: number): number {
    if (this.destroyed) throw new RdmaError("INVALID_STATE", "poll on a destroyed completion queue", { errnoName: "EINVAL" });
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
    if (this.destroyed) throw new RdmaError("INVALID_STATE", "requestNotify on a destroyed completion queue", { errnoName: "EINVAL" });
    this.armed = true;
    this.updateHold();
  }

  destroy(): void {
    if (this.destroyed) return;
    if (this.qps.size > 0 && !this.device.closed) throw new RdmaError("INVALID_STATE", `completion queue still used by ${this.qps.size} QPs (verbs refuses with EBUSY)`, { errnoName: "EBUSY" });
    this.destroyed = true;
    // A destroyed CQ leaves the device's table (it held ~8 KiB per closed connection).
    this.device.cqs.delete(this);
    this.updateHold();
  }
}
