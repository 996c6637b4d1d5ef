/**
 * The memory protocol of one connection: remote memory requests and grants,
 * lending, handing back, leases and quotas. Everything a peer can make this
 * side hold through it is bounded here and freed by `teardown()`:
 *
 * - grants: at most `maxRegions` regions and `quotaBytes` bytes per
 *   connection, and the process-wide peer memory budget (memory/budget.ts);
 *   grant ids are chosen by this side (the owner), never by the requester;
 * - regions handed back (MR_GIVE_BACK) wait for receiveLocalMr: at most one
 *   per grant or lend, so bounded by the above;
 * - regions lent to us (MR_LEND) wait for receiveRemoteMr: at most
 *   MAX_UNCLAIMED_LENDS, past which the peer is in breach (PROTOCOL);
 * - every registration is revoked by the one deadline rule (leases.ts), on
 *   release, and at teardown, whatever the peer sent.
 */
import { RdmaError, type RdmaErrorCode } from "../errors.js";
import { Access, type MemoryRegion } from "../transport/types.js";
import { LocalMemory, LocalMr, RemoteLease, RemoteMr } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import { peerMemory } from "../memory/budget.js";
import { AsyncQueue, abortError } from "./queue.js";
import { DenyReason, MsgType, type Msg } from "./codec.js";
import { borrowerDeadline, longTimeout, ownerRevokeDelay } from "./leases.js";

/** Regions lent to this side and not yet taken with receiveRemoteMr, before the peer is in breach. */
export const MAX_UNCLAIMED_LENDS = 1024;

export type CtrlMsg = Partial<Msg> & { type: number };

/** What the memory protocol needs from its connection. */
export interface MemoryHost {
  readonly pool: MrPool;
  /** Fire-and-forget control message. */
  sendCtrl(m: CtrlMsg): void;
  /** A control message whose promise settles when its SEND completes. */
  postCtrl(m: CtrlMsg, signal?: AbortSignal): Promise<void>;
  checkOpen(what: string): void;
  /** The connection failed or is closing: send nothing more. */
  readonly down: boolean;
  protocolError(reason: string): void;
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
}

interface Grant extends Exposed {
  requestToken: number;
}

export class MemoryProtocol {
  private nextReq = 1;
  private nextId = 1 + Math.floor(Math.random() * 0x3fffffff);
  private readonly requests = new Map<number, { resolve: (r: RemoteMr) => void; reject: (e: unknown) => void; sentAt: number; leaseMs: number; owner: object }>();
  private readonly grants = new Map<number, Grant>();
  /** Request tokens of live grants: a repeated token is refused. */
  private readonly grantTokens = new Set<number>();
  private quotaUsed = 0;
  private readonly lends = new Map<number, Exposed>();
  readonly localMrs = new AsyncQueue<LocalMr>("receiveLocalMr");
  readonly remoteMrs = new AsyncQueue<RemoteMr>("receiveRemoteMr");

  constructor(
    private readonly host: MemoryHost,
    private readonly limits: MemoryLimits,
  ) {}

  private newId(): number {
    let id: number;
    do {
      id = this.nextId;
      this.nextId = (this.nextId + 1) >>> 0 || 1;
    } while (this.grants.has(id) || this.lends.has(id));
    return id;
  }

  // ------------------------------------------------------- requester side

  request(size: number, leaseMs: number, timeoutMs: number | undefined, signal: AbortSignal | undefined, owner: object): Promise<RemoteMr> {
    this.host.checkOpen("requestRemoteMr");
    if (signal?.aborted) return Promise.reject(abortError(signal));
    const token = this.nextReq;
    this.nextReq = (this.nextReq + 1) >>> 0 || 1;
    return new Promise<RemoteMr>((resolve, reject) => {
      let timer: NodeJS.Timeout | null = null;
      const cleanup = (): void => {
        this.requests.delete(token);
        if (timer) clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
      };
      const onAbort = (): void => {
        cleanup();
        reject(abortError(signal!));
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      if (timeoutMs !== undefined) {
        timer = setTimeout(() => {
          cleanup();
          reject(new RdmaError("TIMEOUT", `requestRemoteMr(${size}): the peer did not answer within ${timeoutMs} ms`));
        }, timeoutMs);
      }
      const sentAt = performance.now();
      this.requests.set(token, {
        resolve: (r) => {
          cleanup();
          resolve(r);
        },
        reject: (e) => {
          cleanup();
          reject(e);
        },
        sentAt,
        leaseMs,
        owner,
      });
      this.host.sendCtrl({ type: MsgType.MR_REQUEST, token, a: size, b: leaseMs });
    });
  }

  private onGrant(m: Msg): void {
    const r = this.requests.get(m.token);
    if (!r) {
      // The request timed out or was aborted: give the memory straight back.
      this.host.sendCtrl({ type: MsgType.MR_RELEASE, token: m.id });
      return;
    }
    const lease = new RemoteLease(m.id, borrowerDeadline(r.sentAt, Math.min(m.b, r.leaseMs)), (t) => this.releaseRemote(t, "granted"));
    lease.owner = r.owner;
    r.resolve(new RemoteMr(m.addr, m.a, m.rkey, lease, "granted"));
  }

  private onDeny(m: Msg): void {
    const r = this.requests.get(m.token);
    if (!r) return;
    const code: RdmaErrorCode = m.a === DenyReason.QUOTA ? "QUOTA_EXCEEDED" : m.a === DenyReason.TOO_LARGE ? "OUT_OF_RANGE" : "RESOURCE_EXHAUSTED";
    const why =
      m.a === DenyReason.QUOTA
        ? "the peer's quota for this connection (bytes or regions) or its process-wide memory limit is used up; release remote regions first"
        : m.a === DenyReason.TOO_LARGE
          ? "the size is larger than the peer accepts"
          : "the peer could not allocate the memory";
    r.reject(new RdmaError(code, `requestRemoteMr: ${why}`));
  }

  private releaseRemote(token: number, origin: "granted" | "lent"): void {
    if (this.host.down) return;
    this.host.sendCtrl({ type: origin === "lent" ? MsgType.MR_RETURN : MsgType.MR_RELEASE, token });
  }

  /** Gives a remote region back to its owner, who receives it with receiveLocalMr. */
  giveBack(rmr: RemoteMr, signal: AbortSignal | undefined): Promise<void> {
    this.host.checkOpen("sendRemoteMr");
    rmr.lease.check("sendRemoteMr");
    if (signal?.aborted) return Promise.reject(abortError(signal));
    // Ownership moves with the message: this side may not use the region any more.
    rmr.lease.released = true;
    return this.host.postCtrl({ type: MsgType.MR_GIVE_BACK, token: rmr.lease.token, a: rmr.origin === "lent" ? 1 : 0 });
  }

  // ----------------------------------------------------------- owner side

  private onRequest(token: number, size: number, leaseMs: number): void {
    const deny = (reason: number): void => this.host.sendCtrl({ type: MsgType.MR_DENY, token, a: reason });
    if (this.grantTokens.has(token)) return this.host.protocolError(`MR_REQUEST reuses the token ${token} of a live grant`);
    if (size === 0 || size > this.limits.maxRegionSize) return deny(DenyReason.TOO_LARGE);
    if (this.quotaUsed + size > this.limits.quotaBytes || this.grants.size >= this.limits.maxRegions) return deny(DenyReason.QUOTA);
    if (!peerMemory.take(size)) return deny(DenyReason.QUOTA);
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
      mr = this.host.pool.grant(mem.alloc, 0, size, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC);
    } catch {
      mem.release();
      peerMemory.give(size);
      return deny(DenyReason.NO_MEMORY);
    }
    const lease = Math.min(leaseMs || this.limits.defaultLeaseMs, this.limits.maxLeaseMs);
    const id = this.newId();
    const g: Grant = { mem, mr, timer: null, start: 0, length: size, requestToken: token };
    g.timer = longTimeout(() => this.endGrant(id)?.mem.release(), ownerRevokeDelay(lease, this.limits.leaseGraceMs));
    this.grants.set(id, g);
    this.grantTokens.add(token);
    this.quotaUsed += size;
    this.host.sendCtrl({ type: MsgType.MR_GRANT, token, id, a: size, b: lease, addr: mr.addr, rkey: mr.rkey });
  }

  /** Revokes a grant (deregisters first: any later access fails with REMOTE_ACCESS); the caller frees or returns its memory. */
  private endGrant(id: number): Grant | null {
    const g = this.grants.get(id);
    if (!g) return null;
    this.grants.delete(id);
    this.grantTokens.delete(g.requestToken);
    g.timer?.cancel();
    g.mr.deregister();
    this.quotaUsed -= g.length;
    peerMemory.give(g.length);
    return g;
  }

  /** Lends exactly `lmr`'s bytes to the peer (read, write, atomics) until it gives them back or the lease ends. */
  lend(lmr: LocalMr, leaseMs: number, signal: AbortSignal | undefined): Promise<void> {
    this.host.checkOpen("sendLocalMr");
    lmr.mem.check("sendLocalMr");
    if (signal?.aborted) return Promise.reject(abortError(signal));
    const id = this.newId();
    const mr = this.host.pool.grant(lmr.mem.alloc, lmr.start, lmr.length, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC);
    lmr.mem.lentTo = "sendLocalMr";
    const lend: Exposed = { mem: lmr.mem, mr, timer: null, start: lmr.start, length: lmr.length };
    lend.timer = longTimeout(() => this.endLend(id, false), ownerRevokeDelay(leaseMs, this.limits.leaseGraceMs));
    this.lends.set(id, lend);
    return this.host.postCtrl({ type: MsgType.MR_LEND, token: id, a: lmr.length, b: leaseMs, addr: mr.addr, rkey: mr.rkey }, signal);
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
  onMessage(m: Msg, owner: object): boolean {
    switch (m.type) {
      case MsgType.MR_REQUEST:
        this.onRequest(m.token, m.a, m.b);
        return true;
      case MsgType.MR_GRANT:
        this.onGrant(m);
        return true;
      case MsgType.MR_DENY:
        this.onDeny(m);
        return true;
      case MsgType.MR_RELEASE:
        this.endGrant(m.token)?.mem.release();
        return true;
      case MsgType.MR_LEND: {
        if (this.remoteMrs.length >= MAX_UNCLAIMED_LENDS) {
          this.host.protocolError(`more than ${MAX_UNCLAIMED_LENDS} lent regions not taken with receiveRemoteMr`);
          return true;
        }
        const lease = new RemoteLease(m.token, borrowerDeadline(performance.now(), m.b), (t) => this.releaseRemote(t, "lent"));
        lease.owner = owner;
        this.remoteMrs.push(new RemoteMr(m.addr, m.a, m.rkey, lease, "lent"));
        return true;
      }
      case MsgType.MR_RETURN:
        this.endLend(m.token, false);
        return true;
      case MsgType.MR_GIVE_BACK: {
        if (m.a === 1) {
          this.endLend(m.token, true);
          return true;
        }
        const g = this.endGrant(m.token);
        if (g) this.localMrs.push(new LocalMr(g.mem, 0, g.length));
        return true;
      }
      default:
        return false;
    }
  }

  /** The connection failed: pending requests and waits reject with `err`. */
  fail(err: RdmaError): void {
    for (const r of [...this.requests.values()]) r.reject(err);
    this.localMrs.fail(err);
    this.remoteMrs.fail(err);
  }

  /** Revokes and frees everything: grants, lends, regions handed back and never picked up. */
  teardown(): void {
    for (const id of [...this.grants.keys()]) this.endGrant(id)?.mem.release();
    for (const id of [...this.lends.keys()]) this.endLend(id, false);
    for (const l of this.localMrs.drain()) l.mem.release();
    for (const r of this.remoteMrs.drain()) r.lease.released = true;
  }

  stats(): { grants: number; quotaUsed: number; lends: number; unclaimedLocal: number; unclaimedRemote: number } {
    return { grants: this.grants.size, quotaUsed: this.quotaUsed, lends: this.lends.size, unclaimedLocal: this.localMrs.length, unclaimedRemote: this.remoteMrs.length };
  }
}
