/**
 * The owner's side of the memory protocol: what the peer can make this side
 * hold, each bounded and freed at teardown. Grants (MR_REQUEST): at most
 * `maxRegions` regions and `quotaBytes` bytes per connection and the
 * process-wide peer memory budget (memory/budget.ts); grant ids are chosen
 * here, never by the requester. Regions handed back (MR_GIVE_BACK) wait for
 * receiveLocalMr, a granted one still charged to the quota, the region count
 * and the budget until claimed, so the peer cannot cycle request + give-back
 * past them. Regions we lend (sendLocalMr) and shares the peer opens
 * (MR_OPEN, counted with grants against `maxRegions`) are revoked by the one
 * deadline rule (leases.ts), on release, and at teardown, whatever the peer
 * sent; every registration covers exactly the bytes given, never the slab
 * around them.
 */
import { RdmaError } from "../errors.js";
import type { MemoryRegion } from "../transport/types.js";
import { LocalMemory, LocalMr, type RemoteAccess } from "../memory/mr.js";
import { peerMemory } from "../memory/budget.js";
import { AsyncQueue, abortError } from "./queue.js";
import { DenyReason, MsgType, RenewStatus } from "./codec.js";
import { longTimeout, ownerRevokeDelay } from "./leases.js";
import { accessFlags, hashKey, type Share, type ShareOpener } from "./shares.js";
import { accessOfFlags, type Kind, type MemoryHost, type MemoryLimits } from "./memory-host.js";

interface Exposed {
  mem: LocalMemory;
  mr: MemoryRegion;
  timer: { cancel(): void } | null;
  start: number;
  length: number;
  /** When it was lent (a lend's whole life, renewals included, is at most the maximum lease). */
  since: number;
}

interface Grant extends Exposed {
  requestToken: number;
}

/** @internal */
export class MemoryGrants {
  private nextId = 1 + Math.floor(Math.random() * 0x3fffffff);
  /** Shared regions the peer opened here: open id → share. */
  private readonly opened = new Map<number, Share>();
  private readonly opener: ShareOpener = {
    // The open stays (and keeps its registration) until the peer acknowledges with MR_RELEASE.
    revoked: (_share, id) => {
      if (this.opened.has(id) && !this.host.down) this.host.sendCtrl({ type: MsgType.MR_REVOKED, token: id });
    },
    dropped: (_share, id) => {
      this.opened.delete(id);
    },
  };
  private readonly grants = new Map<number, Grant>();
  /** Request tokens of live grants: a repeated token is refused. */
  private readonly grantTokens = new Set<number>();
  private quotaUsed = 0;
  /** Granted regions handed back and not yet claimed: still charged (bytes, by region). */
  private readonly handedBack = new Map<LocalMr, number>();
  private readonly lends = new Map<number, Exposed>();
  readonly localMrs = new AsyncQueue<LocalMr>("receiveLocalMr");

  constructor(
    private readonly host: Pick<MemoryHost, "pool" | "sendCtrl" | "postCtrl" | "checkOpen" | "down" | "protocolError" | "findShare" | "peerInfo">,
    private readonly limits: MemoryLimits,
  ) {}

  /** Regions the peer holds or made this side hold: grants, shared regions it opened, grants handed back and not claimed. */
  private regionsHeld(): number {
    return this.grants.size + this.opened.size + this.handedBack.size;
  }

  private newId(): number {
    let id: number;
    do {
      id = this.nextId;
      this.nextId = (this.nextId + 1) >>> 0 || 1;
    } while (this.grants.has(id) || this.lends.has(id) || this.opened.has(id));
    return id;
  }

  /** Owner side of MR_RENEW: the revoke moves to lease + grace from now. */
  onRenew(m: Kind<typeof MsgType.MR_RENEW>): void {
    const answer = (status: number, leaseMs: number): void => this.host.sendCtrl({ type: MsgType.MR_RENEWED, token: m.token, status, leaseMs });
    const e: Exposed | undefined = m.lent ? this.lends.get(m.token) : this.grants.get(m.token);
    if (!e) return answer(RenewStatus.UNKNOWN, 0);
    if (m.leaseMs > this.limits.maxLeaseMs) return answer(RenewStatus.TOO_LONG, this.limits.maxLeaseMs);
    const lease = m.leaseMs || this.limits.defaultLeaseMs;
    // A lend keeps this side's own memory from it: renewals cannot carry it past the maximum lease from the lend.
    if (m.lent) {
      const left = Math.floor(e.since + this.limits.maxLeaseMs - performance.now());
      if (lease > left) return answer(RenewStatus.TOO_LONG, Math.max(0, left));
    }
    e.timer?.cancel();
    const id = m.token;
    e.timer = m.lent ? longTimeout(() => this.endLend(id, false), ownerRevokeDelay(lease, this.limits.leaseGraceMs)) : longTimeout(() => this.endGrant(id)?.mem.release(), ownerRevokeDelay(lease, this.limits.leaseGraceMs));
    answer(RenewStatus.OK, lease);
  }

  onRequest(token: number, size: number, leaseMs: number, flags: number): void {
    const deny = (reason: number, value = 0, regions = 0): void => this.host.sendCtrl({ type: MsgType.MR_DENY, token, reason, value, regions });
    if (this.grantTokens.has(token)) return this.host.protocolError(`MR_REQUEST reuses the token ${token} of a live grant`);
    if (accessOfFlags(flags) === null) return this.host.protocolError(`MR_REQUEST asks for access flags 0x${flags.toString(16)}`);
    if (size === 0 || size > this.limits.maxRegionSize) return deny(DenyReason.TOO_LARGE);
    if (leaseMs > this.limits.maxLeaseMs) return deny(DenyReason.LEASE_TOO_LONG, this.limits.maxLeaseMs);
    if (this.quotaUsed + size > this.limits.quotaBytes || this.regionsHeld() >= this.limits.maxRegions) return deny(DenyReason.QUOTA, Math.min(this.quotaUsed, 0xffffffff), this.regionsHeld());
    if (!peerMemory.take(size)) return deny(DenyReason.BUDGET);
    let mem: LocalMemory;
    let mr: MemoryRegion;
    try {
      mem = new LocalMemory(this.host.pool, this.host.pool.alloc(size));
    } catch {
      peerMemory.give(size);
      return deny(DenyReason.NO_MEMORY);
    }
    try {
      // A registration over exactly the granted bytes: never the slab around them.
      mr = this.host.pool.grant(mem.alloc, 0, size, flags);
    } catch {
      mem.release();
      peerMemory.give(size);
      return deny(DenyReason.NO_MEMORY);
    }
    const lease = Math.min(leaseMs || this.limits.defaultLeaseMs, this.limits.maxLeaseMs);
    const id = this.newId();
    const g: Grant = { mem, mr, timer: null, start: 0, length: size, since: performance.now(), requestToken: token };
    g.timer = longTimeout(() => this.endGrant(id)?.mem.release(), ownerRevokeDelay(lease, this.limits.leaseGraceMs));
    this.grants.set(id, g);
    this.grantTokens.add(token);
    this.quotaUsed += size;
    this.host.sendCtrl({ type: MsgType.MR_GRANT, token, id, size, leaseMs: lease, addr: mr.addr, rkey: mr.rkey, access: flags });
  }

  /** Owner side of MR_OPEN: a registration in this connection's PD over exactly the shared bytes. */
  onOpen(m: Kind<typeof MsgType.MR_OPEN>): void {
    const deny = (reason: number, value = 0, regions = 0): void => this.host.sendCtrl({ type: MsgType.MR_DENY, token: m.token, reason, value, regions });
    const share = this.host.findShare(hashKey(m.hash));
    // One answer for "no such name" and "not for you": the peer learns nothing it may not open.
    if (!share || share.revoked) return deny(DenyReason.NOT_FOUND);
    if (share.allow) {
      let ok = false;
      try {
        ok = share.allow(this.host.peerInfo()) === true;
      } catch {
        ok = false;
      }
      if (!ok) return deny(DenyReason.NOT_FOUND);
    }
    if (this.regionsHeld() >= this.limits.maxRegions) return deny(DenyReason.QUOTA, Math.min(this.quotaUsed, 0xffffffff), this.regionsHeld());
    const id = this.newId();
    let mr: MemoryRegion;
    try {
      mr = share.open(this.host.pool, this.opener, id);
    } catch {
      return deny(DenyReason.NOT_FOUND);
    }
    this.opened.set(id, share);
    this.host.sendCtrl({ type: MsgType.MR_SHARED, token: m.token, id, size: share.length, access: share.flags, addr: mr.addr, rkey: mr.rkey });
  }

  closeOpened(id: number): boolean {
    const share = this.opened.get(id);
    if (!share) return false;
    this.opened.delete(id);
    share.close(this.host.pool.pd, this.opener, id);
    return true;
  }

  /**
   * Revokes a grant (deregisters first: any later access fails with
   * REMOTE_ACCESS); the caller frees or returns its memory. `keepCharge`: the
   * memory stays charged (a region handed back, until it is claimed).
   */
  endGrant(id: number, keepCharge = false): Grant | null {
    const g = this.grants.get(id);
    if (!g) return null;
    this.grants.delete(id);
    this.grantTokens.delete(g.requestToken);
    g.timer?.cancel();
    g.mr.deregister();
    if (!keepCharge) this.uncharge(g.length);
    return g;
  }

  private uncharge(n: number): void {
    this.quotaUsed -= n;
    peerMemory.give(n);
  }

  /** The next region handed back (receiveLocalMr); a granted one stops counting against the peer once claimed. */
  async claimHandedBack(signal: AbortSignal | undefined): Promise<LocalMr> {
    const l = await this.localMrs.take({ signal });
    const n = this.handedBack.get(l);
    if (n !== undefined) {
      this.handedBack.delete(l);
      this.uncharge(n);
    }
    return l;
  }

  /** Lends exactly `lmr`'s bytes to the peer (read, write, atomics) until it gives them back or the lease ends. */
  lend(lmr: LocalMr, leaseMs: number, signal: AbortSignal | undefined, access: RemoteAccess = "atomic"): Promise<void> {
    this.host.checkOpen("sendLocalMr");
    lmr.mem.check("sendLocalMr");
    if (lmr.mem.beforeFree.size > 0) throw new RdmaError("INVALID_STATE", "sendLocalMr: this memory is shared (share()); lending moves it to the peer, which a share cannot allow");
    if (signal?.aborted) return Promise.reject(abortError(signal));
    const flags = accessFlags(access);
    const id = this.newId();
    const mr = this.host.pool.grant(lmr.mem.alloc, lmr.start, lmr.length, flags);
    lmr.mem.lentTo = "sendLocalMr";
    const lend: Exposed = { mem: lmr.mem, mr, timer: null, start: lmr.start, length: lmr.length, since: performance.now() };
    lend.timer = longTimeout(() => this.endLend(id, false), ownerRevokeDelay(leaseMs, this.limits.leaseGraceMs));
    this.lends.set(id, lend);
    return this.host.postCtrl({ type: MsgType.MR_LEND, token: id, size: lmr.length, leaseMs, addr: mr.addr, rkey: mr.rkey, access: flags }, signal);
  }

  endLend(id: number, toQueue: boolean): void {
    const l = this.lends.get(id);
    if (!l) return;
    this.lends.delete(id);
    l.timer?.cancel();
    l.mr.deregister();
    l.mem.lentTo = null;
    if (toQueue) this.localMrs.push(new LocalMr(l.mem, l.start, l.length));
  }

  /** MR_GIVE_BACK: the peer hands a region back; it waits for receiveLocalMr (a granted one still charged). */
  onGiveBack(m: Kind<typeof MsgType.MR_GIVE_BACK>): void {
    if (m.lent) {
      this.endLend(m.token, true);
      return;
    }
    const g = this.endGrant(m.token, true);
    if (g) {
      const l = new LocalMr(g.mem, 0, g.length);
      this.handedBack.set(l, g.length);
      this.localMrs.push(l);
    }
  }

  /** Revokes and frees everything: grants, lends, shares the peer opened, regions handed back and never picked up. */
  teardown(): void {
    for (const id of [...this.grants.keys()]) this.endGrant(id)?.mem.release();
    for (const id of [...this.lends.keys()]) this.endLend(id, false);
    for (const id of [...this.opened.keys()]) this.closeOpened(id);
    for (const l of this.localMrs.drain()) l.mem.release();
    for (const n of this.handedBack.values()) this.uncharge(n);
    this.handedBack.clear();
  }

  stats(): { grants: number; quotaUsed: number; lends: number; unclaimedLocal: number; sharesOpenedByPeer: number } {
    return { grants: this.grants.size, quotaUsed: this.quotaUsed, lends: this.lends.size, unclaimedLocal: this.localMrs.length, sharesOpenedByPeer: this.opened.size };
  }
}
