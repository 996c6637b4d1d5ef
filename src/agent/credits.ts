/**
 * Send credits of one connection, both directions: pure state, no I/O (the
 * connection posts what these rules decide).
 *
 * Invariant: this side never sends more SENDs than the peer has receives
 * posted (`credits`: the peer's first receives, {@link initialReceives} of its
 * depth, less every SEND posted, plus every credit the peer returned, never
 * more than its depth), and tells the
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
 * The receive ring grows with use: each side posts {@link initialReceives}
 * of its depth before it connects, and doubles its ring (up to its depth)
 * when the peer is about to run out of credits even counting those owed to
 * it ({@link Credits.growth}); the new receives are credits like re-posted
 * ones. A connection that never has more than a few messages in flight keeps
 * a few receive buffers.
 *
 * A CREDIT message is sent only when nothing queued will carry the credits
 * soon ({@link Credits.shouldSendCredits}); one that would only return the
 * buffer the peer's own CREDIT consumed is never sent, so two sides that
 * hold unread messages cannot ping-pong CREDITs.
 */

/** Receives each side posts before it connects (agent protocol v4): the peer's first credits. */
export const INITIAL_RECEIVES = 8;

/** The receives a side of depth `depth` posts before it connects: the credits its peer starts with. */
export function initialReceives(depth: number): number {
  return Math.min(depth, INITIAL_RECEIVES);
}

/**
 * The ring a WRITE-with-immediate ping-pong may grow to without being short
 * of credits counting those owed (Credits.growth): at 16 or 32 receives a
 * CREDIT returns several at once; more would not send fewer.
 */
export const IMM_RING = 4 * INITIAL_RECEIVES;

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
  /** The credits the peer sees: our first receives, less every receive it consumed, plus every credit we reported. */
  peerCredits: number;
  /** Receives our ring holds (posted, held by the user, or batched): grows from initialReceives up to our depth. */
  ourRing: number;
  /** Receives the ring grew by and has not posted yet (they are posted with the next batch, then owed to the peer). */
  private growing = 0;

  constructor(
    /** The peer's receive depth (the most credits it can return). */
    private peerDepth: number,
    /** This side's receive depth. */
    private readonly ourDepth: number,
  ) {
    this.credits = initialReceives(peerDepth);
    this.peerCredits = initialReceives(ourDepth);
    this.ourRing = this.peerCredits;
  }

  /** The handshake told us the peer's depth (before any send). */
  setPeerDepth(depth: number): void {
    this.peerDepth = depth;
    this.credits = initialReceives(depth);
  }

  /**
   * Receives to add to our ring now (0: none): when the peer sees fewer
   * credits than a data message needs even counting those we owe it (not
   * counting them when `imm`, the receive went to a WRITE with immediate,
   * while the ring is under IMM_RING), the ring doubles, up to our depth.
   * The caller posts them and reports them as re-posted (credits to
   * return); the ring counts them from now on.
   */
  growth(imm = false): number {
    // A WRITE with immediate consumed the receive: such traffic carries no credits back, so what
    // we owe reaches the peer only in CREDIT messages. Counting it would keep the ring at its
    // first 8 and cost a CREDIT every few messages. Not counting it, up to IMM_RING only: each
    // CREDIT round would double the ring again, up to any depth, for one message in flight.
    const owed = imm && this.ourRing < IMM_RING ? 0 : this.toReturn;
    if (this.ourRing >= this.ourDepth || this.peerCredits + owed + this.growing >= NEED.data) return 0;
    const n = Math.min(this.ourRing, this.ourDepth - this.ourRing);
    this.ourRing += n;
    this.growing += n;
    return n;
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

  /** `n` receives were posted (re-posted, or new ones of a growth: a batch carries every receive the ring grew by). */
  reposted(n: number): void {
    this.toReturn += n;
    this.growing = 0;
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
