/**
 * Traffic counters of one connection (Rdma.stats()): plain numbers bumped
 * on the message path, one increment each, read only when asked.
 *
 * Invariant: a counter only grows; messages are counted once each, when a
 * send is accepted (out) and when a message is handed to the inbox whole
 * (in, eager or rendezvous alike).
 */
export class Traffic {
  /** Two-sided messages this side accepted for sending (send, sendWithImm). */
  messagesSent = 0;
  bytesSent = 0;
  /** Two-sided messages that arrived whole (receivable). */
  messagesReceived = 0;
  bytesReceived = 0;
  /** Sends that went by rendezvous (the peer READ them). */
  rendezvousSent = 0;
  /** Messages this side fetched by rendezvous READ. */
  rendezvousReceived = 0;
  /** Times the data lane had work to post and had to wait for the peer's credits. */
  creditStalls = 0;
  /** The data lane waits for credits now (a stall is counted when it begins; cleared when it posts). */
  stalled = false;

  stall(): void {
    if (this.stalled) return;
    this.stalled = true;
    this.creditStalls++;
  }
}
