/**
 * What a connection is built with: its own settings (resolved by the
 * builder, api/settings.ts) and what the handshake learned of the peer.
 */
import type { PollingMode } from "./poller.js";
import type { Share } from "./shares.js";

/**
 * The settings the agent runs with, declared once: the builder resolves
 * them (api/settings.ts's ResolvedSettings extends this) and a connection
 * takes them as they are (ConnectionOptions extends this).
 */
export interface AgentSettings {
  /** Receive buffers posted for the peer's messages. */
  recvDepth: number;
  /** Largest message sent eagerly (copied into a posted receive); larger ones use rendezvous READ. */
  eagerMax: number;
  /** Bytes of this side's memory the peer may hold through requestRemoteMr at once. */
  quotaBytes: number;
  /** Regions the peer may hold through requestRemoteMr at once. */
  maxRegions: number;
  /** The owner revokes a grant or lend this long after the borrower's lease ends (leases.ts). */
  leaseGraceMs: number;
  /**
   * While this side waits on the peer (work posted, or a PING sent), the
   * peer must make progress (a completion, a message) within this bound or
   * the connection fails with RETRY_EXCEEDED (0: no bound). Devices do not
   * all report a dead peer (rxe does not), and a stopped process's device
   * may still answer; the agent bounds it itself.
   */
  peerTimeoutMs: number;
  /** A rendezvous send not completed by the peer within this is cancelled (0: never). */
  rendezvousTimeoutMs: number;
  /** Lease granted when the requester asks for none, and for lent regions. */
  defaultLeaseMs: number;
  /** Upper bound on any lease this side grants. */
  maxLeaseMs: number;
  polling: PollingMode;
  /** adaptive mode: how long to keep polling after the last completion before arming events. */
  spinUs: number;
  /** Largest two-sided message accepted from the peer (rendezvous allocates this much). */
  maxMessageSize: number;
  /**
   * Idle time after which a PING asks the peer's agent for a PONG (0: never).
   * A dead or stopped peer then fails the connection after peerTimeoutMs and
   * every pending wait rejects, even when this side was only waiting to
   * receive.
   */
  keepaliveMs: number;
}

/** The names of AgentSettings, for copying them out of a larger settings object. */
export const AGENT_SETTINGS = ["recvDepth", "eagerMax", "quotaBytes", "maxRegions", "leaseGraceMs", "peerTimeoutMs", "rendezvousTimeoutMs", "defaultLeaseMs", "maxLeaseMs", "polling", "spinUs", "maxMessageSize", "keepaliveMs"] as const satisfies readonly (keyof AgentSettings)[];

/** @internal */
export interface ConnectionOptions extends AgentSettings {
  /** The QP's send queue depth (work requests posted at once). */
  sendDepth: number;
  /** The QP's max inline data (0: no inline sends). */
  maxInline: number;
  /** Shared regions the peer may open (shares.ts), and how `allow(peer)` callbacks see the peer. */
  shares?: { find(key: string): Share | undefined; peer(): unknown };
}

/** @internal */
export interface PeerParams {
  recvDepth: number;
  eagerMax: number;
  /** When the handshake told us; otherwise the sender does not check and the peer refuses. */
  maxMessageSize?: number;
}
