/**
 * Our own stall does not count against the peer: the one rule both liveness
 * checks apply (the agent's, agent/liveness.ts, and the tcp provider's
 * requester timer, tcp/liveness.ts).
 *
 * Invariant: a periodic check that runs more than `tolerance` ms later than
 * it was due means this process's event loop did not run meanwhile (a long
 * synchronous task, GC, a starved CPU). The peer could not be heard during
 * that time — its answer may be waiting unread in a socket or the CQ — so
 * the time the peer was last heard from moves forward by the lateness, never
 * past now. A check on time (or late by at most `tolerance`) moves nothing:
 * a peer that is really silent is still found out.
 *
 * A pure function (no clock of its own) so both providers' timers and their
 * tests share it exactly.
 */

/**
 * When the peer was last heard from, as a check at `now` judges it, with
 * this process's own stall not counted against the peer.
 *
 * @param last when the peer was last heard from (or made progress)
 * @param now the time of this check
 * @param prevCheck the time of the previous check
 * @param every how long after the previous check this one was due
 * @param tolerance lateness up to this much is not a stall (timer jitter)
 */
export function excuseOwnStall(last: number, now: number, prevCheck: number, every: number, tolerance: number): number {
  const late = now - prevCheck - every;
  return late > tolerance ? Math.min(now, last + late) : last;
}
