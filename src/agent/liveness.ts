/**
 * Liveness of one connection: the agent's bound on a dead or stopped peer,
 * the same rule on every provider (the tcp provider's own requester timer is
 * transport/tcp/liveness.ts).
 *
 * Invariant: while this side waits on the peer (work posted, or a PING or a
 * rendezvous cancel unanswered), the peer must make progress within
 * `peerTimeoutMs`, or the connection fails with RETRY_EXCEEDED. When nothing
 * arrived for `keepaliveMs`, the peer's agent is PINGed, and the peer timeout
 * counts from when that PING was due, not from the check that sent it. Time
 * this process's own event loop did not run (a check that comes late: a long
 * synchronous task, GC, a starved CPU) never counts against the peer. Checks
 * run every min(keepalive, peer timeout / 4, at least 10 ms), so a dead peer
 * is noticed at most one check after keepalive + peer timeout.
 */
import { RdmaError } from "../errors.js";
import { excuseOwnStall } from "../transport/stall.js";

/** What liveness needs from its connection. */
export interface LivenessHost {
  /** The connection failed or is closing: nothing to watch. */
  isDown(): boolean;
  /** Work requests posted and not completed. */
  outstanding(): number;
  /** Sends a PING the peer's agent answers. */
  ping(): void;
  /** The peer made no progress within the peer timeout. */
  expire(err: RdmaError): void;
}

export class Liveness {
  /** When the peer last made progress (a completion), or when waiting started. */
  lastProgress: number;
  /** When something last arrived from the peer. */
  lastArrival: number;
  /** A PING or a rendezvous cancel waits for the peer's answer. */
  awaitingAnswer = false;
  private lastCheck = 0;
  private every = 0;
  private timer: NodeJS.Timeout | null = null;

  constructor(
    private readonly host: LivenessHost,
    private readonly keepaliveMs: number,
    private readonly peerTimeoutMs: number,
    private readonly now: () => number = () => performance.now(),
  ) {
    this.lastProgress = this.lastArrival = now();
  }

  /** Starts the periodic check (keepalive 0 and peer timeout 0: none). */
  start(): void {
    const k = this.keepaliveMs;
    const t = this.peerTimeoutMs;
    const every = Math.min(k > 0 ? k : Infinity, t > 0 ? Math.max(10, t / 4) : Infinity);
    if (every === Infinity) return;
    this.lastProgress = this.lastArrival = this.lastCheck = this.now();
    this.every = every;
    this.timer = setInterval(() => this.check(), every);
    this.timer.unref();
  }

  stop(): void {
    if (this.timer) clearInterval(this.timer);
    this.timer = null;
  }

  /**
   * Something arrived from the peer (any receive): it is alive, and
   * answered. `at`: when (the poller's drain time, so a drain of many
   * completions reads the clock once); now if not given.
   */
  arrived(at: number = this.now()): void {
    this.lastArrival = at;
    this.awaitingAnswer = false;
  }

  /** A work request completed (`at`: when, as for arrived()). */
  progressed(at: number = this.now()): void {
    this.lastProgress = at;
  }

  /** Work is posted while none was outstanding: the wait starts now (`at`: the post's time). */
  startWaiting(at: number = this.now()): void {
    this.lastProgress = at;
  }

  /** One check (the timer's tick; tests call it with their own clock). */
  check(): void {
    if (this.host.isDown()) return;
    const now = this.now();
    // A check that comes late means this process's event loop was blocked: completions may be
    // waiting unread in the sockets or the CQ. That time is ours, not the peer's (transport/stall.ts).
    this.lastProgress = excuseOwnStall(this.lastProgress, now, this.lastCheck, this.every, this.every);
    this.lastArrival = excuseOwnStall(this.lastArrival, now, this.lastCheck, this.every, this.every);
    this.lastCheck = now;
    const t = this.peerTimeoutMs;
    const outstanding = this.host.outstanding();
    const waiting = outstanding > 0 || this.awaitingAnswer;
    if (t > 0 && waiting && now - this.lastProgress > t) {
      const what = outstanding > 0 ? `${outstanding} work requests outstanding` : "a PING unanswered";
      this.host.expire(new RdmaError("RETRY_EXCEEDED", `the peer made no progress for ${Math.round(now - this.lastProgress)} ms (peerTimeoutMs ${t}; ${what}, last arrival ${Math.round(now - this.lastArrival)} ms ago): it is dead, stopped or unreachable`));
      return;
    }
    if (this.keepaliveMs > 0 && !this.awaitingAnswer && now - this.lastArrival >= this.keepaliveMs) {
      // The peer timeout counts from when the PING was due, not from this check.
      if (!waiting) this.lastProgress = Math.max(this.lastProgress, this.lastArrival + this.keepaliveMs);
      this.awaitingAnswer = true;
      this.host.ping();
    }
  }
}
