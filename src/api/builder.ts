/**
 * RdmaBuilder: settings, validated against the device, then connect, listen or bind.
 */
import { RdmaError, checkInt } from "../errors.js";
import { Access, type DeviceAttr } from "../transport/types.js";
import type { ProviderChoice } from "../transport/providers.js";
import type { PollingMode } from "../agent/poller.js";
import { type Rdma, parseAddr, whenReady } from "./rdma.js";
import { signalOf } from "./operands.js";
import { debug } from "./observe.js";
import { RdmaListener } from "./listener.js";
import type { Establisher } from "./establish/establisher.js";
import type { ConnectionManager, ResolvedSettings } from "./settings.js";
import { rdmaCmEstablisher, sideChannel } from "./establish/index.js";
import { Auth, type AuthOptions } from "./establish/auth.js";

export type { ResolvedSettings } from "./settings.js";

function envProvider(): ProviderChoice {
  const p = process.env.ASYNC_RDMA_PROVIDER;
  return p === "tcp" || p === "verbs" ? p : "auto";
}

/** Defaults; ASYNC_RDMA_PROVIDER and ASYNC_RDMA_DEVICE set the provider and device for programs that do not. */
/**
 * The default eager threshold: 4 KiB of payload plus 64 bytes for a
 * protocol's own framing, so a 4 KiB message of a protocol on top (an RPC
 * call: 12 bytes of frame header and the method name) still travels in one
 * SEND instead of a rendezvous round trip. Receive buffers are allocated in
 * size classes (memory/pool.ts), so on verbs the 64 bytes cost nothing, and
 * on tcp 2 KiB per connection.
 */
export const DEFAULT_EAGER_THRESHOLD = 4096 + 64;

const DEFAULTS: ResolvedSettings = {
  provider: envProvider(),
  device: process.env.ASYNC_RDMA_DEVICE || undefined,
  port: 1,
  gidIndex: Number(process.env.RXE_GID_INDEX ?? 1),
  cqSize: 0,
  maxSendWr: 256,
  maxRecvWr: 0,
  maxInlineData: 64,
  mtu: 4096,
  ackTimeout: 14,
  retryCount: 7,
  rnrRetry: 7,
  minRnrTimer: 12,
  maxRdAtomic: 16,
  qpAccess: Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC,
  polling: "adaptive",
  spinUs: 50,
  eagerMax: DEFAULT_EAGER_THRESHOLD,
  recvDepth: 32,
  quotaBytes: 64 * 1024 * 1024,
  maxRegions: 256,
  leaseGraceMs: 1_000,
  peerTimeoutMs: 15_000,
  rendezvousTimeoutMs: 60_000,
  defaultLeaseMs: 60_000,
  maxLeaseMs: 3_600_000,
  connectTimeoutMs: 10_000,
  closeTimeoutMs: 2_000,
  keepaliveMs: 2_000,
  maxMessageSize: 64 << 20,
  maxHandshakes: 256,
  // ~120 KiB of memory and 2 descriptors per idle connection with the other defaults (a streaming one
  // grows its receive ring to ~230 KiB): 1024 of them stay under ~300 MiB and fit a process's usual descriptor limit with room to spare.
  maxConnections: 1024,
  cm: "tcp",
  auth: null,
};

function limit(name: string, v: number, max: number, what: string): void {
  if (v > max) throw new RdmaError("INVALID_ARGUMENT", `${name} = ${v} exceeds the device's ${what} (${max})`);
}

/**
 * @example
 * const rdma = await new RdmaBuilder().setProvider("tcp").connect("127.0.0.1:5555");
 */
export class RdmaBuilder {
  private s: ResolvedSettings = { ...DEFAULTS };

  /** "verbs", "tcp" or "auto" (verbs when a device with an active port exists, else tcp). */
  setProvider(p: ProviderChoice): this {
    if (p !== "verbs" && p !== "tcp" && p !== "auto") throw new RdmaError("INVALID_ARGUMENT", `provider must be "verbs", "tcp" or "auto", got ${String(p)}`);
    this.s.provider = p;
    return this;
  }
  /** Device name (e.g. "rxe0"); default: the first device. */
  setDevice(name: string): this {
    if (typeof name !== "string" || !name) throw new RdmaError("INVALID_ARGUMENT", "device name must be a non-empty string");
    this.s.device = name;
    return this;
  }
  /** Device port, 1–255 (default 1). */
  setPort(port: number): this {
    this.s.port = checkInt("port", port, 1, 255);
    return this;
  }
  /** GID index of the port, 0–255 (default 1, or `RXE_GID_INDEX`); RoCE needs the GID that carries the interface's IP. */
  setGidIndex(i: number): this {
    this.s.gidIndex = checkInt("gidIndex", i, 0, 255);
    return this;
  }
  /** Completion-queue entries (default maxSendWr + maxRecvWr + 16); at least maxSendWr + maxRecvWr. */
  setCqSize(n: number): this {
    this.s.cqSize = checkInt("cqSize", n, 1, 1 << 22);
    return this;
  }
  /** Queue-pair capacities: `maxSendWr` (default 256), `maxRecvWr` (default recvDepth + 8), `maxInlineData` (default 64, capped at the device's). */
  setQpCaps(c: { maxSendWr?: number; maxRecvWr?: number; maxInlineData?: number }): this {
    if (c === null || typeof c !== "object") throw new RdmaError("INVALID_ARGUMENT", `setQpCaps takes { maxSendWr?, maxRecvWr?, maxInlineData? }, got ${c === null ? "null" : typeof c}`);
    if (c.maxSendWr !== undefined) this.s.maxSendWr = checkInt("maxSendWr", c.maxSendWr, 1, 2 ** 31);
    if (c.maxRecvWr !== undefined) this.s.maxRecvWr = checkInt("maxRecvWr", c.maxRecvWr, 1, 2 ** 31);
    if (c.maxInlineData !== undefined) this.s.maxInlineData = checkInt("maxInlineData", c.maxInlineData, 0, 1 << 16);
    return this;
  }
  /** Path MTU in bytes: 256, 512, 1024, 2048 or 4096. */
  setMtu(mtu: number): this {
    if (![256, 512, 1024, 2048, 4096].includes(mtu)) throw new RdmaError("INVALID_ARGUMENT", `mtu must be 256, 512, 1024, 2048 or 4096, got ${String(mtu)}`);
    this.s.mtu = mtu;
    return this;
  }
  /** Local ACK timeout exponent: 4.096 µs × 2^t. */
  setAckTimeout(t: number): this {
    this.s.ackTimeout = checkInt("ackTimeout", t, 0, 31);
    return this;
  }
  /** Transport retries before RETRY_EXCEEDED, 0–7 (default 7). */
  setRetryCount(n: number): this {
    this.s.retryCount = checkInt("retryCount", n, 0, 7);
    return this;
  }
  /** RNR retries, 7 = infinite. */
  setRnrRetry(n: number): this {
    this.s.rnrRetry = checkInt("rnrRetry", n, 0, 7);
    return this;
  }
  /** Receiver-not-ready back-off code, 0–31 (default 12). */
  setMinRnrTimer(code: number): this {
    this.s.minRnrTimer = checkInt("minRnrTimer", code, 0, 31);
    return this;
  }
  /** Outstanding RDMA READs/atomics per QP, both directions. */
  setMaxRdAtomic(n: number): this {
    this.s.maxRdAtomic = checkInt("maxRdAtomic", n, 1, 255);
    return this;
  }
  /** Which remote operations the peer may target at this connection (Access.REMOTE_*). */
  setAccess(flags: number): this {
    this.s.qpAccess = checkInt("access", flags, 0, 31);
    return this;
  }
  /**
   * "event": arm the CQ and wait for completion events (no CPU while idle).
   * "busy": poll every event-loop turn while the connection is open, never arming the CQ
   * (lowest latency; one core spins per process). "adaptive" (default): poll, unarmed,
   * for `spinUs` after any activity, then arm. Busy and adaptive sleep on events for a
   * while (20 ms, doubling up to 640 ms) when the spinning thread keeps waiting for a core:
   * more busy processes than cores. On tcp, whose completions come from this thread's own
   * socket events, the CQ stays armed in every mode and busy and adaptive spin by keeping the
   * event loop turning instead of polling; adaptive there spins only in a running exchange,
   * not after more than 4 × `spinUs` with nothing outstanding (everything sent acknowledged,
   * nothing queued, large sends read) until messages come in quick succession, a window is in
   * flight, or a send follows soon after the last acknowledgement (sparse traffic sleeps much
   * as with "event"). An unref'd connection never spins.
   */
  setPolling(mode: PollingMode, spinUs?: number): this {
    if (mode !== "event" && mode !== "busy" && mode !== "adaptive") throw new RdmaError("INVALID_ARGUMENT", `polling must be "event", "busy" or "adaptive", got ${String(mode)}`);
    this.s.polling = mode;
    if (spinUs !== undefined) this.s.spinUs = checkInt("spinUs", spinUs, 0, 1_000_000);
    return this;
  }
  /**
   * Messages up to this size are sent eagerly (one SEND into a receive
   * buffer the peer posted); larger ones by rendezvous (the peer READs
   * them). Default 4,160 bytes: 4 KiB of payload and 64 of framing, so 4 KiB
   * RPC calls stay eager (the RPC layer batches up to the peer's threshold).
   */
  setEagerThreshold(bytes: number): this {
    this.s.eagerMax = checkInt("eagerThreshold", bytes, 0, 1 << 20);
    return this;
  }
  /** The most receive buffers a connection posts (the peer's send credits): 8 at first, doubling up to this as the peer keeps more messages in flight. */
  setRecvDepth(n: number): this {
    this.s.recvDepth = checkInt("recvDepth", n, 8, 65536);
    return this;
  }
  /** Bytes of this side's memory the peer may hold through requestRemoteMr at once. */
  setRemoteMemoryQuota(bytes: number): this {
    this.s.quotaBytes = checkInt("remoteMemoryQuota", bytes, 0, Number.MAX_SAFE_INTEGER);
    return this;
  }
  /** Regions of this side's memory the peer may hold through requestRemoteMr at once (default 256). */
  setMaxRemoteRegions(n: number): this {
    this.s.maxRegions = checkInt("maxRemoteRegions", n, 0, 1 << 20);
    return this;
  }
  /**
   * How long after a lease ends the owner still keeps the region registered
   * (default 1000 ms): covers the delivery of the grant or lend and the flight
   * of an operation the borrower started just before its deadline.
   */
  setLeaseGrace(ms: number): this {
    this.s.leaseGraceMs = checkInt("leaseGrace", ms, 0, 2 ** 31);
    return this;
  }
  /**
   * While this side waits on the peer (operations posted, a keepalive PING
   * sent), the peer must make progress within this bound or the connection
   * fails with RETRY_EXCEEDED (default 15000 ms; 0: no bound). It must exceed
   * the longest event-loop stall the peer may have.
   */
  setPeerTimeout(ms: number): this {
    this.s.peerTimeoutMs = checkInt("peerTimeout", ms, 0, 2 ** 31);
    return this;
  }
  /** A rendezvous send the peer has not taken within this is cancelled (default 60000 ms; 0: never). */
  setRendezvousTimeout(ms: number): this {
    this.s.rendezvousTimeoutMs = checkInt("rendezvousTimeout", ms, 0, 2 ** 31);
    return this;
  }
  /** Lease of granted and lent memory when none is asked for. */
  setDefaultLease(ms: number): this {
    this.s.defaultLeaseMs = checkInt("defaultLease", ms, 1, 2 ** 31);
    return this;
  }
  /** Longest lease this side grants or renews (default 3 600 000 ms); asking for more fails with OUT_OF_RANGE naming it. */
  setMaxLease(ms: number): this {
    this.s.maxLeaseMs = checkInt("maxLease", ms, 1, 2 ** 31);
    return this;
  }
  /** Largest two-sided message accepted from the peer (a rendezvous allocates that much); default 64 MiB. */
  setMaxMessageSize(bytes: number): this {
    this.s.maxMessageSize = checkInt("maxMessageSize", bytes, 1, 2 ** 31);
    return this;
  }
  /**
   * Idle time after which the connection PINGs its peer's agent (default 2000 ms; 0: never);
   * a peer that does not answer within the peer timeout fails the connection.
   */
  setKeepalive(ms: number): this {
    this.s.keepaliveMs = checkInt("keepalive", ms, 0, 2 ** 31);
    return this;
  }
  /**
   * How connections are established: "tcp" (default: a TCP side channel
   * exchanges the QP endpoints, then closes) or "rdmacm" (librdmacm: the
   * address is the server's IP on its RDMA device; verbs provider only).
   */
  setConnectionManager(cm: ConnectionManager): this {
    if (cm !== "tcp" && cm !== "rdmacm") throw new RdmaError("INVALID_ARGUMENT", `connection manager must be "tcp" or "rdmacm", got ${String(cm)}`);
    this.s.cm = cm;
    return this;
  }
  /**
   * Connections a listener sets up at once (default 256): a client whose
   * valid hello arrives while that many hold resources (a QP and its receive
   * buffers, until the client confirms or the connect timeout ends them) is
   * refused with CONNECTION_REFUSED "the server is busy". Sockets that have
   * not sent their hello yet are bounded at 16× this.
   */
  setMaxHandshakes(n: number): this {
    this.s.maxHandshakes = checkInt("maxHandshakes", n, 1, 1 << 16);
    return this;
  }
  /**
   * Connections a listener holds at once (default 1024): the established
   * ones it accepted and not yet closed, and those being set up. A client
   * past it is refused before anything is allocated for it, with
   * CONNECTION_REFUSED "the server is full"; a slot frees when a connection
   * ends (closed by either side, or failed). Each idle connection costs
   * about 120 KiB and 2 descriptors with the default settings.
   */
  setMaxConnections(n: number): this {
    this.s.maxConnections = checkInt("maxConnections", n, 1, 1 << 20);
    return this;
  }
  /**
   * Authenticates peers with a shared secret (HMAC-SHA256 challenge–response,
   * both ways, before the server allocates anything; see docs/security.md).
   * `{ key, identity? }`: a client names itself (default `""`) and proves it
   * has the key; a server with one key accepts any client that has it.
   * `{ keys }` (servers): a key per identity, a record or a function
   * `(identity) => key | undefined`. Keys are strings or bytes, at least 16
   * bytes; identities at most 32 bytes of UTF-8. `null`: no authentication
   * (the default). A peer that fails gets AUTH_FAILED; `rdma.peer.identity`
   * names the identity of an authenticated connection.
   */
  setAuth(auth: AuthOptions | null): this {
    this.s.auth = auth === null ? null : Auth.from(auth);
    return this;
  }
  /** How long setting up a connection may take (default 10 000 ms): the client's whole connect, each of a server's handshakes. */
  setConnectTimeout(ms: number): this {
    this.s.connectTimeoutMs = checkInt("connectTimeout", ms, 1, 2 ** 31);
    return this;
  }

  /** @internal settings checked against the device's limits. */
  resolve(attr: DeviceAttr): ResolvedSettings {
    const s = { ...this.s };
    if (s.maxRecvWr === 0) s.maxRecvWr = s.recvDepth + 8;
    if (s.cqSize === 0) s.cqSize = s.maxSendWr + s.maxRecvWr + 16;
    limit("maxSendWr", s.maxSendWr, attr.maxQpWr, "max_qp_wr");
    limit("maxRecvWr", s.maxRecvWr, attr.maxQpWr, "max_qp_wr");
    if (s.maxRecvWr < s.recvDepth) throw new RdmaError("INVALID_ARGUMENT", `maxRecvWr = ${s.maxRecvWr} is below recvDepth = ${s.recvDepth}`);
    limit("cqSize", s.cqSize, attr.maxCqe, "max_cqe");
    if (s.cqSize < s.maxSendWr + s.maxRecvWr) throw new RdmaError("INVALID_ARGUMENT", `cqSize = ${s.cqSize} is below maxSendWr + maxRecvWr = ${s.maxSendWr + s.maxRecvWr}: the CQ could overrun`);
    s.maxInlineData = Math.min(s.maxInlineData, attr.maxInline);
    limit("maxRdAtomic", s.maxRdAtomic, attr.maxQpInitRdAtom, "max_qp_init_rd_atom");
    limit("port", s.port, attr.physPortCnt, "phys_port_cnt");
    if (s.eagerMax + 24 > attr.maxMrSize) limit("eagerThreshold", s.eagerMax, attr.maxMrSize - 24, "max_mr_size");
    if (s.maxLeaseMs < s.defaultLeaseMs) s.defaultLeaseMs = s.maxLeaseMs;
    return s;
  }

  private establisher(): Establisher {
    return this.s.cm === "rdmacm" ? rdmaCmEstablisher : sideChannel;
  }

  /** Connects to a server (listen or bind) at "host:port". */
  async connect(addr: string | { host: string; port: number }, opts?: { signal?: AbortSignal }): Promise<Rdma> {
    const a = parseAddr(addr);
    const signal = signalOf(opts, "connect");
    this.s.auth?.clientKey(); // a client authenticates with one key
    if (debug.enabled) debug("connect to %s:%d (%s provider, %s)", a.host, a.port, this.s.provider, this.s.cm);
    try {
      return await whenReady(await this.establisher().dial({ ...this.s }, (attr) => this.resolve(attr), a, signal));
    } catch (e) {
      if (debug.enabled) debug("connect to %s:%d failed: %s", a.host, a.port, e instanceof RdmaError ? `${e.code}: ${e.message}` : String(e));
      throw e;
    }
  }

  /** A listener that accepts any number of connections (`for await (const rdma of listener)`). */
  async bind(addr: string | { host: string; port: number }): Promise<RdmaListener> {
    const a = parseAddr(addr);
    const e = this.establisher();
    return RdmaListener.fromSource((sink) => e.bind({ ...this.s }, (attr) => this.resolve(attr), a, sink));
  }

  /** async-rdma's one-shot form: waits for one client, then stops listening. */
  async listen(addr: string | { host: string; port: number }, opts?: { signal?: AbortSignal }): Promise<Rdma> {
    const signal = signalOf(opts, "listen");
    const l = await this.bind(addr);
    try {
      return await l.accept(signal === undefined ? {} : { signal });
    } finally {
      await l.close();
    }
  }
}
