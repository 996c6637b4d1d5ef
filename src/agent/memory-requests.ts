/**
 * The requester's side of the memory protocol: requests for the peer's
 * memory (MR_REQUEST, MR_OPEN) and their answers (MR_GRANT, MR_SHARED,
 * MR_DENY), renewals, regions the peer lent us, shared regions we opened at
 * the peer and their revocation. Every request and renewal settles once
 * (answer, timeout, abort, or the connection's failure); an answer that
 * comes after its request ended is given straight back; regions lent to us
 * and not yet taken are bounded (MAX_UNCLAIMED_LENDS, past which the peer
 * is in breach); what we hold is released to the owner with MR_RELEASE or
 * MR_RETURN, and giving granted memory back wakes the requests waiting for
 * quota.
 */
import { RdmaError, type RdmaErrorCode } from "../errors.js";
import { RemoteLease, RemoteMr, type RemoteAccess } from "../memory/mr.js";
import { AsyncQueue, abortError, abortableWait } from "./queue.js";
import { DenyReason, MsgType, RenewStatus } from "./codec.js";
import { borrowerDeadline } from "./leases.js";
import { accessFlags, nameKey, type ShareAccess } from "./shares.js";
import { accessOfFlags, type Kind, type MemoryHost, type PeerLimits } from "./memory-host.js";

/** Regions lent to this side and not yet taken with receiveRemoteMr, before the peer is in breach. */
export const MAX_UNCLAIMED_LENDS = 1024;

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
export class MemoryRequests {
  private nextReq = 1;
  private readonly requests = new Map<number, Pending>();
  /** Shared regions this side opened at the peer: open id → lease (marked revoked on MR_REVOKED). */
  private readonly openedRemote = new Map<number, RemoteLease>();
  /** Renewals waiting for MR_RENEWED, by grant/lend id. */
  private readonly renewals = new Map<number, { resolve: () => void; reject: (e: unknown) => void; sentAt: number; leaseMs: number; lease: RemoteLease }>();
  /** Called when this side gives back granted memory: quota waits retry. */
  private readonly quotaWaiters = new Set<() => void>();
  readonly remoteMrs = new AsyncQueue<RemoteMr>("receiveRemoteMr");

  constructor(
    private readonly host: Pick<MemoryHost, "sendCtrl" | "sendCtrlOrdered" | "postCtrl" | "checkOpen" | "down" | "protocolError">,
    /** The peer's limits, once its LIMITS message arrived. */
    private readonly peerLimitsNow: () => PeerLimits | null,
  ) {}

  private get peerLimits(): PeerLimits | null {
    return this.peerLimitsNow();
  }

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

  onGrant(m: Kind<typeof MsgType.MR_GRANT>): void {
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

  onShared(m: Kind<typeof MsgType.MR_SHARED>): void {
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

  onDeny(m: Kind<typeof MsgType.MR_DENY>): void {
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

  onRenewed(m: Kind<typeof MsgType.MR_RENEWED>): void {
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

  /** MR_REVOKED: the owner revokes a shared region we opened; acknowledged once our earlier operations are sent. */
  onRevoked(m: Kind<typeof MsgType.MR_REVOKED>): void {
    const lease = this.openedRemote.get(m.token);
    if (lease) {
      this.openedRemote.delete(m.token);
      lease.revoked = true;
      // The acknowledgement, after every operation queued before it: those on the region
      // reach the owner first (RC order).
      this.host.sendCtrlOrdered({ type: MsgType.MR_RELEASE, token: m.token });
    }
  }

  /** MR_LEND: a region the peer lends us, queued for receiveRemoteMr (bounded). */
  onLend(m: Kind<typeof MsgType.MR_LEND>, owner: object): void {
    if (this.remoteMrs.length >= MAX_UNCLAIMED_LENDS) {
      this.host.protocolError(`more than ${MAX_UNCLAIMED_LENDS} lent regions not taken with receiveRemoteMr`);
      return;
    }
    const access = accessOfFlags(m.access);
    if (access === null) {
      this.host.protocolError(`MR_LEND with access flags 0x${m.access.toString(16)}`);
      return;
    }
    const lease = new RemoteLease(m.token, borrowerDeadline(performance.now(), m.leaseMs), (t) => this.releaseRemote(t, "lent"));
    lease.owner = owner;
    lease.renewer = (rmr, ms, signal) => this.renew(rmr, ms, signal);
    this.remoteMrs.push(new RemoteMr(m.addr, m.size, m.rkey, lease, "lent", access));
  }

  /** The connection failed: pending requests, renewals and quota waits end with `err`. */
  fail(err: RdmaError): void {
    for (const r of [...this.requests.values()]) r.reject(err);
    for (const r of [...this.renewals.values()]) r.reject(err);
    for (const w of [...this.quotaWaiters]) w();
  }

  /** Nothing held at the peer is used any more: opened shares and lent regions not taken. */
  teardown(): void {
    for (const lease of this.openedRemote.values()) lease.released = true;
    this.openedRemote.clear();
    for (const r of this.remoteMrs.drain()) r.lease.released = true;
  }

  /** Shared regions this side has open at the peer. */
  get sharesOpened(): number {
    return this.openedRemote.size;
  }
}
