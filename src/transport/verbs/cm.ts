/**
 * RDMA CM (librdmacm) for the verbs provider: typed ids over the native
 * addon (native/cm.c), with events awaited under deadlines.
 *
 * One event channel per process (the addon's), watched by uv_poll; every
 * event is acknowledged natively before it reaches JS. Events go to the id
 * they belong to: to its `onEvent` handler when one is set, else into a queue
 * that {@link CmId.next} takes from. The channel keeps the process alive only
 * while something waits for an event or an id listens.
 *
 * The "user-managed QP" model: the CM never creates a QP. The caller creates
 * its own on the device {@link CmId.info} names, passes its number to
 * connect/accept and drives INIT → RTR → RTS with {@link CmId.initQpAttr}.
 */
import { RdmaError } from "../../errors.js";
import { abortableWait, type Settle } from "../wait.js";
import { nativeError } from "./errors.js";
import { loadCmAddon, type CmIdHandle, type NativeCmAddon, type NativeCmConnParam } from "./native.js";
import { CmEventType, type CmConnParam, type CmConnectParams, type CmEvent, type CmId as SeamCmId, type CmInfo, type CmQpAttr, type RdmaCm } from "../types.js";

export { CmEventType };
const eventNames: string[] = [];
for (const [k, v] of Object.entries(CmEventType)) eventNames[v] = k;
export function cmEventName(t: number): string {
  return eventNames[t] ?? `EVENT_${t}`;
}

export type { CmConnParam, CmQpAttr, CmInfo, CmEvent };

/** IB CM reject reasons that a connect can meet (IBTA 12.6.7.2). */
const REJECT_REASONS: Record<number, string> = {
  1: "no QP available at the peer",
  2: "no EEC available at the peer",
  3: "no resources at the peer",
  4: "timeout",
  5: "unsupported request",
  6: "invalid communication id",
  7: "invalid communication instance",
  8: "no listener on that address and port (invalid service id)",
  9: "invalid transport type",
  10: "stale connection",
  11: "redirect",
  12: "invalid starting PSN",
  13: "invalid ACK timeout",
  26: "peer does not support the port",
  28: "rejected by the peer's application",
  30: "duplicate local communication id",
  31: "invalid class version",
};
export function cmRejectReason(status: number): string {
  return REJECT_REASONS[status] ?? `reject reason ${status}`;
}

let addon: NativeCmAddon | null = null;
const ids = new Map<number, CmId>();
let holds = 0;

function hold(d: 1 | -1): void {
  const before = holds;
  holds += d;
  if ((before === 0) !== (holds === 0)) addon?.keepAlive(holds > 0);
}

function onNativeEvent(token: number, type: number, status: number, pdata: ArrayBuffer | null, conn: NativeCmConnParam | null, child: [CmIdHandle, number] | null): void {
  const id = ids.get(token);
  const childId = child && addon ? new CmId(addon, child[0], child[1]) : null;
  if (!id) {
    childId?.destroy();
    return;
  }
  id.deliver({ type, name: cmEventName(type), status, privateData: pdata ? new Uint8Array(pdata) : null, conn, child: childId });
}

/** The addon, loaded once; PROVIDER_UNAVAILABLE with the reason and the fix when it is not built. */
export function cmAddon(): NativeCmAddon {
  if (addon) return addon;
  const r = loadCmAddon();
  if (!r.ok) throw new RdmaError("PROVIDER_UNAVAILABLE", `RDMA CM is not available: ${r.reason}`);
  r.addon.init(onNativeEvent);
  addon = r.addon;
  return addon;
}

function call<T>(what: string, fn: () => T): T {
  try {
    return fn();
  } catch (e) {
    throw nativeError(e, what);
  }
}

export class CmId implements SeamCmId {
  /** Handler for events once the id is in use (e.g. DISCONNECTED); null: events queue for {@link next}. */
  onEvent: ((e: CmEvent) => void) | null = null;
  private readonly queue: CmEvent[] = [];
  private waiter: Settle<CmEvent> | null = null;
  private destroyed = false;
  private listening = false;

  /** @internal */
  constructor(
    private readonly a: NativeCmAddon,
    readonly handle: CmIdHandle,
    readonly token: number,
  ) {
    ids.set(token, this);
  }

  static create(): CmId {
    const a = cmAddon();
    const [h, token] = call("rdma_create_id", () => a.createId());
    return new CmId(a, h, token);
  }

  get isDestroyed(): boolean {
    return this.destroyed;
  }

  /** @internal */
  deliver(e: CmEvent): void {
    if (this.destroyed) {
      e.child?.destroy();
      return;
    }
    if (this.onEvent) return this.onEvent(e);
    const w = this.waiter;
    if (w) {
      this.waiter = null;
      w.resolve(e);
    } else {
      this.queue.push(e);
    }
  }

  /**
   * The next event of this id, or a TIMEOUT / ABORTED RdmaError when the
   * deadline passes or the signal aborts first. `what` names the step for errors.
   */
  next(what: string, timeoutMs: number, signal?: AbortSignal): Promise<CmEvent> {
    const q = this.queue.shift();
    if (q) return Promise.resolve(q);
    if (this.destroyed) return Promise.reject(new RdmaError("INVALID_STATE", `${what}: the RDMA CM id is destroyed`));
    if (signal?.aborted) return Promise.reject(new RdmaError("ABORTED", `${what} aborted`));
    if (this.waiter) return Promise.reject(new RdmaError("INVALID_STATE", `${what}: another wait on this RDMA CM id is pending`));
    let held = false;
    return abortableWait<CmEvent>(
      (w) => {
        hold(1);
        held = true;
        this.waiter = w;
      },
      {
        signal,
        timeoutMs,
        onAbort: (w) => w.reject(new RdmaError("ABORTED", `${what} aborted`)),
        onTimeout: (w) => w.reject(new RdmaError("TIMEOUT", `${what} timed out after ${timeoutMs} ms`)),
        cleanup: () => {
          if (held) hold(-1);
          this.waiter = null;
        },
      },
    );
  }

  bind(host: string | null, port: number): void {
    call(`rdma_bind_addr(${host ?? "*"}:${port})`, () => this.a.bindAddr(this.handle, host, port));
  }

  /** Starts listening; the id keeps the process alive until destroyed. */
  listen(backlog = 128): void {
    call("rdma_listen", () => this.a.listen(this.handle, backlog));
    if (!this.listening) {
      this.listening = true;
      hold(1);
    }
  }

  resolveAddr(src: string | null, dst: string, port: number, timeoutMs: number): void {
    call(`rdma_resolve_addr(${dst})`, () => this.a.resolveAddr(this.handle, src, dst, port, timeoutMs));
  }

  resolveRoute(timeoutMs: number): void {
    call("rdma_resolve_route", () => this.a.resolveRoute(this.handle, timeoutMs));
  }

  connect(qpNum: number, privateData: Uint8Array, p: CmConnectParams): void {
    call("rdma_connect", () => this.a.connect(this.handle, qpNum, privateData, p.responderResources, p.initiatorDepth, p.retryCount, p.rnrRetryCount));
  }

  accept(qpNum: number, privateData: Uint8Array, p: CmConnectParams): void {
    call("rdma_accept", () => this.a.accept(this.handle, qpNum, privateData, p.responderResources, p.initiatorDepth, p.retryCount, p.rnrRetryCount));
  }

  establish(): void {
    call("rdma_establish", () => this.a.establish(this.handle));
  }

  reject(privateData: Uint8Array | null): void {
    call("rdma_reject", () => this.a.reject(this.handle, privateData));
  }

  /** Sends a DREQ (both sides then see DISCONNECTED); never throws. */
  disconnect(): void {
    if (this.destroyed) return;
    try {
      this.a.disconnect(this.handle);
    } catch {
      /* nothing to disconnect */
    }
  }

  info(): CmInfo {
    return call("rdma_cm_id info", () => this.a.info(this.handle));
  }

  initQpAttr(state: 1 | 2 | 3): CmQpAttr {
    return call("rdma_init_qp_attr", () => this.a.initQpAttr(this.handle, state));
  }

  /** rdma_destroy_id; idempotent. Queued children are destroyed too. */
  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    this.onEvent = null;
    ids.delete(this.token);
    if (this.listening) {
      this.listening = false;
      hold(-1);
    }
    for (const e of this.queue.splice(0)) e.child?.destroy();
    this.waiter?.reject(new RdmaError("CONNECTION_CLOSED", "the RDMA CM id was destroyed"));
    try {
      this.a.destroyId(this.handle);
    } catch {
      /* already gone */
    }
  }

  errnoName(n: number): string {
    try {
      return this.a.errnoName(Math.abs(n));
    } catch {
      return `errno ${n}`;
    }
  }
}

/** The provider's RDMA CM (Provider.rdmaCm): loads librdmacm's addon on first use. */
export function rdmaCm(): RdmaCm {
  cmAddon();
  return { createId: () => CmId.create(), rejectReason: cmRejectReason };
}
