/**
 * The server's ring budget: what one client may ask for (chunk, depth, one
 * ring), what all connections hold together (past it a hello is refused,
 * EBUSY), each client address's fair share (half the budget), and making
 * room by ending connections that sit idle with a ring, longest idle first.
 */

/** Limits a client may ask for. */
export const MAX_CHUNK = 16 * 1024 * 1024;
export const MIN_CHUNK = 4096;
export const MAX_DEPTH = 64;
export const MAX_RING = 256 * 1024 * 1024;
/** Ring bytes of all connections together: past it a hello is refused (EBUSY), the client may retry later. */
export const MAX_TOTAL_RING = 1024 * 1024 * 1024;
/** Ring bytes of all connections together (each session's `counted`). */
export const ringTotal = { bytes: 0 };

/**
 * Fair shares per client address, as sshd's MaxStartups: one address holds
 * at most half of the ring budget, so clients from elsewhere always find
 * room for a ring (the largest is a quarter of the budget).
 */
export class SourceShares {
  private readonly held = new Map<string, number>();
  constructor(readonly total: number) {}

  /** Whether `source` may take `n` more bytes. */
  fits(source: string, n: number): boolean {
    return (this.held.get(source) ?? 0) + n <= this.total / 2;
  }

  heldBy(source: string): number {
    return this.held.get(source) ?? 0;
  }

  take(source: string, n: number): void {
    this.held.set(source, (this.held.get(source) ?? 0) + n);
  }

  give(source: string, n: number): void {
    const left = (this.held.get(source) ?? 0) - n;
    if (left > 0) this.held.set(source, left);
    else this.held.delete(source);
  }
}

export const ringShares = new SourceShares(MAX_TOTAL_RING);
/**
 * A hello that does not fit ends connections that hold a ring and have had
 * no call in flight for this long, longest idle first, so connections that
 * sit idle cannot lock others out (a copy in progress always has a call in
 * flight). It waits at most this long for such a connection to become idle
 * enough; past that, EBUSY.
 */
const IDLE_EVICT_MS = 2_000;

/** What the budget needs of a session that holds (or may hold) a ring. */
export interface RingHolder {
  readonly rdma: { readonly peer: { readonly address: string } };
  /** Ring bytes this session counts in the budget. */
  readonly counted: number;
  /** Calls in flight, and when the last one ended (performance.now()). */
  readonly calls: number;
  readonly lastCall: number;
  /** Ends the session to make room for another connection's ring. */
  evict(): Promise<void>;
}

/** Every session that holds or may hold a ring. */
export const sessions = new Set<RingHolder>();

/**
 * Makes room for `need` more ring bytes by ending idle connections (see
 * IDLE_EVICT_MS); returns when there is room, or when there cannot be.
 */
export async function makeRoom(need: number, me: RingHolder): Promise<void> {
  const from = me.rdma.peer.address;
  // Room in the whole budget and in this address's half of it.
  const fits = (): boolean => ringTotal.bytes + need <= MAX_TOTAL_RING && ringShares.fits(from, need);
  const deadline = performance.now() + IDLE_EVICT_MS;
  for (;;) {
    if (fits()) return;
    // Over its address's share, only that address's idle connections can make room.
    const sameSource = !ringShares.fits(from, need);
    const idle = [...sessions].filter((x) => x !== me && x.counted > 0 && x.calls === 0 && (!sameSource || x.rdma.peer.address === from)).sort((a, b) => a.lastCall - b.lastCall);
    // when ending every idle connection would not make room, waiting is pointless
    const freed = idle.reduce((a, x) => a + x.counted, 0);
    if (sameSource ? ringShares.heldBy(from) - freed + need > MAX_TOTAL_RING / 2 : ringTotal.bytes - freed + need > MAX_TOTAL_RING) return;
    const now = performance.now();
    let later = Infinity;
    for (const x of idle) {
      if (fits()) return;
      if (now - x.lastCall >= IDLE_EVICT_MS) {
        if (x.calls === 0) await x.evict(); // (still idle: the awaits above let calls in)
      } else later = Math.min(later, x.lastCall + IDLE_EVICT_MS);
    }
    if (fits() || now >= deadline) return;
    // wait for the next connection to become idle long enough (bounded by the deadline)
    await new Promise((r) => setTimeout(r, Math.max(1, Math.min(later, deadline) - now + 1)));
  }
}
