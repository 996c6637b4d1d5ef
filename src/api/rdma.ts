/**
 * Rdma: one connection, with every data operation of async-rdma.
 */
import { RdmaError, checkInt } from "../errors.js";
import { Access, WrOpcode } from "../transport/types.js";
import type { Connection } from "../agent/connection.js";
import { LocalMemory, LocalMr, RemoteLease, RemoteMr, type RemoteAccess } from "../memory/mr.js";
import type { PeerLimits } from "../agent/memory-protocol.js";
import { checkAccess } from "../agent/shares.js";
import { SharedMr, shareIn, type ShareOptions } from "./shared.js";
import type { Context } from "./context.js";
import { parseAddr } from "./handshake.js";
import type { ResolvedSettings } from "./builder.js";
import type { PeerInfo } from "./auth.js";
import { createStream, type RdmaStream, type StreamOptions } from "./stream.js";

export type { PeerInfo };

/** Options every operation takes. */
export interface OpOptions {
  /** Aborts the operation while it has not been posted (rejects with ABORTED). */
  signal?: AbortSignal;
}

/**
 * The connection a RemoteMr was handed out on (requestRemoteMr,
 * receiveRemoteMr): its rkey is valid only there (the peer registered it in
 * that connection's protection domain), so any other connection refuses it
 * before posting instead of dying of a remote access error.
 */
const remoteOwner = new WeakMap<RemoteLease, Connection>();

function own(rmr: RemoteMr, conn: Connection): RemoteMr {
  remoteOwner.set(rmr.lease, conn);
  return rmr;
}

/** Options objects: absent or an object (null, numbers and strings are misuse). */
function optsOf<T extends object>(o: T | undefined | null, what: string): Partial<T> {
  if (o === undefined) return {};
  if (o === null || typeof o !== "object") throw new RdmaError("INVALID_ARGUMENT", `${what}: options must be an object, got ${o === null ? "null" : typeof o}`);
  return o;
}

function checkImm(v: unknown): number {
  return checkInt("imm", v, 0, 0xffffffff);
}

function checkBig(v: unknown, name: string): bigint {
  if (typeof v !== "bigint") throw new RdmaError("INVALID_ARGUMENT", `${name} must be a bigint`);
  return BigInt.asUintN(64, v);
}

export function signalOf(o: OpOptions | undefined | null, what = "operation"): AbortSignal | undefined {
  const s = optsOf(o, what).signal;
  if (s !== undefined && !(s instanceof AbortSignal)) throw new RdmaError("INVALID_ARGUMENT", "signal must be an AbortSignal");
  return s;
}

/** Settles a promise that may throw synchronously into a rejected promise. */
function guard<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return fn();
  } catch (e) {
    return Promise.reject(e);
  }
}

/**
 * One RDMA connection.
 *
 * @example
 * const rdma = await new RdmaBuilder().connect("127.0.0.1:5555");
 * using lmr = rdma.allocLocalMr(8);
 * await rdma.send(lmr);
 * await rdma.close();
 */
export class Rdma {
  /** @internal */ readonly conn: Connection;
  /** @internal */ readonly ctx: Context;
  /** @internal */ readonly settings: ResolvedSettings;
  private readonly redial: ((ctx: Context) => Promise<Rdma>) | null;
  /**
   * Who is at the other end: the address and port of the side channel's (or
   * RDMA CM's) peer, and the identity the connection authenticated with
   * (setAuth; on the client, the identity it used), null when unauthenticated.
   */
  readonly peer: PeerInfo;
  private readonly userMrs = new Set<LocalMemory>();
  private closePromise: Promise<void> | null = null;

  /** @internal */
  /**
   * @internal `redial` (client side only) establishes a sibling on a retained
   * context the way this connection was established (side channel or RDMA CM).
   * `peer`: see {@link Rdma.peer}.
   */
  constructor(conn: Connection, ctx: Context, settings: ResolvedSettings, client: { addr: { host: string; port: number }; redial: (ctx: Context) => Promise<Rdma> } | null, peer: PeerInfo) {
    this.peer = Object.freeze({ address: peer.address, port: peer.port, identity: peer.identity });
    this.conn = conn;
    this.ctx = ctx;
    this.settings = settings;
    this.redial = client?.redial ?? null;
  }

  /**
   * A LocalMr this connection may use: its memory must be registered in this
   * connection's protection domain (allocated or registered on it, on a
   * newConnection() sibling, or received on it). Memory of another
   * connection would fail on the device (a local protection error that kills
   * the connection): refused here, INVALID_ARGUMENT, nothing posted.
   */
  private lmr(v: unknown, name: string, what: string): LocalMr {
    // A closed connection says so first, whatever memory the call names (its own is freed by now).
    this.conn.checkOpen(what);
    if (!(v instanceof LocalMr)) throw new RdmaError("INVALID_ARGUMENT", `${name} must be a LocalMr (from allocLocalMr, registerMr or receive)`);
    v.mem.check(name); // disposed, lent, or freed with its connection: INVALID_STATE
    if (v.mem.alloc.mr.pd !== this.ctx.pd) {
      throw new RdmaError("INVALID_ARGUMENT", `${name} belongs to another connection (another protection domain): use memory allocated, registered or received on this connection or a newConnection() sibling, or copy it`);
    }
    return v;
  }

  /** A RemoteMr this connection may use: one it was given (see remoteOwner). */
  private rmr(v: unknown, name: string): RemoteMr {
    if (!(v instanceof RemoteMr)) throw new RdmaError("INVALID_ARGUMENT", `${name} must be a RemoteMr (from requestRemoteMr or receiveRemoteMr)`);
    const owner = remoteOwner.get(v.lease);
    if (owner !== undefined && owner !== this.conn) {
      throw new RdmaError("INVALID_ARGUMENT", `${name} was granted to another connection: its rkey is valid only there (the peer registered it in that connection's protection domain)`);
    }
    return v;
  }

  /** "tcp" or "verbs": the provider this connection runs on. */
  get provider(): string {
    return this.ctx.provider.name;
  }

  /** The device this connection runs on (e.g. "rxe0", or the tcp provider's device). */
  get deviceName(): string {
    return this.ctx.device.name;
  }

  /** Registered, zeroed memory from the pool; `bytes` is a Uint8Array view over it. Size 0 gives an empty region (an empty message). */
  allocLocalMr(size: number): LocalMr {
    this.conn.checkOpen("allocLocalMr");
    checkInt("size", size, 0, this.ctx.device.attr.maxMrSize);
    return new LocalMr(new LocalMemory(this.ctx.pool, this.ctx.pool.alloc(Math.max(1, size))), 0, size);
  }

  /**
   * Registers the caller's own memory. The MR keeps it alive; disposing the
   * LocalMr deregisters it (the caller's buffer is not detached).
   */
  registerMr(buffer: ArrayBuffer, offset = 0, length?: number): LocalMr {
    this.conn.checkOpen("registerMr");
    if (!(buffer instanceof ArrayBuffer)) throw new RdmaError("INVALID_ARGUMENT", "registerMr takes an ArrayBuffer (use view.buffer for a typed array; Buffer pool slices are not allowed)");
    const mr = this.ctx.pd.registerMr(buffer, Access.LOCAL_WRITE, offset, length);
    const mem = new LocalMemory(null, { mr, addr: mr.addr, length: mr.length, buffer, bufOffset: mr.offset, mrBufOffset: mr.offset }, () => this.userMrs.delete(mem));
    this.userMrs.add(mem);
    return new LocalMr(mem, 0, mr.length);
  }

  /** Sends `lmr`'s bytes; the peer gets them from receive(). Any length: large messages go by rendezvous READ. */
  send(lmr: LocalMr, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.send(this.lmr(lmr, "lmr", "send"), undefined, signalOf(opts)));
  }

  /** Like send, with 32 bits of immediate data; the peer gets `{ mr, imm }` from receiveWithImm(). */
  sendWithImm(lmr: LocalMr, imm: number, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.send(this.lmr(lmr, "lmr", "sendWithImm"), checkImm(imm), signalOf(opts)));
  }

  /** The next message, in a LocalMr of exactly its length (dispose it when done). */
  async receive(opts?: OpOptions): Promise<LocalMr> {
    const r = await this.conn.receive(signalOf(opts));
    return r.mr;
  }

  /** The next message and its immediate data (undefined when it was sent without). */
  receiveWithImm(opts?: OpOptions): Promise<{ mr: LocalMr; imm: number | undefined }> {
    return guard(() => this.conn.receive(signalOf(opts)));
  }

  /** One-sided RDMA WRITE of `lmr` into `rmr` (lmr.length ≤ rmr.length). */
  write(lmr: LocalMr, rmr: RemoteMr, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.write(this.lmr(lmr, "lmr", "write"), this.rmr(rmr, "rmr"), undefined, signalOf(opts)));
  }

  /** RDMA WRITE with immediate: the peer's receiveWriteImm() yields `imm` once the data is in place. */
  writeWithImm(lmr: LocalMr, rmr: RemoteMr, imm: number, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.write(this.lmr(lmr, "lmr", "writeWithImm"), this.rmr(rmr, "rmr"), checkImm(imm), signalOf(opts)));
  }

  /** The immediate of the next WRITE_WITH_IMM from the peer. */
  receiveWriteImm(opts?: OpOptions): Promise<number> {
    return guard(() => this.conn.receiveWriteImm(signalOf(opts)));
  }

  /** One-sided RDMA READ of `rmr` into `lmr` (lmr.length bytes). */
  read(lmr: LocalMr, rmr: RemoteMr, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.read(this.lmr(lmr, "lmr", "read"), this.rmr(rmr, "rmr"), signalOf(opts)));
  }

  /** Atomic compare-and-swap on 8 aligned bytes of `rmr`; resolves to the old value. */
  compareAndSwap(rmr: RemoteMr, compare: bigint, swap: bigint, opts?: OpOptions): Promise<bigint> {
    return guard(() => this.conn.atomic(this.rmr(rmr, "rmr"), WrOpcode.ATOMIC_CMP_AND_SWP, checkBig(compare, "compare"), checkBig(swap, "swap"), signalOf(opts)));
  }

  /** Atomic fetch-and-add on 8 aligned bytes of `rmr`; resolves to the old value. */
  fetchAndAdd(rmr: RemoteMr, add: bigint, opts?: OpOptions): Promise<bigint> {
    return guard(() => this.conn.atomic(this.rmr(rmr, "rmr"), WrOpcode.ATOMIC_FETCH_AND_ADD, checkBig(add, "add"), 0n, signalOf(opts)));
  }

  /**
   * Asks the peer for `size` bytes of its memory, leased for `leaseMs`
   * (default: the builder's). Fails with QUOTA_EXCEEDED past the peer's quota.
   */
  requestRemoteMr(size: number, opts?: OpOptions & { timeoutMs?: number; leaseMs?: number; access?: RemoteAccess; waitForQuota?: boolean }): Promise<RemoteMr> {
    return guard(async () => {
      // the size travels in a 32-bit field of the request
      checkInt("size", size, 1, 2 ** 32 - 1);
      const o = optsOf(opts, "requestRemoteMr");
      const lease = o.leaseMs === undefined ? this.settings.defaultLeaseMs : checkInt("leaseMs", o.leaseMs, 1, 2 ** 31);
      const timeout = o.timeoutMs === undefined ? undefined : checkInt("timeoutMs", o.timeoutMs, 1, 2 ** 31);
      const access = o.access === undefined ? "atomic" : checkAccess(o.access, "requestRemoteMr");
      if (o.waitForQuota !== undefined && typeof o.waitForQuota !== "boolean") throw new RdmaError("INVALID_ARGUMENT", "requestRemoteMr: waitForQuota must be a boolean");
      return own(await this.conn.requestRemoteMr(size, lease, timeout, signalOf(o, "requestRemoteMr"), access, o.waitForQuota === true), this.conn);
    });
  }

  /**
   * Lends exactly `lmr`'s bytes to the peer (receiveRemoteMr there) with
   * `access` (default "atomic": read, write and atomics); `lmr` is unusable
   * here until it comes back.
   */
  sendLocalMr(lmr: LocalMr, opts?: OpOptions & { leaseMs?: number; access?: RemoteAccess }): Promise<void> {
    return guard(() => {
      const o = optsOf(opts, "sendLocalMr");
      const lease = o.leaseMs === undefined ? this.settings.defaultLeaseMs : checkInt("leaseMs", o.leaseMs, 1, 2 ** 31);
      const access = o.access === undefined ? "atomic" : checkAccess(o.access, "sendLocalMr");
      return this.conn.sendLocalMr(this.lmr(lmr, "lmr", "sendLocalMr"), lease, signalOf(o, "sendLocalMr"), access);
    });
  }

  /**
   * Shares `lmr`'s bytes by name with the peer of this connection and its
   * newConnection() siblings; this side keeps full access. The peer opens it
   * with openSharedMr(name). Revoke (or dispose) the returned SharedMr to end it.
   */
  share(name: string, lmr: LocalMr, opts?: ShareOptions): SharedMr {
    this.conn.checkOpen("share");
    return shareIn(this.ctx.shares, name, this.lmr(lmr, "lmr", "share"), opts);
  }

  /**
   * Opens a region the peer shares under `name` (on its listener or this
   * connection): a RemoteMr with no lease, valid until the owner revokes it
   * or the connection closes; dispose it to close it. An unknown name, or
   * one the owner's allow() refuses, rejects with NOT_FOUND.
   */
  openSharedMr(name: string, opts?: OpOptions & { timeoutMs?: number }): Promise<RemoteMr> {
    return guard(async () => {
      if (typeof name !== "string" || name.length === 0) throw new RdmaError("INVALID_ARGUMENT", "openSharedMr: the name must be a non-empty string");
      const o = optsOf(opts, "openSharedMr");
      const timeout = o.timeoutMs === undefined ? undefined : checkInt("timeoutMs", o.timeoutMs, 1, 2 ** 31);
      return own(await this.conn.openSharedMr(name, timeout, signalOf(o, "openSharedMr")), this.conn);
    });
  }

  /**
   * Asks the owner to extend the lease of a granted or lent region to
   * `leaseMs` from now (the owner's maximum applies: asking for more fails
   * with OUT_OF_RANGE naming it). Same as `rmr.renew(leaseMs)`.
   */
  renew(rmr: RemoteMr, leaseMs: number, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.renew(this.rmr(rmr, "rmr"), checkInt("leaseMs", leaseMs, 1, 2 ** 31), signalOf(opts, "renew")));
  }

  /**
   * The peer's limits: the quota and regions it grants this connection, its
   * longest lease, its largest message. Known once connect/accept resolved.
   */
  get peerLimits(): PeerLimits | null {
    return this.conn.peerLimits;
  }

  /** Memory the peer lent with sendLocalMr. */
  receiveRemoteMr(opts?: OpOptions): Promise<RemoteMr> {
    return guard(async () => own(await this.conn.receiveRemoteMr(signalOf(opts)), this.conn));
  }

  /** Hands a remote region back to its owner (receiveLocalMr there); this side loses access. */
  sendRemoteMr(rmr: RemoteMr, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.sendRemoteMr(this.rmr(rmr, "rmr"), signalOf(opts)));
  }

  /** Own memory the peer handed back with sendRemoteMr (after writing into it, typically). */
  receiveLocalMr(opts?: OpOptions): Promise<LocalMr> {
    return guard(() => this.conn.receiveLocalMr(signalOf(opts)));
  }

  /**
   * A new connection to the same server, sharing this one's protection
   * domain and memory pool (its own QP and CQ). Only for client-side Rdma.
   */
  async newConnection(): Promise<Rdma> {
    this.conn.checkOpen("newConnection");
    if (!this.redial) throw new RdmaError("INVALID_STATE", "newConnection() needs a client-side Rdma (from connect); on a server, accept more connections from its listener");
    return whenReady(await this.redial(this.ctx.retain()));
  }

  /** @internal Internal counters (credits, outstanding work, grants, quota use). */
  stats(): ReturnType<Connection["stats"]> & { pool: ReturnType<Context["pool"]["stats"]> } {
    return { ...this.conn.stats(), pool: this.ctx.pool.stats() };
  }

  /**
   * A `stream.Duplex` of bytes over this connection (see docs/guide/net.md); one at a time. While it
   * is open it owns the connection's messages: do not send or receive on the connection yourself.
   */
  createStream(opts?: StreamOptions): RdmaStream {
    return createStream(this, opts);
  }

  /** Whether the connection is closed (by either side, or failed). */
  get closed(): boolean {
    return this.conn.isClosed;
  }

  /**
   * Closes the connection: tells the peer, which can still receive every
   * message that arrived before (then its receive() rejects with
   * CONNECTION_CLOSED), and releases this side's resources. Messages this
   * side received and did not read are dropped.
   */
  close(): Promise<void> {
    this.closePromise ??= this.conn.close(this.settings.closeTimeoutMs);
    return this.closePromise;
  }

  /** `await using rdma = ...`: closes the connection at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  /** @internal runs once after the resources are released (RDMA CM: disconnect and destroy the id) */
  onReleased: (() => void) | null = null;

  /** @internal called by the connection after teardown */
  releaseResources(): void {
    for (const m of [...this.userMrs]) m.release();
    try {
      this.conn.qp.destroy();
    } catch {
      /* gone */
    }
    try {
      this.conn.cq.destroy();
    } catch {
      /* gone */
    }
    this.ctx.release();
    const f = this.onReleased;
    this.onReleased = null;
    f?.();
  }
}

export { parseAddr };

/**
 * Resolves once the connection knows the peer's limits (the agent's first
 * message, LIMITS), so `peerLimits` is set when connect/accept hand it out;
 * a peer that does not send them within the connect timeout is dropped.
 */
export async function whenReady(rdma: Rdma): Promise<Rdma> {
  try {
    await rdma.conn.whenPeerLimits(rdma.settings.connectTimeoutMs);
    rdma.conn.checkOpen("connect"); // one that failed during setup is never handed out
    return rdma;
  } catch (e) {
    rdma.conn.checkOpen("connect");
    await rdma.close().catch(() => {});
    throw e;
  }
}
