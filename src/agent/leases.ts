/**
 * The one deadline rule for memory a peer may access (grants and lends).
 *
 * The borrower's lease ends `leaseMs` after the earliest moment it can know
 * of the region: for a grant, when it sent the request (before the owner
 * granted); for a lend, when the MR_LEND arrived. After that moment the
 * borrower refuses every operation locally (LEASE_EXPIRED) and never posts.
 *
 * The owner revokes (deregisters) `leaseMs + graceMs` after it sent the grant
 * or the lend. The owner's start is never later than the borrower's for a
 * grant, and earlier by one delivery for a lend; the grace covers that
 * delivery plus the flight of an operation the borrower started just before
 * its deadline. So an operation the borrower was allowed to start finds the
 * region still registered unless the network delays it by more than the
 * grace, and a late or forged one finds it gone (REMOTE_ACCESS), never
 * memory that was reused.
 */

/** Milliseconds after sending a grant or lend at which the owner revokes it. */
export function ownerRevokeDelay(leaseMs: number, graceMs: number): number {
  return leaseMs + graceMs;
}

/** The borrower's deadline (performance.now() scale) from its own start. */
export function borrowerDeadline(startMs: number, leaseMs: number): number {
  return startMs + leaseMs;
}

/** Node timers take at most 2^31-1 ms; longer leases are re-armed in steps. */
export function longTimeout(fn: () => void, ms: number): { cancel(): void } {
  const MAX = 2 ** 31 - 1;
  let t: NodeJS.Timeout;
  const end = performance.now() + ms;
  const arm = (left: number): void => {
    t = setTimeout(() => {
      const rest = end - performance.now();
      if (rest > 1) arm(rest);
      else fn();
    }, Math.min(Math.max(1, left), MAX));
    t.unref();
  };
  arm(ms);
  return { cancel: () => clearTimeout(t) };
}
