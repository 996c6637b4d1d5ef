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
import { RdmaError, type RdmaErrorCode } from "../errors.js";
import { Access, type MemoryRegion } from "../transport/types.js";
import { LocalMemory, LocalMr, RemoteLease, RemoteMr, type RemoteAccess } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import { peerMemory } from "../memory/budget.js";
import { AsyncQueue, abortError, abortableWait, type Settle } from "./queue.js";
import { DenyReason, MsgType, RenewStatus, type CtrlMessage } from "./codec.js";

/** The control message of one kind. */
type Kind<T extends CtrlMessage["type"]> = Extract<CtrlMessage, { type: T }>;
import { borrowerDeadline, longTimeout, ownerRevokeDelay } from "./leases.js";
import { accessFlags, hashKey, nameKey, type Share, type ShareAccess, type ShareOpener } from "./shares.js";

const ALL_REMOTE = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC;

/** Access flags from the wire: a non-empty subset of remote read, write and atomic, with read always included. */
function accessOfFlags(f: number): RemoteAccess | null {
  if (f === Access.REMOTE_READ) return "read";
  if (f === (Access.REMOTE_READ | Access.REMOTE_WRITE)) return "write";
  if (f === ALL_REMOTE) return "atomic";
  return null;
}

/** The peer's limits (its LIMITS message). */
export interface PeerLimits {
  /** Bytes of its memory it grants this connection at most. */
  quotaBytes: number;
  /** Regions it grants (or opens for) this connection at most. */
  maxRegions: number;
  /** The longest lease it gives. */
  maxLeaseMs: number;
  /** The largest message it accepts. */
  maxMessageSize: number;
}

/** Regions lent to this side and not yet taken with receiveRemoteMr, before the peer is in breach. */
export const MAX_UNCLAIMED_LENDS = 1024;

/** A control message to send (codec.ts names each kind's fields). */
export type CtrlMsg = CtrlMessage;

/** @internal */
/** What the memory protocol needs from its connection. */
export interface MemoryHost {
  readonly pool: MrPool;
  /** Fire-and-forget control message. */
  sendCtrl(m: CtrlMsg): void;
  /** Fire-and-forget control message posted after every operation queued before it. */
  sendCtrlOrdered(m: CtrlMsg): void;
  /** A control message whose promise settles when its SEND completes. */
  postCtrl(m: CtrlMsg, signal?: AbortSignal): Promise<void>;
  checkOpen(what: string): void;
  /** The connection failed or is closing: send nothing more. */
  readonly down: boolean;
  protocolError(reason: string): void;
  /** A shared region of this side by its name key (shares.ts). */
  findShare(key: string): Share | undefined;
  /** The peer, as `allow(peer)` callbacks see it. */
  peerInfo(): unknown;
}

export interface MemoryLimits {
  quotaBytes: number;
  maxRegions: number;
  defaultLeaseMs: number;
  maxLeaseMs: number;
  leaseGraceMs: number;
  maxRegionSize: number;
}

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

interface Pending {
  resolve: (r: RemoteMr) => void;
  reject: (e: unknown) => void;
  sentAt: number;
  leaseMs: number;
  owner: object;
  size: number;
  /** requestRemoteMr's requested access, or "open" for openSharedMr(name). */
  kind: RemoteAccess | "open";
  name: string;
}

/** @internal */
export class MemoryProtocol {
  private nextReq = 1;
  private nextId = 1 + Math.floor(Math.random() * 0x3fffffff);
  private readonly requests = new Map<number, Pending>();
  /** Shared regions the peer opened here: open id → share. */
  private readonly opened = new Map<number, Share>();
  /** Shared regions this side opened at the peer: open id → lease (marked revoked on MR_REVOKED). */
  private readonly openedRemote = new Map<number, RemoteLease>();
  /** Renewals waiting for MR_RENEWED, by grant/lend id. */
  private readonly renewals = new Map<number, { resolve: () => void; reject: (e: unknown) => void; sentAt: number; leaseMs: number; lease: RemoteLease }>();
  /** The peer's limits, once its LIMITS message arrived. */
  peerLimits: PeerLimits | null = null;
  private readonly limitWaiters = new Set<Settle<PeerLimits>>();
  /** Called when this side gives back granted memory: quota waits retry. */
  private readonly quotaWaiters = new Set<() => void>();
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
  readonly remoteMrs = new AsyncQueue<RemoteMr>("receiveRemoteMr");

  constructor(
    private readonly host: MemoryHost,
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

  // ------------------------------------------------------- requester side

  request(size: number, leaseMs: number, timeoutMs: number | undefined, signal: AbortSignal | undefined, owner: object, access: RemoteAccess = "atomic", waitForQuota = false): Promise<RemoteMr> {
    this.host.checkOpen("requestRemoteMr");
    if (signal?.aborted) return Promise.reject(abortError(signal));
    const lim = this.peerLimits;
    if (lim && leaseMs > lim.maxLeaseMs) {
      return Promise.reject(new RdmaError("OUT_OF_RANGE", `requestRemoteMr: a lease of ${leaseMs} ms is longer than the peer gives (its maximum is ${lim.maxLeaseMs} ms)`));
    }
    if (lim && size > lim.quotaBytes) {
      return Promise.reject(new RdmaError("QUOTA_EXCEEDED", `requestRemoteMr(${size}): larger than the peer's whole quota for this connection (${lim.quotaBytes} bytes)`));
    }
    if (!waitForQuota) return this.send(size, leaseMs, timeoutMs, signal, owner, access, "");
    // Retry on QUOTA_EXCEEDED until the peer has room: when this side gives
    // back granted memory, and otherwise after a bounded backoff (other
    // connections of the peer's process share its memory limit).
    const end = timeoutMs === undefined ? Infinity : performance.now() + timeoutMs;
    return (async () => {
      for (let backoff = 10; ; backoff = Math.min(backoff * 2, 1000)) {
        const left = end - performance.now();
        if (left <= 0) throw new RdmaError("TIMEOUT", `requestRemoteMr(${size}): the peer's quota had no room within ${timeoutMs} ms`);
        try {
          return await this.send(size, leaseMs, left === Infinity ? undefined : Math.ceil(left), signal, owner, access, "");
        } catch (e) {
          if (!(e instanceof RdmaError) || e.code !== "QUOTA_EXCEEDED" || (this.peerLimits && size > this.peerLimits.quotaBytes)) throw e;
        }
        await this.quotaRoom(Math.min(backoff, end - performance.now()), signal);
      }
    })();
  }

  /** Resolves when this side gives memory back, after `ms`, or rejects when `signal` aborts or the connection fails. */
  private quotaRoom(ms: number, signal: AbortSignal | undefined): Promise<void> {
    return abortableWait<void>((w) => this.quotaWaiters.add(w.resolve), {
      signal,
      timeoutMs: Math.max(1, ms),
      onTimeout: (w) => w.resolve(),
      cleanup: (w) => this.quotaWaiters.delete(w.resolve),
    }).then(() => this.host.checkOpen("requestRemoteMr"));
  }

  /** Opens the peer's shared region `name` (openSharedMr). */
  open(name: string, timeoutMs: number | undefined, signal: AbortSignal | undefined, owner: object): Promise<RemoteMr> {
    this.host.checkOpen("openSharedMr");
    if (signal?.aborted) return Promise.reject(abortError(signal));
    return this.send(0, 0, timeoutMs, signal, owner, "open", name);
  }

  private send(size: number, leaseMs: number, timeoutMs: number | undefined, signal: AbortSignal | undefined, owner: object, kind: Pending["kind"], name: string): Promise<RemoteMr> {
    const what = kind === "open" ? `openSharedMr(${JSON.stringify(name)})` : `requestRemoteMr(${size})`;
    const hash = kind === "open" ? nameKey(name).hash : undefined;
    const token = this.nextReq;
    this.nextReq = (this.nextReq + 1) >>> 0 || 1;
    return abortableWait<RemoteMr>(
      (w) => {
        const sentAt = performance.now();
        this.requests.set(token, {
          resolve: w.resolve,
          reject: w.reject,
          sentAt,
          leaseMs,
          owner,
          size,
          kind,
          name,
        });
        if (hash) this.host.sendCtrl({ type: MsgType.MR_OPEN, token, hash });
        else this.host.sendCtrl({ type: MsgType.MR_REQUEST, token, size, leaseMs, access: accessFlags(kind as ShareAccess) });
      },
      {
        signal,
        timeoutMs,
        onTimeout: (w) => w.reject(new RdmaError("TIMEOUT", `${what}: the peer did not answer within ${timeoutMs} ms`)),
        cleanup: () => this.requests.delete(token),
      },
    );
  }

  private onGrant(m: Kind<typeof MsgType.MR_GRANT>): void {
    const r = this.requests.get(m.token);
    if (!r || r.kind === "open") {
      // The request timed out or was aborted: give the memory straight back.
      this.host.sendCtrl({ type: MsgType.MR_RELEASE, token: m.id });
      return;
    }
    const access = accessOfFlags(m.access);
    if (access !== r.kind) return this.host.protocolError(`MR_GRANT gives access 0x${m.access.toString(16)}, not what was requested`);
    if (m.size !== r.size) return this.host.protocolError(`MR_GRANT of ${m.size} bytes for a request of ${r.size}`);
    const lease = new RemoteLease(m.id, borrowerDeadline(r.sentAt, Math.min(m.leaseMs, r.leaseMs)), (t) => this.releaseRemote(t, "granted"));
    lease.owner = r.owner;
    lease.renewer = (rmr, ms, signal) => this.renew(rmr, ms, signal);
    r.resolve(new RemoteMr(m.addr, m.size, m.rkey, lease, "granted", access));
  }

  private onShared(m: Kind<typeof MsgType.MR_SHARED>): void {
    const r = this.requests.get(m.token);
    if (!r || r.kind !== "open") {
      // Timed out or aborted meanwhile: close it again.
      this.host.sendCtrl({ type: MsgType.MR_RELEASE, token: m.id });
      return;
    }
    const access = accessOfFlags(m.access);
    if (access === null) return this.host.protocolError(`MR_SHARED with access flags 0x${m.access.toString(16)}`);
    if (this.openedRemote.has(m.id)) return this.host.protocolError(`MR_SHARED reuses the id ${m.id} of an open shared region`);
    const lease = new RemoteLease(m.id, Infinity, (t) => {
      this.openedRemote.delete(t);
      this.releaseRemote(t, "granted");
    });
    lease.owner = r.owner;
    this.openedRemote.set(m.id, lease);
    r.resolve(new RemoteMr(m.addr, m.size, m.rkey, lease, "shared", access));
  }

  private onDeny(m: Kind<typeof MsgType.MR_DENY>): void {
    const r = this.requests.get(m.token);
    if (!r) return;
    const what = r.kind === "open" ? `openSharedMr(${JSON.stringify(r.name)})` : `requestRemoteMr(${r.size})`;
    const lim = this.peerLimits;
    let code: RdmaErrorCode;
    let why: string;
    switch (m.reason) {
      case DenyReason.QUOTA:
        code = "QUOTA_EXCEEDED";
        why = `the peer's quota for this connection is used up: ${m.value} bytes in ${m.regions} regions in use${lim ? ` of ${lim.quotaBytes} bytes and ${lim.maxRegions} regions` : ""}; release remote regions first, or ask with { waitForQuota: true }`;
        break;
      case DenyReason.BUDGET:
        code = "QUOTA_EXCEEDED";
        why = "the peer's process-wide memory limit for its peers is used up (all its connections together); retry later, or ask with { waitForQuota: true }";
        break;
      case DenyReason.TOO_LARGE:
        code = "OUT_OF_RANGE";
        why = "the size is larger than the peer accepts";
        break;
      case DenyReason.NOT_FOUND:
        code = "NOT_FOUND";
        why = "the peer shares no region of that name with this connection";
        break;
      case DenyReason.LEASE_TOO_LONG:
        code = "OUT_OF_RANGE";
        why = `a lease of ${r.leaseMs} ms is longer than the peer gives (its maximum is ${m.value} ms)`;
        break;
      default:
        code = "RESOURCE_EXHAUSTED";
        why = "the peer could not allocate the memory";
    }
    r.reject(new RdmaError(code, `${what}: ${why}`));
  }

  /** Asks the owner to extend a granted or lent region's lease (rmr.renew). */
  renew(rmr: RemoteMr, leaseMs: number, signal: AbortSignal | undefined): Promise<void> {
    this.host.checkOpen("renew");
    if (rmr.origin === "shared") return Promise.reject(new RdmaError("INVALID_ARGUMENT", "renew: a shared region has no lease (it lasts until the owner revokes it)"));
    try {
      rmr.lease.check("renew");
    } catch (e) {
      return Promise.reject(e);
    }
    const lim = this.peerLimits;
    if (lim && leaseMs > lim.maxLeaseMs) return Promise.reject(new RdmaError("OUT_OF_RANGE", `renew: a lease of ${leaseMs} ms is longer than the peer gives (its maximum is ${lim.maxLeaseMs} ms)`));
    if (signal?.aborted) return Promise.reject(abortError(signal));
    const id = rmr.lease.token;
    if (this.renewals.has(id)) return Promise.reject(new RdmaError("INVALID_STATE", "renew: a renewal of this region is already under way"));
    return abortableWait<void>(
      (w) => {
        this.renewals.set(id, {
          resolve: w.resolve,
          reject: w.reject,
          sentAt: performance.now(),
          leaseMs,
          lease: rmr.lease,
        });
        this.host.sendCtrl({ type: MsgType.MR_RENEW, token: id, leaseMs, lent: rmr.origin === "lent" });
      },
      { signal, cleanup: () => this.renewals.delete(id) },
    );
  }

  private onRenewed(m: Kind<typeof MsgType.MR_RENEWED>): void {
    const r = this.renewals.get(m.token);
    if (!r) return;
    if (m.status === RenewStatus.OK) {
      // The one deadline rule: from this side's request, with what the owner applied.
      r.lease.extend(borrowerDeadline(r.sentAt, Math.min(m.leaseMs, r.leaseMs)));
      r.resolve();
    } else if (m.status === RenewStatus.TOO_LONG) {
      r.reject(new RdmaError("OUT_OF_RANGE", `renew: a lease of ${r.leaseMs} ms is longer than the peer gives (its maximum is ${m.leaseMs} ms)`));
    } else {
      r.reject(new RdmaError("LEASE_EXPIRED", "renew: the owner no longer has this region (its lease ended); request a new one"));
    }
  }

  /** Owner side of MR_RENEW: the revoke moves to lease + grace from now. */
  private onRenew(m: Kind<typeof MsgType.MR_RENEW>): void {
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

  // ------------------------------------------------------------- limits

  /** This side's limits for the peer (sent once at start). */
  sendLimits(maxMessageSize: number): void {
    this.host.sendCtrl({
      type: MsgType.LIMITS,
      maxLeaseMs: Math.min(this.limits.maxLeaseMs, 0xffffffff),
      maxMessageSize: Math.min(maxMessageSize, 0xffffffff),
      quotaBytes: Math.min(this.limits.quotaBytes, Number.MAX_SAFE_INTEGER),
      maxRegions: Math.min(this.limits.maxRegions, 0xffffffff),
    });
  }

  private onLimits(m: Kind<typeof MsgType.LIMITS>): void {
    if (this.peerLimits) return this.host.protocolError("LIMITS sent twice");
    this.peerLimits = { maxLeaseMs: m.maxLeaseMs, maxMessageSize: m.maxMessageSize, quotaBytes: m.quotaBytes, maxRegions: m.maxRegions };
    for (const w of [...this.limitWaiters]) w.resolve(this.peerLimits);
  }

  /** Resolves once the peer's limits are known (or at once). */
  whenLimits(timeoutMs: number): Promise<PeerLimits> {
    if (this.peerLimits) return Promise.resolve(this.peerLimits);
    return abortableWait<PeerLimits>((w) => this.limitWaiters.add(w), {
      timeoutMs,
      onTimeout: (w) => w.reject(new RdmaError("TIMEOUT", `the peer did not send its limits within ${timeoutMs} ms`)),
      cleanup: (w) => this.limitWaiters.delete(w),
    });
  }

  private releaseRemote(token: number, origin: "granted" | "lent"): void {
    if (origin === "granted") for (const w of [...this.quotaWaiters]) w();
    if (this.host.down) return;
    this.host.sendCtrl({ type: origin === "lent" ? MsgType.MR_RETURN : MsgType.MR_RELEASE, token });
  }

  /** Gives a remote region back to its owner, who receives it with receiveLocalMr. */
  giveBack(rmr: RemoteMr, signal: AbortSignal | undefined): Promise<void> {
    this.host.checkOpen("sendRemoteMr");
    rmr.lease.check("sendRemoteMr");
    if (rmr.origin === "shared") throw new RdmaError("INVALID_ARGUMENT", "sendRemoteMr: a shared region stays with its owner; dispose it to close it");
    if (signal?.aborted) return Promise.reject(abortError(signal));
    for (const w of [...this.quotaWaiters]) w();
    // Ownership moves with the message: this side may not use the region any more.
    rmr.lease.released = true;
    return this.host.postCtrl({ type: MsgType.MR_GIVE_BACK, token: rmr.lease.token, lent: rmr.origin === "lent" });
  }

  // ----------------------------------------------------------- owner side

  private onRequest(token: number, size: number, leaseMs: number, flags: number): void {
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
  private onOpen(m: Kind<typeof MsgType.MR_OPEN>): void {
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

  private closeOpened(id: number): boolean {
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
  private endGrant(id: number, keepCharge = false): Grant | null {
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

  private endLend(id: number, toQueue: boolean): void {
    const l = this.lends.get(id);
    if (!l) return;
    this.lends.delete(id);
    l.timer?.cancel();
    l.mr.deregister();
    l.mem.lentTo = null;
    if (toQueue) this.localMrs.push(new LocalMr(l.mem, l.start, l.length));
  }

  // ------------------------------------------------------------ dispatch

  /** Handles a memory-protocol message; false when `m` is not one. */
  onMessage(m: CtrlMessage, owner: object): boolean {
    switch (m.type) {
      case MsgType.MR_REQUEST:
        this.onRequest(m.token, m.size, m.leaseMs, m.access);
        return true;
      case MsgType.MR_OPEN:
        this.onOpen(m);
        return true;
      case MsgType.MR_SHARED:
        this.onShared(m);
        return true;
      case MsgType.MR_REVOKED: {
        const lease = this.openedRemote.get(m.token);
        if (lease) {
          this.openedRemote.delete(m.token);
          lease.revoked = true;
          // The acknowledgement, after every operation queued before it: those on the region
          // reach the owner first (RC order).
          this.host.sendCtrlOrdered({ type: MsgType.MR_RELEASE, token: m.token });
        }
        return true;
      }
      case MsgType.MR_RENEW:
        this.onRenew(m);
        return true;
      case MsgType.MR_RENEWED:
        this.onRenewed(m);
        return true;
      case MsgType.LIMITS:
        this.onLimits(m);
        return true;
      case MsgType.MR_GRANT:
        this.onGrant(m);
        return true;
      case MsgType.MR_DENY:
        this.onDeny(m);
        return true;
      case MsgType.MR_RELEASE:
        if (!this.closeOpened(m.token)) this.endGrant(m.token)?.mem.release();
        return true;
      case MsgType.MR_LEND: {
        if (this.remoteMrs.length >= MAX_UNCLAIMED_LENDS) {
          this.host.protocolError(`more than ${MAX_UNCLAIMED_LENDS} lent regions not taken with receiveRemoteMr`);
          return true;
        }
        const access = accessOfFlags(m.access);
        if (access === null) {
          this.host.protocolError(`MR_LEND with access flags 0x${m.access.toString(16)}`);
          return true;
        }
        const lease = new RemoteLease(m.token, borrowerDeadline(performance.now(), m.leaseMs), (t) => this.releaseRemote(t, "lent"));
        lease.owner = owner;
        lease.renewer = (rmr, ms, signal) => this.renew(rmr, ms, signal);
        this.remoteMrs.push(new RemoteMr(m.addr, m.size, m.rkey, lease, "lent", access));
        return true;
      }
      case MsgType.MR_RETURN:
        this.endLend(m.token, false);
        return true;
      case MsgType.MR_GIVE_BACK: {
        if (m.lent) {
          this.endLend(m.token, true);
          return true;
        }
        const g = this.endGrant(m.token, true);
        if (g) {
          const l = new LocalMr(g.mem, 0, g.length);
          this.handedBack.set(l, g.length);
          this.localMrs.push(l);
        }
        return true;
      }
      default:
        return false;
    }
  }

  /** The connection failed: pending requests and waits reject with `err`. */
  fail(err: RdmaError): void {
    for (const r of [...this.requests.values()]) r.reject(err);
    for (const r of [...this.renewals.values()]) r.reject(err);
    for (const w of [...this.quotaWaiters]) w();
    this.localMrs.fail(err);
    this.remoteMrs.fail(err);
  }

  /** Revokes and frees everything: grants, lends, regions handed back and never picked up. */
  teardown(): void {
    for (const id of [...this.grants.keys()]) this.endGrant(id)?.mem.release();
    for (const id of [...this.lends.keys()]) this.endLend(id, false);
    for (const id of [...this.opened.keys()]) this.closeOpened(id);
    for (const lease of this.openedRemote.values()) lease.released = true;
    this.openedRemote.clear();
    for (const l of this.localMrs.drain()) l.mem.release();
    for (const n of this.handedBack.values()) this.uncharge(n);
    this.handedBack.clear();
    for (const r of this.remoteMrs.drain()) r.lease.released = true;
  }

  stats(): { grants: number; quotaUsed: number; lends: number; unclaimedLocal: number; unclaimedRemote: number; sharesOpenedByPeer: number; sharesOpened: number } {
    return {
      grants: this.grants.size,
      quotaUsed: this.quotaUsed,
      lends: this.lends.size,
      unclaimedLocal: this.localMrs.length,
      unclaimedRemote: this.remoteMrs.length,
      sharesOpenedByPeer: this.opened.size,
      sharesOpened: this.openedRemote.size,
    };
  }
}
