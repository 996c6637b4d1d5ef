/**
 * The requester's no-progress timer (the tcp provider's ACK timeout).
 *
 * Invariant: a requester with work outstanding fails its oldest WR with
 * RETRY_EXC_ERR once it has heard nothing from the peer for
 * max(timeout × (retryCnt + 1), livenessMs), where time our own event loop
 * did not run is not counted against the peer, and a due verdict first reads
 * what already arrived. Progress is timed by the next check (one clock read
 * per check), so the verdict comes at most two check periods after the
 * limit, never before it. Anything from the peer counts as progress
 * ({@link NoProgressTimer.progress}). Why it differs from verbs:
 * docs/architecture.md, "Liveness".
 */
import { excuseOwnStall } from "../stall.js";
import { ackTimeoutMs } from "./codec.js";

/**
 * Default of QpConnectAttr.livenessMs: a requester with work outstanding
 * tolerates this long without hearing from a peer whose streams are up (its
 * event loop may be blocked or stopped: TCP itself retransmits, and a cut
 * stream is seen at once). Survives multi-second GC pauses and synchronous work.
 */
export const DEFAULT_LIVENESS_MS = 15_000;
/**
 * A no-progress check that runs this much (or a quarter of the limit, if
 * less) later than scheduled means our own event loop was stalled: that time
 * is not counted against the peer.
 */
const STALL_CREDIT_MS = 100;

/** What the timer asks of the requester. */
export interface LivenessHost {
  /** The QP is in RTS with a request sent and not finished. */
  outstanding(): boolean;
  /** An RNR timer runs: the peer told us to wait, which is not silence. */
  waitingOutRnr(): boolean;
  /** The limit passed without progress: fail the oldest outstanding WR (RETRY_EXC_ERR) and enter ERR with `reason`. */
  expire(reason: string): void;
}

export class NoProgressTimer {
  /** When the peer was last heard from (performance.now()), as of the last check. */
  lastProgress = 0;
  /**
   * The peer was heard from since the last check: progress() sets it and
   * the check reads the clock (one clock read per check, none per frame).
   * The peer counts as heard at the check, up to one tick after the fact:
   * never earlier, so it is never judged silent sooner.
   */
  private heard = false;
  private timeoutMs = ackTimeoutMs(14);
  private retryCnt = 7;
  private livenessMs = DEFAULT_LIVENESS_MS;
  private timer: NodeJS.Timeout | null = null;
  /** Set while a due verdict waits one turn for I/O already received (our own loop may have stalled). */
  private confirming: NodeJS.Immediate | null = null;

  constructor(private readonly host: LivenessHost) {}

  /** QpConnectAttr.timeout (as ms; Infinity = none), retryCnt and livenessMs. */
  configure(timeoutMs: number, retryCnt: number, livenessMs: number): void {
    this.timeoutMs = timeoutMs;
    this.retryCnt = retryCnt;
    this.livenessMs = livenessMs;
  }

  /** The peer was heard from. */
  progress(): void {
    this.heard = true;
  }

  /** Folds progress() since the last look into lastProgress, as of `now`. */
  private settle(now: number): void {
    if (!this.heard) return;
    this.heard = false;
    this.lastProgress = now;
  }

  /** How long the requester waits without progress from the peer: max(timeout × (retryCnt+1), livenessMs). */
  limit(): number {
    if (this.timeoutMs === Infinity) return Infinity;
    return Math.max(this.timeoutMs * (this.retryCnt + 1), this.livenessMs);
  }

  /** Starts checking (after a request went out); a no-op while already checking or with timeout 0 (infinite). */
  arm(): void {
    if (this.timer !== null || this.confirming !== null || this.timeoutMs === Infinity) return;
    const limit = this.limit();
    const tick = Math.max(1, Math.min(this.timeoutMs, limit / 4));
    const stallCredit = Math.min(STALL_CREDIT_MS, limit / 4);
    let prev = performance.now();
    const check = (): void => {
      this.timer = null;
      this.confirming = null;
      // A tick that comes late means our own event loop did not run (blocked, descheduled): the peer
      // could not be heard meanwhile, so that time does not count against it (transport/stall.ts).
      const now = performance.now();
      this.settle(now);
      this.lastProgress = excuseOwnStall(this.lastProgress, now, prev, tick, stallCredit);
      prev = now;
      if (!this.host.outstanding()) return;
      if (!this.host.waitingOutRnr() && now - this.lastProgress >= limit) {
        // Timers run before I/O in a turn: after a stall of our own event loop the peer's answer may be
        // waiting in the socket. Read it first (the poll phase runs before setImmediate), then judge.
        // (Not unref'd: an unref'd immediate does not stop the poll phase from blocking, so it could wait for unrelated I/O.)
        this.confirming = setImmediate(confirm);
        return;
      }
      this.timer = setTimeout(check, tick);
      this.timer.unref();
    };
    const confirm = (): void => {
      this.confirming = null;
      if (!this.host.outstanding()) return;
      const now = performance.now();
      this.settle(now);
      if (!this.host.waitingOutRnr() && now - this.lastProgress >= limit) {
        const why = this.livenessMs > this.timeoutMs * (this.retryCnt + 1) ? `livenessMs ${this.livenessMs}` : `timeout ${this.timeoutMs.toFixed(1)} ms × ${this.retryCnt + 1} tries`;
        this.host.expire(`no response from the peer within ${limit.toFixed(0)} ms (${why}; its stream is still open)`);
        return;
      }
      prev = performance.now();
      this.timer = setTimeout(check, tick);
      this.timer.unref();
    };
    this.timer = setTimeout(check, tick);
    this.timer.unref();
  }

  stop(): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    if (this.confirming) clearImmediate(this.confirming);
    this.confirming = null;
  }
}
