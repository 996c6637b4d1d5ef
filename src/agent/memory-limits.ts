/**
 * LIMITS, both ways: this side sends its limits once at start; the peer's
 * arrive once (a second LIMITS is a protocol error) and wake whoever waits
 * for them. Until they arrive the requester checks nothing against them
 * (the owner refuses what is over them anyway).
 */
import { RdmaError } from "../errors.js";
import { abortableWait, type Settle } from "./queue.js";
import { MsgType } from "./codec.js";
import type { Kind, MemoryHost, MemoryLimits, PeerLimits } from "./memory-host.js";

/** @internal */
export class LimitsExchange {
  /** The peer's limits, once its LIMITS message arrived. */
  peerLimits: PeerLimits | null = null;
  private readonly limitWaiters = new Set<Settle<PeerLimits>>();

  constructor(
    private readonly host: Pick<MemoryHost, "sendCtrl" | "protocolError">,
    private readonly limits: MemoryLimits,
  ) {}

  /** This side's limits for the peer (sent once at start). */
  sendLimits(maxMessageSize: number): void {
    this.host.sendCtrl({
      type: MsgType.LIMITS,
      maxLeaseMs: Math.min(this.limits.maxLeaseMs, 0xffffffff),
      maxMessageSize: Math.min(maxMessageSize, 0xffffffff),
      quotaBytes: Math.min(this.limits.quotaBytes, Number.MAX_SAFE_INTEGER),
      maxRegions: Math.min(this.limits.maxRegions, 0xffffffff),
    });
  }

  onLimits(m: Kind<typeof MsgType.LIMITS>): void {
    if (this.peerLimits) return this.host.protocolError("LIMITS sent twice");
    this.peerLimits = { maxLeaseMs: m.maxLeaseMs, maxMessageSize: m.maxMessageSize, quotaBytes: m.quotaBytes, maxRegions: m.maxRegions };
    for (const w of [...this.limitWaiters]) w.resolve(this.peerLimits);
  }

  /** Resolves once the peer's limits are known (or at once). */
  whenLimits(timeoutMs: number): Promise<PeerLimits> {
    if (this.peerLimits) return Promise.resolve(this.peerLimits);
    return abortableWait<PeerLimits>((w) => this.limitWaiters.add(w), {
      timeoutMs,
      onTimeout: (w) => w.reject(new RdmaError("TIMEOUT", `the peer did not send its limits within ${timeoutMs} ms`)),
      cleanup: (w) => this.limitWaiters.delete(w),
    });
  }
}
