/**
 * What `rdma.stats()` reports: the public counters ({@link RdmaStats}) and
 * the agent's own ({@link AgentStats}), read from plain fields.
 *
 * Invariant: reading them costs nothing on the message path. Nothing here
 * is counted per operation: every value is a counter the agent, the pool or
 * the connection already keeps, or a sum over the few regions the user
 * registered, computed when asked.
 */
import type { Connection } from "../agent/connection.js";
import type { LocalMemory } from "../memory/mr.js";
import type { MrPool, PoolStats } from "../memory/pool.js";

/** A connection's counters (Rdma.stats()). Counters only grow; the rest are current values. */
export interface RdmaStats {
  /** Messages accepted by send/sendWithImm, and their bytes. */
  messagesSent: number;
  bytesSent: number;
  /** Messages that arrived whole (receivable), and their bytes. */
  messagesReceived: number;
  bytesReceived: number;
  /** Sends that went by rendezvous (larger than the peer's eager size: the peer READs them), and messages fetched that way. */
  rendezvousSent: number;
  rendezvousReceived: number;
  /** Work requests posted and not completed, plus those waiting to be posted (credits, send-queue room); a large write counts one per 8 MiB. */
  operationsInFlight: number;
  /** Times sending had to wait for the peer's credits (the peer reads slower than this side sends). */
  creditStalls: number;
  /** RNR NAKs answered with a retry, where the provider counts them (tcp); null on verbs (the HCA retries unseen). The agent's credits keep it at 0. */
  rnrRetries: number | null;
  /** Memory this connection holds. */
  memory: {
    /** Registered bytes allocated from the connection's pool and not freed (shared with its newConnection() siblings): your LocalMrs, receive buffers, messages not disposed. */
    poolBytes: number;
    /** Bytes of your own memory registered with registerMr and not disposed. */
    registeredBytes: number;
    /** Messages received and not read yet. */
    unreadMessages: number;
  };
}

/** Internal counters (tests and diagnostics; not part of the documented API). */
/**
 * The agent's own counters, beside {@link RdmaStats} in `rdma.stats()`: for
 * diagnosing a connection (credits, send-queue use, grants and lends held,
 * the memory pool); names may change between minor versions.
 */
export interface AgentStats {
  credits: number;
  sqOutstanding: number;
  grants: number;
  quotaUsed: number;
  lends: number;
  unclaimedLocal: number;
  unclaimedRemote: number;
  unread: number;
  rendezvousOut: number;
  sharesOpenedByPeer: number;
  sharesOpened: number;
  recycledReceives: number;
  creditMessages: number;
  /** Receive buffers this side's ring holds: 8 (or the receive depth, if smaller) at first, doubling up to the receive depth as the peer keeps more messages in flight. */
  receiveRing: number;
  pool: PoolStats;
}

/** @internal */
/** The counters of the connection `c`, whose pool is `pool` and whose user-registered memory is `userMrs`. */
export function statsOf(c: Connection, pool: MrPool, userMrs: Iterable<LocalMemory>): RdmaStats & AgentStats {
  const t = c.traffic;
  const internal = c.stats();
  const ps = pool.stats();
  let registeredBytes = 0;
  for (const m of userMrs) registeredBytes += m.alloc.length;
  return {
    messagesSent: t.messagesSent,
    bytesSent: t.bytesSent,
    messagesReceived: t.messagesReceived,
    bytesReceived: t.bytesReceived,
    rendezvousSent: t.rendezvousSent,
    rendezvousReceived: t.rendezvousReceived,
    operationsInFlight: c.workInFlight,
    creditStalls: t.creditStalls,
    rnrRetries: c.qp.rnrRetries ?? null,
    memory: { poolBytes: ps.liveBytes, registeredBytes, unreadMessages: internal.unread },
    ...internal,
    pool: ps,
  };
}
