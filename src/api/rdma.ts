/**
 * Rdma: one connection, with every data operation of async-rdma.
 */
import { RdmaError, checkInt } from "../errors.js";
import { Access, WrOpcode } from "../transport/types.js";
import { SMALL_SEND_COPY, type Connection } from "../agent/connection.js";
import type { SendListener } from "../agent/ops.js";
import { LocalMemory, LocalMr, type RemoteMr, type RemoteAccess } from "../memory/mr.js";
import type { PeerLimits } from "../agent/memory-protocol.js";
import { checkAccess } from "../agent/shares.js";
import { SharedMr, shareIn, type ShareOptions } from "./shared.js";
import type { Context } from "./context.js";
import { parseAddr } from "./establish/protocol.js";
import type { ResolvedSettings } from "./settings.js";
import type { PeerInfo } from "./establish/auth.js";
import { closeOptions, endPromise, messagesOf, type CloseOptions, type MessagesOptions } from "./lifecycle.js";
import { debug, ended, opened, traced, tracing, type OperationName } from "./observe.js";
import { Staging } from "./staging.js";
import { createStream, type RdmaStream, type StreamOptions } from "./stream.js";
import { checkBig, checkImm, guard, localMrOf, optsOf, released, remoteMrOf, signalOf, sizeOf, staged, type OpOptions, type SendData } from "./operands.js";
import { statsOf, type AgentStats, type RdmaStats } from "./stats.js";

export type { PeerInfo, CloseOptions, MessagesOptions, OpOptions, SendData, RdmaStats, AgentStats };

/** Message of `async-rdma:connection:open`. */
export interface ConnectionOpenMessage {
  rdma: Rdma;
}

/** Message of `async-rdma:connection:close` and `async-rdma:connection:error`. */
export interface ConnectionEndMessage {
  rdma: Rdma;
  /** The failure that ended the connection; undefined for a clean close (either side's close()). */
  error: RdmaError | undefined;
}

/** Message of `async-rdma:operation:start` and `:end` (one object per operation, published on both). */
export interface OperationMessage {
  rdma: Rdma;
  operation: OperationName;
  /** Bytes the operation moves out (send, write) or asks for (read); 0 for receives, 8 for atomics. On end, a receive's length. */
  bytes: number;
  /** Set on end when the operation failed. */
  error: unknown;
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
  /** Where plain buffers are copied before an operation (reused, never handed out). */
  private readonly staging: Staging;
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
  private readonly end = endPromise();
  /**
   * Settles when the connection has ended and its resources are released:
   * resolves (undefined) when either side closed it, rejects with the typed
   * RdmaError when it failed (RETRY_EXCEEDED for a dead peer, PROTOCOL, ...)
   * or when this side's `close({ flush: true })` could not flush (TIMEOUT).
   * Never an unhandled rejection when nobody awaits it.
   *
   * @example
   * rdma.closed.then(() => console.log("closed"), (e) => console.error("failed:", e.code));
   */
  readonly closed: Promise<void> = this.end.promise;

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
    this.staging = new Staging(ctx.pool, () => conn.isClosed || conn.failure !== null);
    this.settings = settings;
    this.redial = client?.redial ?? null;
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
   * Registers the caller's own memory: an ArrayBuffer, or a
   * SharedArrayBuffer (a worker thread can fill it while it is registered:
   * the device reads and writes the same memory, no copy). The MR keeps it
   * alive; disposing the LocalMr deregisters it (the caller's buffer is not
   * detached).
   *
   * Refused (INVALID_ARGUMENT): a typed array or Buffer (register its
   * `.buffer`; a small Buffer is a slice of Node's shared pool, and
   * registering the pool would expose other Buffers' bytes: send it instead,
   * it is copied), a resizable or growable buffer (its memory may move or
   * grow past the registration), a detached one.
   *
   * @example
   * const sab = new SharedArrayBuffer(1 << 20);
   * using lmr = rdma.registerMr(sab);
   * new Worker(fill, { workerData: sab }); // the worker writes, then rdma.send(lmr)
   */
  registerMr(buffer: ArrayBuffer | SharedArrayBuffer, offset = 0, length?: number): LocalMr {
    this.conn.checkOpen("registerMr");
    const shared = typeof SharedArrayBuffer === "function" && buffer instanceof SharedArrayBuffer;
    if (!(buffer instanceof ArrayBuffer) && !shared) {
      throw new RdmaError("INVALID_ARGUMENT", `registerMr takes an ArrayBuffer or a SharedArrayBuffer${ArrayBuffer.isView(buffer) ? " (register view.buffer; a small Buffer is a slice of Node's shared pool: send it, it is copied)" : ""}`);
    }
    const mr = this.ctx.pd.registerMr(buffer, Access.LOCAL_WRITE, offset, length);
    const mem = new LocalMemory(null, { mr, addr: mr.addr, length: mr.length, buffer: buffer as ArrayBuffer, bufOffset: mr.offset, mrBufOffset: mr.offset }, () => this.userMrs.delete(mem));
    this.userMrs.add(mem);
    return new LocalMr(mem, 0, mr.length);
  }

  /**
   * Sends `data`; the peer gets it from receive(). Any length: large messages
   * go by rendezvous READ. A LocalMr is sent from where it is (zero-copy);
   * a Uint8Array, Buffer or DataView is copied into registered memory first
   * (so it may be reused as soon as send() returns): up to 232 bytes,
   * straight behind the message's header in a buffer the connection reuses.
   *
   * @example
   * await rdma.send(Buffer.from("hello"));
   */
  send(data: SendData, opts?: OpOptions): Promise<void> {
    if (tracing()) return traced(this, "send", sizeOf(data), () => this.sendNow(data, undefined, opts, "send"));
    // guard() inlined: no closure per message.
    try {
      return this.sendNow(data, undefined, opts, "send");
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /** Like send, with 32 bits of immediate data; the peer gets `{ mr, imm }` from receiveWithImm(). */
  sendWithImm(data: SendData, imm: number, opts?: OpOptions): Promise<void> {
    if (tracing()) return traced(this, "sendWithImm", sizeOf(data), () => this.sendNow(data, checkImm(imm), opts, "sendWithImm"));
    try {
      return this.sendNow(data, checkImm(imm), opts, "sendWithImm");
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /**
   * @internal send() of a LocalMr without a promise: `listener` is told how
   * it ended, exactly once, after this returns (the RPC outbox's batches: a
   * message costs it no promise). Work is posted once the microtask
   * checkpoint ends and a refusal is told from a microtask; a failure may be
   * told inside the drain that found it, before the connection's teardown.
   * Traced as send() while tracing is on.
   */
  sendListened(lmr: LocalMr, listener: SendListener): void {
    if (tracing()) {
      this.send(lmr).then(
        () => listener.sent(null),
        (e: unknown) => listener.sent(e),
      );
      return;
    }
    try {
      this.conn.sendListened(localMrOf(this.conn, this.ctx.pd, lmr, "lmr", "send"), listener);
    } catch (e) {
      queueMicrotask(() => listener.sent(e));
    }
  }

  private sendNow(data: unknown, imm: number | undefined, opts: OpOptions | undefined, what: string): Promise<void> {
    if (data instanceof LocalMr) return this.conn.send(localMrOf(this.conn, this.ctx.pd, data, "lmr", what), imm, signalOf(opts));
    const signal = signalOf(opts);
    // Small: copied behind the message's header, no staging memory.
    if (ArrayBuffer.isView(data) && data.byteLength <= SMALL_SEND_COPY && data.byteLength <= this.peerEagerThreshold) return this.conn.sendCopy(data, imm, signal, what);
    const lmr = staged(this.conn, data, what, this.staging);
    // Eager: the operation pins the staged memory until it completes, so it is released now
    // (freed when the send settles) and the caller's promise is the operation's own.
    if (lmr.length <= this.peerEagerThreshold) {
      try {
        return this.conn.send(lmr, imm, signal);
      } finally {
        lmr.dispose();
      }
    }
    return released(lmr, () => this.conn.send(lmr, imm, signal));
  }

  /** The next message, in a LocalMr of exactly its length (dispose it when done). */
  receive(opts?: OpOptions): Promise<LocalMr> {
    if (tracing()) return traced(this, "receive", 0, () => this.receiveMr(opts));
    return this.receiveMr(opts);
  }

  private receiveMr(opts: OpOptions | undefined): Promise<LocalMr> {
    try {
      return this.conn.receiveMr(signalOf(opts));
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /** The next message and its immediate data (undefined when it was sent without). */
  receiveWithImm(opts?: OpOptions): Promise<{ mr: LocalMr; imm: number | undefined }> {
    if (tracing()) return traced(this, "receiveWithImm", 0, () => this.conn.receive(signalOf(opts)));
    try {
      return this.conn.receive(signalOf(opts));
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /**
   * The received messages in arrival order, for `for await`. The loop ends
   * (no error) when the connection ends cleanly: the peer closed (after every
   * message it sent before closing) or this side closed. A failure throws its
   * RdmaError; an abort of `signal` throws ABORTED. Dispose each message when
   * done with it (`using`). Messages sent with an immediate come without it
   * here (use receiveWithImm for those).
   *
   * @example
   * for await (const msg of rdma.messages()) {
   *   using m = msg;
   *   handle(m.bytes);
   * }
   * // here the peer has closed
   */
  messages(opts?: MessagesOptions): AsyncGenerator<LocalMr, void, undefined> {
    return messagesOf(this.conn, signalOf(opts, "messages"));
  }

  /**
   * One-sided RDMA WRITE of `data` into `rmr` (data's length ≤ rmr.length).
   * A LocalMr is written from where it is; a Uint8Array, Buffer or DataView
   * is copied into registered memory first.
   */
  write(data: SendData, rmr: RemoteMr, opts?: OpOptions): Promise<void> {
    if (tracing()) return traced(this, "write", sizeOf(data), () => this.writeNow(data, rmr, undefined, opts, "write"));
    return guard(() => this.writeNow(data, rmr, undefined, opts, "write"));
  }

  /** RDMA WRITE with immediate: the peer's receiveWriteImm() yields `imm` once the data is in place. Takes the same data as write(). */
  writeWithImm(data: SendData, rmr: RemoteMr, imm: number, opts?: OpOptions): Promise<void> {
    if (tracing()) return traced(this, "writeWithImm", sizeOf(data), () => this.writeNow(data, rmr, checkImm(imm), opts, "writeWithImm"));
    return guard(() => this.writeNow(data, rmr, checkImm(imm), opts, "writeWithImm"));
  }

  private writeNow(data: unknown, rmr: RemoteMr, imm: number | undefined, opts: OpOptions | undefined, what: string): Promise<void> {
    if (data instanceof LocalMr) return this.conn.write(localMrOf(this.conn, this.ctx.pd, data, "lmr", what), remoteMrOf(rmr, "rmr"), imm, signalOf(opts));
    const r = remoteMrOf(rmr, "rmr");
    const signal = signalOf(opts);
    const lmr = staged(this.conn, data, what, this.staging);
    return released(lmr, () => this.conn.write(lmr, r, imm, signal));
  }

  /** The immediate of the next WRITE_WITH_IMM from the peer. */
  receiveWriteImm(opts?: OpOptions): Promise<number> {
    if (tracing()) return traced(this, "receiveWriteImm", 0, () => this.conn.receiveWriteImm(signalOf(opts)));
    return guard(() => this.conn.receiveWriteImm(signalOf(opts)));
  }

  /** One-sided RDMA READ of `rmr` into `lmr` (lmr.length bytes). */
  read(lmr: LocalMr, rmr: RemoteMr, opts?: OpOptions): Promise<void> {
    if (tracing()) return traced(this, "read", lmr instanceof LocalMr ? lmr.length : 0, () => this.conn.read(localMrOf(this.conn, this.ctx.pd, lmr, "lmr", "read"), remoteMrOf(rmr, "rmr"), signalOf(opts)));
    return guard(() => this.conn.read(localMrOf(this.conn, this.ctx.pd, lmr, "lmr", "read"), remoteMrOf(rmr, "rmr"), signalOf(opts)));
  }

  /** Atomic compare-and-swap on 8 aligned bytes of `rmr`; resolves to the old value. */
  compareAndSwap(rmr: RemoteMr, compare: bigint, swap: bigint, opts?: OpOptions): Promise<bigint> {
    if (tracing()) return traced(this, "compareAndSwap", 8, () => this.conn.atomic(remoteMrOf(rmr, "rmr"), WrOpcode.ATOMIC_CMP_AND_SWP, checkBig(compare, "compare"), checkBig(swap, "swap"), signalOf(opts)));
    return guard(() => this.conn.atomic(remoteMrOf(rmr, "rmr"), WrOpcode.ATOMIC_CMP_AND_SWP, checkBig(compare, "compare"), checkBig(swap, "swap"), signalOf(opts)));
  }

  /** Atomic fetch-and-add on 8 aligned bytes of `rmr`; resolves to the old value. */
  fetchAndAdd(rmr: RemoteMr, add: bigint, opts?: OpOptions): Promise<bigint> {
    if (tracing()) return traced(this, "fetchAndAdd", 8, () => this.conn.atomic(remoteMrOf(rmr, "rmr"), WrOpcode.ATOMIC_FETCH_AND_ADD, checkBig(add, "add"), 0n, signalOf(opts)));
    return guard(() => this.conn.atomic(remoteMrOf(rmr, "rmr"), WrOpcode.ATOMIC_FETCH_AND_ADD, checkBig(add, "add"), 0n, signalOf(opts)));
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
      return await this.conn.requestRemoteMr(size, lease, timeout, signalOf(o, "requestRemoteMr"), access, o.waitForQuota === true);
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
      return this.conn.sendLocalMr(localMrOf(this.conn, this.ctx.pd, lmr, "lmr", "sendLocalMr"), lease, signalOf(o, "sendLocalMr"), access);
    });
  }

  /**
   * Shares `lmr`'s bytes by name with the peer of this connection and its
   * newConnection() siblings; this side keeps full access. The peer opens it
   * with openSharedMr(name). Revoke (or dispose) the returned SharedMr to end it.
   */
  share(name: string, lmr: LocalMr, opts?: ShareOptions): SharedMr {
    this.conn.checkOpen("share");
    return shareIn(this.ctx.shares, name, localMrOf(this.conn, this.ctx.pd, lmr, "lmr", "share"), opts);
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
      return await this.conn.openSharedMr(name, timeout, signalOf(o, "openSharedMr"));
    });
  }

  /**
   * Asks the owner to extend the lease of a granted or lent region to
   * `leaseMs` from now (the owner's maximum applies: asking for more fails
   * with OUT_OF_RANGE naming it). Same as `rmr.renew(leaseMs)`.
   */
  renew(rmr: RemoteMr, leaseMs: number, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.renew(remoteMrOf(rmr, "rmr"), checkInt("leaseMs", leaseMs, 1, 2 ** 31), signalOf(opts, "renew")));
  }

  /**
   * The peer's limits: the quota and regions it grants this connection, its
   * longest lease, its largest message. Known once connect/accept resolved.
   */
  get peerLimits(): PeerLimits | null {
    return this.conn.peerLimits;
  }

  /**
   * The peer's eager threshold (from the handshake): a message up to this
   * many bytes reaches it in one SEND; a larger one goes by rendezvous (the
   * peer READs it, one more round trip). Protocols on top size their
   * batches by it (async-rdma/rpc does).
   */
  get peerEagerThreshold(): number {
    return this.conn.peer.eagerMax;
  }

  /** Memory the peer lent with sendLocalMr. */
  receiveRemoteMr(opts?: OpOptions): Promise<RemoteMr> {
    return guard(() => this.conn.receiveRemoteMr(signalOf(opts)));
  }

  /** Hands a remote region back to its owner (receiveLocalMr there); this side loses access. */
  sendRemoteMr(rmr: RemoteMr, opts?: OpOptions): Promise<void> {
    return guard(() => this.conn.sendRemoteMr(remoteMrOf(rmr, "rmr"), signalOf(opts)));
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

  /**
   * This connection's counters: messages and bytes each way, rendezvous,
   * operations in flight, credit stalls, RNR retries, memory held. Reading
   * them costs nothing on the message path (plain counters).
   *
   * @example
   * const { messagesSent, bytesSent, creditStalls } = rdma.stats();
   */
  stats(): RdmaStats & AgentStats {
    return statsOf(this.conn, this.ctx.pool, this.userMrs);
  }

  /** Whether the connection has ended (closed by either side, or failed) and released its resources. See {@link closed} for a promise. */
  get isClosed(): boolean {
    return this.conn.isClosed;
  }

  /**
   * A `stream.Duplex` of bytes over this connection (see docs/guide/net.md); one at a time. While it
   * is open it owns the connection's messages and WRITE immediates: do not send, receive,
   * writeWithImm or receiveWriteImm on the connection yourself. Its data goes by RDMA WRITE
   * with immediate into a 1 MiB ring the reader shares once the writer has data.
   */
  createStream(opts?: StreamOptions): RdmaStream<Rdma> {
    return createStream<Rdma>(this, opts);
  }

  /**
   * Lets the process exit while this connection is open and idle, as
   * `socket.unref()` does (the connection still works while something else
   * keeps the process alive). An operation in flight does not hold the
   * process either. In busy and adaptive polling modes an unref'd connection
   * waits on completion events between completions (spinning would hold the
   * process).
   */
  unref(): this {
    this.conn.setKeepAlive(false);
    return this;
  }

  /** Undoes unref(): the open connection keeps the process alive (the default). */
  ref(): this {
    this.conn.setKeepAlive(true);
    return this;
  }

  /**
   * Closes the connection: tells the peer, which can still receive every
   * message that arrived before (then its receive() rejects with
   * CONNECTION_CLOSED, and its messages() loop ends), and releases this
   * side's resources. Messages this side received and did not read are
   * dropped.
   *
   * Without `flush`, operations still waiting to be posted (for the peer's
   * credits, under a slow reader) are dropped: they reject with
   * CONNECTION_CLOSED. With `{ flush: true }`, close() resolves only once
   * the peer has received everything sent before (it may still be reading
   * it): a sender that closes loses nothing. Past `timeoutMs` (default 30 s
   * with flush) it closes anyway and rejects with TIMEOUT; when the
   * connection ends first (the peer closed, or it failed), it rejects with
   * that error's code. Either way `closed` rejects with the same error (the
   * connection did not end cleanly). While a flush waits, new operations are
   * refused and the connection stays live (keep-alive and peer timeout run).
   *
   * Only the first call closes; a later call (or `await using`) resolves
   * once the connection is closed, without repeating a flush's error.
   *
   * @example
   * for (const chunk of chunks) void rdma.send(chunk);
   * await rdma.close({ flush: true }); // every chunk reached the peer
   */
  close(opts?: CloseOptions): Promise<void> {
    if (this.closePromise) return this.closePromise;
    let o: { flush: boolean; timeoutMs: number };
    try {
      o = closeOptions(opts, this.settings.closeTimeoutMs);
    } catch (e) {
      return Promise.reject(e);
    }
    if (debug.enabled) debug("close%s: peer %s:%d", o.flush ? " (flush)" : "", this.peer.address, this.peer.port);
    const p = this.conn.close(o.timeoutMs, o.flush).then((r) => {
      if (r !== null) throw r;
    });
    // A later close() (or `await using`) resolves once the connection is closed: a flush that
    // failed is reported once, to the call that asked for it, and by `closed`.
    this.closePromise = p.catch(() => {});
    return p;
  }

  /** `await using rdma = ...`: closes the connection at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  /** @internal runs once after the resources are released (RDMA CM: disconnect and destroy the id) */
  onReleased: (() => void) | null = null;

  /** @internal called by the connection after teardown */
  releaseResources(): void {
    // The agent destroyed its QP and CQ before it called here (Connection.teardown).
    for (const m of [...this.userMrs]) m.release();
    this.staging.release();
    this.ctx.release();
    const f = this.onReleased;
    this.onReleased = null;
    f?.();
    const failure = this.conn.endedCleanly ? undefined : (this.conn.closeFailure ?? this.conn.failure ?? new RdmaError("CONNECTION_CLOSED", "the connection ended"));
    this.end.settle(failure);
    ended(this, failure);
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
    opened(rdma);
    return rdma;
  } catch (e) {
    if (debug.enabled) debug("connection setup failed: peer %s:%d: %s", rdma.peer.address, rdma.peer.port, e instanceof Error ? e.message : String(e));
    rdma.conn.checkOpen("connect");
    await rdma.close().catch(() => {});
    throw e;
  }
}
