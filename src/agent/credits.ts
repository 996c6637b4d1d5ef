/**
 * Send credits of one connection, both directions: pure state, no I/O (the
 * connection posts what these rules decide).
 *
 * Invariant: this side never sends more SENDs than the peer has receives
 * posted (`credits`: the peer's depth at start, less every SEND posted, plus
 * every credit the peer returned, never more than its depth), and tells the
 * peer of every receive it re-posted (`toReturn`, piggybacked on the next
 * message's header or sent in a CREDIT message). The last credits are
 * reserved so the two sides can always return credits to each other:
 *
 * - a CREDIT message may use the last credit (`NEED.credit`);
 * - control messages leave that one (`NEED.ctrl`);
 * - data messages (eager and rendezvous announcements) leave `CTRL_RESERVE`
 *   more for control (`NEED.data`); one-sided work and internal READs
 *   consume no receive and need none.
 *
 * A CREDIT message is sent only when nothing queued will carry the credits
 * soon ({@link Credits.shouldSendCredits}); one that would only return the
 * buffer the peer's own CREDIT consumed is never sent, so two sides that
 * hold unread messages cannot ping-pong CREDITs.
 */

/** The credit reserved for CREDIT messages. */
export const CREDIT_RESERVE = 1;
/** Credits reserved for control messages beyond that. */
export const CTRL_RESERVE = 3;

/** Credits a queued message's head needs before it may take one, by lane. */
export const NEED = {
  credit: CREDIT_RESERVE,
  ctrl: CREDIT_RESERVE + 1,
  data: CREDIT_RESERVE + CTRL_RESERVE + 1,
} as const;

/** What is queued, for the CREDIT rule. */
export interface QueuedWork {
  /** A CREDIT message is queued already. */
  credit: boolean;
  /** Control messages queued. */
  ctrl: boolean;
  /** Data messages queued. */
  data: boolean;
  /** Credits the data lane's head needs (0: one-sided work; NEED.ctrl: an ordered control message; NEED.data). */
  dataHeadNeed: number;
}

export class Credits {
  /** SENDs this side may still post: receives the peer has posted for us. */
  credits: number;
  /** Receives this side re-posted and not reported to the peer yet. */
  toReturn = 0;
  /**
   * Of toReturn, the buffers that CREDIT messages consumed. Returning only
   * those would answer a CREDIT with a CREDIT for ever.
   */
  echo = 0;
  /** The credits the peer sees: our depth, less every receive it consumed, plus every credit we reported. */
  peerCredits: number;

  constructor(
    /** The peer's receive depth (the most credits it can return). */
    private peerDepth: number,
    /** This side's receive depth. */
    private readonly ourDepth: number,
  ) {
    this.credits = peerDepth;
    this.peerCredits = ourDepth;
  }

  /** The handshake told us the peer's depth (before any send). */
  setPeerDepth(depth: number): void {
    this.peerDepth = depth;
    this.credits = depth;
  }

  /** Whether a message needing `need` credits at the head of its lane may take one now. */
  canSend(need: number): boolean {
    return need === 0 || this.credits >= need;
  }

  /** A message that needs credits was posted. */
  spend(need: number): void {
    if (need > 0) this.credits--;
  }

  /** The count to piggyback on the message being posted now (reported: the peer will see them). */
  report(): number {
    const n = this.toReturn;
    this.peerCredits += n;
    this.toReturn = 0;
    this.echo = 0;
    return n;
  }

  /** `n` receives were re-posted. */
  reposted(n: number): void {
    this.toReturn += n;
  }

  /** The peer consumed one of our receives. */
  consumed(): void {
    this.peerCredits--;
  }

  /** The receive the peer consumed carried a CREDIT message: its re-post is an echo. */
  echoed(): void {
    this.echo++;
  }

  /** The peer returned `n` credits; the reason it is in breach, or null. */
  returned(n: number): string | null {
    if (n > this.peerDepth) return `peer returned ${n} credits, more than its ${this.peerDepth} receive buffers`;
    this.credits += n;
    if (this.credits > this.peerDepth) return `peer returned more credits than its ${this.peerDepth} receive buffers`;
    return null;
  }

  /**
   * Whether to send a CREDIT message now: when the peer may be unable to send
   * us data (it sees fewer credits than a data message needs), as soon as one
   * real credit is owed (not only the echo of its own CREDIT) or two are;
   * when nothing is queued, once a quarter of our depth piled up; when every
   * queued message itself waits for credits, as soon as two are owed.
   */
  shouldSendCredits(q: QueuedWork): boolean {
    if (q.credit || this.toReturn < 1) return false;
    if (this.peerCredits < NEED.data) return this.toReturn - Math.min(this.echo, this.toReturn) >= 1 || this.toReturn >= 2;
    if (this.toReturn < 2) return false;
    if (!q.ctrl && !q.data) return this.toReturn >= Math.max(2, this.ourDepth >> 2);
    const ctrlBlocked = !q.ctrl || this.credits < NEED.ctrl;
    const dataBlocked = !q.data || this.credits < q.dataHeadNeed;
    return ctrlBlocked && dataBlocked;
  }
}
