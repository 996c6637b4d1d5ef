/**
 * The side channel's server: a TCP listener whose accepted sockets run the server's half of the
 * handshake (sidechannel.ts has the client's, sidechannel-wire.ts the lines both send). It owns
 * the listener's bounds and what counts against them:
 *
 * - nothing is allocated until the whole hello is valid (fields, provider, and for tcp an
 *   endpoint on the side channel's own peer) and, with authentication (setAuth), the client has
 *   proved it has the key (serverVerify); from then on every failure goes through abandon(), and
 *   once started the connection's own teardown frees it (startConnection);
 * - bounded before anything is allocated: connections held (`maxConnections`: established or
 *   being set up), handshakes that hold resources (`maxHandshakes`: a valid hello, no "ready"
 *   yet), and sockets still before their hello or proof; one source address holds at most half
 *   of the handshakes and of the sockets, so one host cannot keep everyone else out (as sshd's
 *   MaxStartups);
 * - the side channel ends with the handshake: once the server has read "ready" it stops reading
 *   and destroys the socket; nothing a peer sends after the handshake is read or kept.
 */
import * as net from "node:net";
import { RdmaError } from "../../errors.js";
import type { DeviceAttr } from "../../transport/types.js";
import type { Connection } from "../../agent/connection.js";
import type { Context } from "../context.js";
import { Rdma } from "../rdma.js";
import type { ResolvedSettings } from "../settings.js";
import { PROTOCOL_VERSION, canonicalIp } from "./protocol.js";
import { LineReader, MAC_BYTES, NONCE_BYTES, helloBytes, localHello, parseHello, peerEndpoint, sendLine, type Hello } from "./sidechannel-wire.js";
import { AUTH_FAILED_WIRE, authMac, authRefusal, b64Field, checkIdentity, macEqual, nonce, wireMessage } from "./auth.js";
import { abandon, connectAttr, makeConnection, openContext, startConnection } from "./setup.js";
import type { ListenerSink, ListenerSource } from "./establisher.js";

/** Sockets still before their hello, per listener, for each handshake slot (they cost a socket and ≤ 16 KiB each). */
const PRE_HELLO_PER_SLOT = 16;

/** What one source address may hold of a per-listener bound `n`: half of it (at least one). */
function fairShare(n: number): number {
  return Math.max(1, Math.ceil(n / 2));
}

/** What the server keeps of a client's proven authentication, for its hello's MAC. */
interface Authed {
  key: Buffer;
  identity: string;
  nc: Buffer;
  ns: Buffer;
  theirs: Buffer;
}

/**
 * The server's side of the challenge, before anything is allocated: a
 * challenge (fresh nonce, this server's proof), then the client's proof,
 * checked in constant time. An unknown identity gets a challenge like any
 * other (its proof made with a key nobody has) and the same refusal as a
 * wrong key; the record (listener.rejected) says which.
 */
async function serverVerify(sock: net.Socket, reader: LineReader, v: Record<string, unknown>, h: Hello, s: ResolvedSettings, who: string): Promise<Authed> {
  const a = v.auth;
  if (a === undefined) {
    throw authRefusal(`client ${who} did not authenticate: this listener requires it (setAuth)`, "this server requires authentication: set the key with setAuth({ key, identity })");
  }
  if (typeof a !== "object" || a === null || Array.isArray(a)) throw new RdmaError("PROTOCOL", "handshake field auth is invalid");
  const f = a as { identity?: unknown; nonce?: unknown };
  const identity = checkIdentity(f.identity, "PROTOCOL");
  const nc = b64Field(f.nonce, "auth.nonce", NONCE_BYTES);
  const rk = s.auth!.resolve(identity);
  const ns = nonce(NONCE_BYTES);
  const theirs = helloBytes(h);
  const label = `client ${who} (identity ${JSON.stringify(identity)})`;
  const why = rk.known ? "" : ` (${rk.why})`;
  sendLine(sock, { asyncRdma: PROTOCOL_VERSION, challenge: { nonce: ns.toString("base64"), proof: authMac(rk.key, "side-channel server proof", identity, nc, ns, theirs).toString("base64") } });
  let m: Record<string, unknown>;
  try {
    m = await reader.nextJson();
  } catch (e) {
    if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED") throw authRefusal(`${label} did not complete authentication (closed, or silent until the connect timeout)${why}`, AUTH_FAILED_WIRE);
    throw e;
  }
  if (typeof m.error === "string") throw authRefusal(`${label} refused this server's proof: it does not have this key${why}`, AUTH_FAILED_WIRE);
  const pc = b64Field(m.proof, "proof", MAC_BYTES);
  if (!macEqual(pc, authMac(rk.key, "side-channel client proof", identity, nc, ns, theirs)) || !rk.known) {
    throw authRefusal(`${label} failed authentication: ${rk.known ? "wrong proof" : rk.why}`, AUTH_FAILED_WIRE);
  }
  return { key: rk.key, identity, nc, ns, theirs };
}

/** Server side: a TCP listener whose accepted sockets run the handshake. */
export class SideChannelListener implements ListenerSource {
  private closed = false;
  /** Sockets accepted and not yet done with (any stage). */
  private inProgress = 0;
  /** Handshakes that hold resources: a valid hello, no "ready" yet. */
  private allocated = 0;
  /** Connections that hold a context fork: set up past the hello, or established and not yet released. */
  private live = 0;
  /** Side-channel sockets open (each closed when its handshake ends). */
  private open = 0;
  /** Per source address: its sockets in progress and the handshake slots it holds (each at most a fair share). */
  private readonly sources = new Map<string, { sockets: number; slots: number }>();
  private readonly socketShare: number;
  private readonly slotShare: number;

  private constructor(
    private readonly ctx: Context,
    private readonly s: ResolvedSettings,
    private readonly server: net.Server,
    private readonly sink: ListenerSink,
  ) {
    // Sockets still before their hello: bounded (the kernel closes the excess at once).
    const maxSockets = s.maxHandshakes * PRE_HELLO_PER_SLOT;
    server.maxConnections = maxSockets;
    this.socketShare = fairShare(maxSockets);
    this.slotShare = fairShare(s.maxHandshakes);
    server.on("connection", (sock) => void this.handshake(sock));
  }

  /** Opens the listener's context (its device, settings checked against it) and listens on `addr`. */
  static async bind(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, sink: ListenerSink): Promise<SideChannelListener> {
    const { ctx, s } = await openContext(base, resolve);
    const server = net.createServer({ noDelay: true });
    const listener = new SideChannelListener(ctx, s, server, sink);
    try {
      await new Promise<void>((res, reject) => {
        server.once("error", (e: NodeJS.ErrnoException) => {
          const opts = { errnoName: e.code ?? "EIO", ...(e.syscall === undefined ? {} : { syscall: e.syscall }), cause: e };
          if (e.code === "EADDRINUSE") reject(new RdmaError("ADDRESS_IN_USE", `cannot listen on ${addr.host}:${addr.port}: the address is in use (another server listens there): choose another port, or stop that server`, opts));
          else reject(new RdmaError("INVALID_ARGUMENT", `cannot listen on ${addr.host}:${addr.port}: ${e.message}`, opts));
        });
        server.listen(addr.port, addr.host, () => res());
      });
    } catch (e) {
      ctx.release();
      throw e;
    }
    return listener;
  }

  address(): { host: string; port: number } {
    const a = this.server.address() as net.AddressInfo;
    return { host: a.address, port: a.port };
  }

  handshakes(): number {
    return this.inProgress;
  }

  sockets(): number {
    return this.open;
  }

  connections(): number {
    return this.live;
  }

  context(): Context | null {
    return this.closed ? null : this.ctx;
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await new Promise<void>((r) => this.server.close(() => r()));
    this.ctx.release();
  }

  /** One accepted socket: the server's half of the handshake, then the connection handed to the sink (or its failure). */
  private async handshake(sock: net.Socket): Promise<void> {
    const { ctx, s, sink } = this;
    this.open++;
    sock.once("close", () => this.open--);
    if (this.closed) return void sock.destroy();
    const source = canonicalIp(sock.remoteAddress ?? "?");
    let src = this.sources.get(source);
    if (!src) this.sources.set(source, (src = { sockets: 0, slots: 0 }));
    if (src.sockets >= this.socketShare) return void sock.destroy();
    src.sockets++;
    this.inProgress++;
    const holder: { rdma: Rdma | null } = { rdma: null };
    let conn: Connection | null = null;
    let fork: Context | null = null;
    let slot = false;
    sock.on("error", () => {});
    const who = `${source}:${sock.remotePort ?? 0}`;
    const peerAddr = { address: source, port: sock.remotePort ?? 0 };
    const timer = setTimeout(() => sock.destroy(new Error("timeout")), s.connectTimeoutMs);
    try {
      const reader = new LineReader(sock);
      let h: Hello;
      let endpoint;
      let authed: Authed | null = null;
      try {
        const v = await reader.nextJson();
        h = parseHello(v, ctx.provider.name);
        endpoint = peerEndpoint(h.endpoint, sock);
        if (s.auth) authed = await serverVerify(sock, reader, v, h, s, who);
        else if (v.auth !== undefined) {
          throw authRefusal(`client ${who} asked to authenticate, but this listener has no key (setAuth)`, "this server does not authenticate peers (it has no key): the client's key cannot be checked");
        }
        if (this.live >= s.maxConnections) {
          throw new RdmaError("CONNECTION_REFUSED", `the server is full: it holds ${this.live} connections (its limit); retry later`);
        }
        if (this.allocated >= s.maxHandshakes) {
          throw new RdmaError("CONNECTION_REFUSED", `the server is busy: ${this.allocated} connections are being set up (its limit); retry later`);
        }
        if (src.slots >= this.slotShare) {
          throw new RdmaError("CONNECTION_REFUSED", `the server is busy: ${src.slots} connections from ${source} are being set up (the most one address may have: half of ${s.maxHandshakes}); retry later`);
        }
      } catch (e) {
        if (e instanceof RdmaError && e.code !== "CONNECTION_CLOSED" && !sock.destroyed) {
          // an authentication refusal tells the client no more than AUTH_FAILED_WIRE (never whether the identity exists)
          sendLine(sock, { asyncRdma: PROTOCOL_VERSION, error: wireMessage(e), ...(e.code === "AUTH_FAILED" ? { code: "AUTH_FAILED" } : {}) });
        }
        throw e;
      }
      if (this.closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      this.allocated++;
      src.slots++;
      slot = true;
      // A protection domain and pool of its own: no other connection can reach what it grants or lends.
      // Its release (whichever way the connection ends) frees the connection's place under maxConnections.
      fork = ctx.fork(() => this.live--);
      this.live++;
      conn = makeConnection(fork, s, { recvDepth: h.recvDepth, eagerMax: h.eagerMax, ...(h.maxMessageSize === undefined ? {} : { maxMessageSize: h.maxMessageSize }) }, holder);
      conn.qp.connect(endpoint, connectAttr(s, h.maxRdAtomic));
      const mine = localHello(fork, conn, s);
      if (authed) {
        const a = authed;
        mine.auth = { mac: authMac(a.key, "side-channel server hello", a.identity, a.nc, a.ns, a.theirs, helloBytes(parseHello(mine, fork.provider.name))).toString("base64") };
      }
      sendLine(sock, mine);
      const ready = await reader.nextJson();
      if (ready.ready !== true) throw new RdmaError("PROTOCOL", "the client did not confirm the connection");
      // The side channel is over: nothing more is read or kept from it (the client sends nothing after "ready").
      reader.stop();
      sock.destroy();
      if (conn.failure) throw conn.failure;
      // The Rdma, and so the peer's identity, exists before the connection processes any message.
      const rdma = new Rdma(conn, fork, s, null, { ...peerAddr, identity: authed ? authed.identity : null });
      const started = conn;
      conn = null;
      fork = null;
      startConnection(started, rdma, holder);
      // A connection that failed as it started (a malformed message sent before "ready") is never handed out.
      if (started.failure) throw started.failure;
      sink.push(rdma);
    } catch (e) {
      sock.destroy();
      abandon(conn, fork);
      sink.reject(e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e)));
    } finally {
      clearTimeout(timer);
      this.inProgress--;
      src.sockets--;
      if (slot) {
        this.allocated--;
        src.slots--;
      }
      if (src.sockets === 0) this.sources.delete(source);
    }
  }
}
