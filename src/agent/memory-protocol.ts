/**
 * The memory protocol of one connection: remote memory requests and grants,
 * lending, handing back, leases and quotas. Everything a peer can make this
 * side hold through it is bounded here and freed by `teardown()`:
 *
 * - grants: at most `maxRegions` regions and `quotaBytes` bytes per
 *   connection, and the process-wide peer memory budget (memory/budget.ts);
 *   grant ids are chosen by this side (the owner), never by the requester;
 * - regions handed back (MR_GIVE_BACK) wait for receiveLocalMr: a granted
 *   region handed back stays charged to the quota, the region count and the
 *   process budget until it is claimed (or the connection ends), so the peer
 *   cannot cycle request + give-back past them; a lent region handed back is
 *   this side's own memory (nothing new is held);
 * - regions lent to us (MR_LEND) wait for receiveRemoteMr: at most
 *   MAX_UNCLAIMED_LENDS, past which the peer is in breach (PROTOCOL);
 * - every registration is revoked by the one deadline rule (leases.ts), on
 *   release, and at teardown, whatever the peer sent;
 * - shared regions opened by the peer (shares.ts): at most `maxRegions` opens
 *   together with grants; each open is closed on release, on the peer's
 *   acknowledgement of a revocation (or the revoke's bounded wait), and at
 *   teardown.
 */
import type { RdmaError } from "../errors.js";
import type { LocalMr, RemoteAccess, RemoteMr } from "../memory/mr.js";
import { MsgType, type CtrlMessage } from "./codec.js";
import type { MemoryHost, MemoryLimits, PeerLimits } from "./memory-host.js";
import { LimitsExchange } from "./memory-limits.js";
import { MemoryGrants } from "./memory-grants.js";
import { MemoryRequests } from "./memory-requests.js";

export type { CtrlMsg, MemoryLimits, PeerLimits } from "./memory-host.js";
/** @internal */
export type { MemoryHost } from "./memory-host.js";
export { MAX_UNCLAIMED_LENDS } from "./memory-requests.js";

/**
 * @internal The memory protocol of one connection, in three parts that see
 * the connection through `MemoryHost` and not each other: the limits
 * exchange (memory-limits.ts), the requester's side (memory-requests.ts)
 * and the owner's side (memory-grants.ts). This class dispatches each
 * message kind to its part and runs failure and teardown over all three.
 */
export class MemoryProtocol {
  private readonly exchange: LimitsExchange;
  private readonly requests: MemoryRequests;
  private readonly grants: MemoryGrants;

  constructor(host: MemoryHost, limits: MemoryLimits) {
    this.exchange = new LimitsExchange(host, limits);
    this.requests = new MemoryRequests(host, () => this.exchange.peerLimits);
    this.grants = new MemoryGrants(host, limits);
  }

  /** The peer's limits, once its LIMITS message arrived. */
  get peerLimits(): PeerLimits | null {
    return this.exchange.peerLimits;
  }

  /** Regions handed back or returned to this side, for receiveLocalMr. */
  get localMrs(): MemoryGrants["localMrs"] {
    return this.grants.localMrs;
  }

  /** Regions lent to this side, for receiveRemoteMr. */
  get remoteMrs(): MemoryRequests["remoteMrs"] {
    return this.requests.remoteMrs;
  }

  // ------------------------------------------------------- requester side

  /** requestRemoteMr: `waitForQuota` retries on QUOTA_EXCEEDED until the peer has room. */
  request(size: number, leaseMs: number, timeoutMs: number | undefined, signal: AbortSignal | undefined, owner: object, access: RemoteAccess = "atomic", waitForQuota = false): Promise<RemoteMr> {
    return this.requests.request(size, leaseMs, timeoutMs, signal, owner, access, waitForQuota);
  }

  /** Opens the peer's shared region `name` (openSharedMr). */
  open(name: string, timeoutMs: number | undefined, signal: AbortSignal | undefined, owner: object): Promise<RemoteMr> {
    return this.requests.open(name, timeoutMs, signal, owner);
  }

  /** Asks the owner to extend a granted or lent region's lease (rmr.renew). */
  renew(rmr: RemoteMr, leaseMs: number, signal: AbortSignal | undefined): Promise<void> {
    return this.requests.renew(rmr, leaseMs, signal);
  }

  /** Gives a remote region back to its owner, who receives it with receiveLocalMr. */
  giveBack(rmr: RemoteMr, signal: AbortSignal | undefined): Promise<void> {
    return this.requests.giveBack(rmr, signal);
  }

  // ------------------------------------------------------------- limits

  /** This side's limits for the peer (sent once at start). */
  sendLimits(maxMessageSize: number): void {
    this.exchange.sendLimits(maxMessageSize);
  }

  /** Resolves once the peer's limits are known (or at once). */
  whenLimits(timeoutMs: number): Promise<PeerLimits> {
    return this.exchange.whenLimits(timeoutMs);
  }

  // ----------------------------------------------------------- owner side

  /** The next region handed back (receiveLocalMr); a granted one stops counting against the peer once claimed. */
  claimHandedBack(signal: AbortSignal | undefined): Promise<LocalMr> {
    return this.grants.claimHandedBack(signal);
  }

  /** Lends exactly `lmr`'s bytes to the peer (read, write, atomics) until it gives them back or the lease ends. */
  lend(lmr: LocalMr, leaseMs: number, signal: AbortSignal | undefined, access: RemoteAccess = "atomic"): Promise<void> {
    return this.grants.lend(lmr, leaseMs, signal, access);
  }

  // ------------------------------------------------------------ dispatch

  /** Handles a memory-protocol message; false when `m` is not one. */
  onMessage(m: CtrlMessage, owner: object): boolean {
    switch (m.type) {
      case MsgType.MR_REQUEST:
        this.grants.onRequest(m.token, m.size, m.leaseMs, m.access);
        return true;
      case MsgType.MR_OPEN:
        this.grants.onOpen(m);
        return true;
      case MsgType.MR_SHARED:
        this.requests.onShared(m);
        return true;
      case MsgType.MR_REVOKED:
        this.requests.onRevoked(m);
        return true;
      case MsgType.MR_RENEW:
        this.grants.onRenew(m);
        return true;
      case MsgType.MR_RENEWED:
        this.requests.onRenewed(m);
        return true;
      case MsgType.LIMITS:
        this.exchange.onLimits(m);
        return true;
      case MsgType.MR_GRANT:
        this.requests.onGrant(m);
        return true;
      case MsgType.MR_DENY:
        this.requests.onDeny(m);
        return true;
      case MsgType.MR_RELEASE:
        if (!this.grants.closeOpened(m.token)) this.grants.endGrant(m.token)?.mem.release();
        return true;
      case MsgType.MR_LEND:
        this.requests.onLend(m, owner);
        return true;
      case MsgType.MR_RETURN:
        this.grants.endLend(m.token, false);
        return true;
      case MsgType.MR_GIVE_BACK:
        this.grants.onGiveBack(m);
        return true;
      default:
        return false;
    }
  }

  /** The connection failed: pending requests and waits reject with `err`. */
  fail(err: RdmaError): void {
    this.requests.fail(err);
    this.grants.localMrs.fail(err);
    this.requests.remoteMrs.fail(err);
  }

  /** Revokes and frees everything: grants, lends, regions handed back and never picked up. */
  teardown(): void {
    this.grants.teardown();
    this.requests.teardown();
  }

  stats(): { grants: number; quotaUsed: number; lends: number; unclaimedLocal: number; unclaimedRemote: number; sharesOpenedByPeer: number; sharesOpened: number } {
    const g = this.grants.stats();
    return {
      grants: g.grants,
      quotaUsed: g.quotaUsed,
      lends: g.lends,
      unclaimedLocal: g.unclaimedLocal,
      unclaimedRemote: this.requests.remoteMrs.length,
      sharesOpenedByPeer: g.sharesOpenedByPeer,
      sharesOpened: this.requests.sharesOpened,
    };
  }
}
