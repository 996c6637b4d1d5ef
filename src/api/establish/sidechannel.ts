/**
 * The TCP side channel: how connections are established by default, on every
 * provider. One JSON line each way (hello, hello), then the client's "ready";
 * the socket then closes and the connection lives on its QP alone.
 *
 *   client: TCP connect → hello(endpoint, depths, limits) → hello ← → ready →
 *   server: hello → validate → allocate (fork of the listener's context, QP)
 *           → hello → ready ← → hand out
 *
 * Nothing is allocated on the server until the whole hello is valid (fields,
 * provider, and for tcp an endpoint on the side channel's own peer) and, with
 * authentication (setAuth), the client has proved it has the key; from then
 * on every failure goes through abandon(), and once started the connection's
 * own teardown frees it (startConnection). Per listener, bounded before
 * anything is allocated: connections held (`maxConnections`: established or
 * being set up), handshakes that hold resources (`maxHandshakes`: a valid
 * hello, no "ready" yet), and sockets still before their hello or proof; one
 * source address holds at most half of the handshakes and of the sockets,
 * so one host cannot keep everyone else out (as sshd's MaxStartups).
 *
 * The side channel ends with the handshake: once the server has read
 * "ready" it stops reading and destroys the socket; the client, once its
 * "ready" has left (at most FINAL_LINE_MS), does the same. Nothing a peer
 * sends after the handshake is read or kept.
 *
 * Authenticated (both sides set a key; auth.ts has the primitives):
 *
 *   client: hello + auth{identity, nonce Nc} →
 *   server:   ← challenge{nonce Ns, proof Ps}      Ps = MAC(K, "server proof", identity, Nc, Ns, client hello)
 *   client: checks Ps, then proof{Pc} →            Pc = MAC(K, "client proof", identity, Nc, Ns, client hello)
 *   server: checks Pc → allocate → hello + auth{mac} ←   mac = MAC(K, "server hello", …, server hello)
 *   client: checks mac → ready →
 */
import * as net from "node:net";
import { RdmaError } from "../../errors.js";
import type { DeviceAttr } from "../../transport/types.js";
import type { Connection } from "../../agent/connection.js";
import { Context } from "../context.js";
import { LineReader, helloBytes, parseHello, peerEndpoint, sendLine, type Hello } from "./sidechannel-wire.js";
import { PROTOCOL_VERSION, canonicalIp } from "./protocol.js";
import { AUTH_FAILED_WIRE, authMac, authRefusal, b64Field, checkIdentity, macEqual, nonce, wireMessage } from "./auth.js";
import { Rdma } from "../rdma.js";
import { abandon, connectAttr, makeConnection, startConnection } from "./setup.js";
import type { ResolvedSettings } from "../settings.js";
import type { Establisher, ListenerSink, ListenerSource } from "./establisher.js";

/** Sockets still before their hello, per listener, for each handshake slot (they cost a socket and ≤ 16 KiB each). */
const PRE_HELLO_PER_SLOT = 16;
/** How long the client's last line ("ready") may take to leave before its side-channel socket is destroyed anyway. */
const FINAL_LINE_MS = 1000;

/** What one source address may hold of a per-listener bound `n`: half of it (at least one). */
function fairShare(n: number): number {
  return Math.max(1, Math.ceil(n / 2));
}

/**
 * The client's end of the side channel once its last line is written:
 * nothing more is read, and the socket is destroyed once the line has left
 * (or after FINAL_LINE_MS, if the peer does not take it).
 */
function closeAfterLastLine(sock: net.Socket, reader: LineReader): void {
  reader.stop();
  const t = setTimeout(() => sock.destroy(), FINAL_LINE_MS);
  t.unref();
  sock.once("close", () => clearTimeout(t));
  sock.end(() => sock.destroy());
}

async function openContext(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings): Promise<{ ctx: Context; s: ResolvedSettings }> {
  const ctx = await Context.open(base.provider, base.device);
  try {
    return { ctx, s: resolve(ctx.device.attr) };
  } catch (e) {
    ctx.release();
    throw e;
  }
}

/** Bytes of each side's nonce. */
const NONCE_BYTES = 16;
/** Bytes of a proof or MAC (HMAC-SHA256, whole). */
const MAC_BYTES = 32;

function hello(ctx: Context, conn: Connection, s: ResolvedSettings): Record<string, unknown> {
  return {
    asyncRdma: PROTOCOL_VERSION,
    provider: ctx.provider.name,
    endpoint: conn.qp.localEndpoint({ portNum: s.port, gidIndex: s.gidIndex }),
    recvDepth: s.recvDepth,
    eagerMax: s.eagerMax,
    maxMessageSize: s.maxMessageSize,
    maxRdAtomic: s.maxRdAtomic,
  };
}

/** Client side of the handshake on a context (opened here unless `existing`, a retained one, is given). */
async function dial(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, signal: AbortSignal | undefined, existing?: Context): Promise<Rdma> {
  let ctx: Context | null = existing ?? null;
  let s = base;
  let sock: net.Socket | null = null;
  let conn: Connection | null = null;
  const holder: { rdma: Rdma | null } = { rdma: null };
  let timer: NodeJS.Timeout | null = null;
  const onAbort = (): void => {
    sock?.destroy(new Error("aborted"));
  };
  try {
    if (signal?.aborted) throw new RdmaError("ABORTED", "connect aborted");
    if (!ctx) ({ ctx, s } = await openContext(base, resolve));
    const c = ctx;
    if (signal?.aborted) throw new RdmaError("ABORTED", "connect aborted");
    signal?.addEventListener("abort", onAbort, { once: true });
    sock = net.connect({ host: addr.host, port: addr.port, noDelay: true });
    const s0 = sock;
    timer = setTimeout(() => s0.destroy(new Error("timeout")), s.connectTimeoutMs);
    await new Promise<void>((res, reject) => {
      s0.once("connect", res);
      s0.once("error", (e: NodeJS.ErrnoException) => {
        if (signal?.aborted) reject(new RdmaError("ABORTED", "connect aborted"));
        else if (e.message === "timeout") reject(new RdmaError("TIMEOUT", `connect to ${addr.host}:${addr.port} timed out after ${s.connectTimeoutMs} ms`));
        else if (e.code === "ECONNREFUSED") reject(new RdmaError("CONNECTION_REFUSED", `connection to ${addr.host}:${addr.port} refused: is the server listening?`, { errnoName: e.code, ...(e.syscall === undefined ? {} : { syscall: e.syscall }), cause: e }));
        else reject(new RdmaError("CONNECTION_REFUSED", `cannot reach ${addr.host}:${addr.port}: ${e.message}`, { errnoName: e.code ?? "EIO", ...(e.syscall === undefined ? {} : { syscall: e.syscall }), cause: e }));
      });
    });
    const reader = new LineReader(sock);
    const where = `${addr.host}:${addr.port}`;
    const peerAddr = { raw: sock.remoteAddress ?? addr.host, address: canonicalIp(sock.remoteAddress ?? addr.host), port: sock.remotePort ?? addr.port };
    conn = makeConnection(c, s, { recvDepth: 0, eagerMax: 0 }, holder);
    const mine = hello(c, conn, s);
    const cred = s.auth ? { key: s.auth.clientKey(), identity: s.auth.identity, nc: nonce(NONCE_BYTES), ns: Buffer.alloc(0) as Buffer, mine: helloBytes(parseHello(mine, c.provider.name)) } : null;
    if (cred) mine.auth = { identity: cred.identity, nonce: cred.nc.toString("base64") };
    sendLine(sock, mine);
    let msg = await reader.nextJson().catch(rethrowTimeout(s, addr));
    if (cred) {
      cred.ns = clientProve(sock, msg, cred, c.provider.name, where);
      msg = await reader.nextJson().catch(rethrowTimeout(s, addr));
    }
    const reply = parseHello(msg, c.provider.name);
    if (cred) {
      const a = msg.auth as { mac?: unknown } | undefined;
      let mac: Buffer | null = null;
      try {
        mac = b64Field(typeof a === "object" && a !== null ? a.mac : undefined, "auth.mac", MAC_BYTES);
      } catch {
        /* refused below */
      }
      if (!mac || !macEqual(mac, authMac(cred.key, "side-channel server hello", cred.identity, cred.nc, cred.ns, cred.mine, helloBytes(reply)))) {
        throw new RdmaError("AUTH_FAILED", `the hello of the server at ${where} failed its authentication (altered in transit?): refusing it`);
      }
    }
    const endpoint = peerEndpoint(reply.endpoint, sock);
    conn.setPeer({ recvDepth: reply.recvDepth, eagerMax: reply.eagerMax, ...(reply.maxMessageSize === undefined ? {} : { maxMessageSize: reply.maxMessageSize }) });
    conn.qp.connect(endpoint, connectAttr(s, reply.maxRdAtomic));
    sendLine(sock, { ready: true });
    closeAfterLastLine(sock, reader);
    sock = null;
    const settings = s;
    // Siblings (newConnection) dial the address this connection reached, not the name again:
    // a name may resolve to another server, which would not share this protection domain.
    const reached = { host: peerAddr.raw, port: peerAddr.port };
    const rdma = new Rdma(conn, c, s, { addr, redial: (again) => dial(settings, () => settings, reached, undefined, again) }, { address: peerAddr.address, port: peerAddr.port, identity: cred ? cred.identity : null });
    const started = conn;
    conn = null;
    ctx = null;
    startConnection(started, rdma, holder);
    return rdma;
  } catch (e) {
    sock?.destroy();
    abandon(conn, ctx);
    if (signal?.aborted && !(e instanceof RdmaError && e.code === "ABORTED")) throw new RdmaError("ABORTED", `connect to ${addr.host}:${addr.port} aborted`, { cause: e });
    throw e;
  } finally {
    if (timer) clearTimeout(timer);
    signal?.removeEventListener("abort", onAbort);
  }
}

/**
 * The client's side of the challenge: `msg` is the server's first answer.
 * Checks the server's proof (mutual authentication: a server without the
 * key, or that does not authenticate at all, is refused), then sends the
 * client's proof. Returns the server's nonce.
 */
function clientProve(sock: net.Socket, msg: Record<string, unknown>, cred: { key: Buffer; identity: string; nc: Buffer; mine: Buffer }, provider: Hello["provider"], where: string): Buffer {
  // another version, or a refusal (AUTH_FAILED when the server refused to authenticate): parseHello says which
  if (msg.asyncRdma !== PROTOCOL_VERSION || typeof msg.error === "string") parseHello(msg, provider);
  const ch = msg.challenge;
  if (ch === undefined) {
    throw new RdmaError("AUTH_FAILED", `the server at ${where} did not authenticate itself (it has no key set, or predates authentication): refusing it`);
  }
  if (typeof ch !== "object" || ch === null || Array.isArray(ch)) throw new RdmaError("PROTOCOL", "handshake field challenge is invalid");
  const c = ch as { nonce?: unknown; proof?: unknown };
  const ns = b64Field(c.nonce, "challenge.nonce", NONCE_BYTES);
  const ps = b64Field(c.proof, "challenge.proof", MAC_BYTES);
  if (!macEqual(ps, authMac(cred.key, "side-channel server proof", cred.identity, cred.nc, ns, cred.mine))) {
    sendLine(sock, { asyncRdma: PROTOCOL_VERSION, error: "the server's proof is wrong", code: "AUTH_FAILED" });
    throw new RdmaError("AUTH_FAILED", `the server at ${where} did not prove it has the key: the keys differ, or the server does not know identity ${JSON.stringify(cred.identity)}`);
  }
  sendLine(sock, { proof: authMac(cred.key, "side-channel client proof", cred.identity, cred.nc, ns, cred.mine).toString("base64") });
  return ns;
}

function rethrowTimeout(s: ResolvedSettings, addr: { host: string; port: number }) {
  return (e: unknown): never => {
    if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED" && (e.cause as Error | undefined)?.message === "timeout") {
      throw new RdmaError("TIMEOUT", `handshake with ${addr.host}:${addr.port} timed out after ${s.connectTimeoutMs} ms`);
    }
    throw e;
  };
}

/**
 * The server's side of the challenge, before anything is allocated: a
 * challenge (fresh nonce, this server's proof), then the client's proof,
 * checked in constant time. An unknown identity gets a challenge like any
 * other (its proof made with a key nobody has) and the same refusal as a
 * wrong key; the record (listener.rejected) says which.
 */
async function serverVerify(sock: net.Socket, reader: LineReader, v: Record<string, unknown>, h: Hello, s: ResolvedSettings, who: string): Promise<{ key: Buffer; identity: string; nc: Buffer; ns: Buffer; theirs: Buffer }> {
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
async function bind(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, sink: ListenerSink): Promise<ListenerSource> {
  const { ctx, s } = await openContext(base, resolve);
  const server = net.createServer({ noDelay: true });
  // Sockets still before their hello: bounded (the kernel closes the excess at once).
  const maxSockets = s.maxHandshakes * PRE_HELLO_PER_SLOT;
  server.maxConnections = maxSockets;
  let closed = false;
  /** Sockets accepted and not yet done with (any stage). */
  let inProgress = 0;
  /** Handshakes that hold resources: a valid hello, no "ready" yet. */
  let allocated = 0;
  /** Connections that hold a context fork: set up past the hello, or established and not yet released. */
  let live = 0;
  /** Per source address: its sockets in progress and the handshake slots it holds (each at most a fair share). */
  const sources = new Map<string, { sockets: number; slots: number }>();
  const socketShare = fairShare(maxSockets);
  const slotShare = fairShare(s.maxHandshakes);

  /** Side-channel sockets open (each closed when its handshake ends). */
  let sockets = 0;

  const handshake = async (sock: net.Socket): Promise<void> => {
    sockets++;
    sock.once("close", () => sockets--);
    if (closed) return void sock.destroy();
    const source = canonicalIp(sock.remoteAddress ?? "?");
    let src = sources.get(source);
    if (!src) sources.set(source, (src = { sockets: 0, slots: 0 }));
    if (src.sockets >= socketShare) return void sock.destroy();
    src.sockets++;
    inProgress++;
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
      let authed: { key: Buffer; identity: string; nc: Buffer; ns: Buffer; theirs: Buffer } | null = null;
      try {
        const v = await reader.nextJson();
        h = parseHello(v, ctx.provider.name);
        endpoint = peerEndpoint(h.endpoint, sock);
        if (s.auth) authed = await serverVerify(sock, reader, v, h, s, who);
        else if (v.auth !== undefined) {
          throw authRefusal(`client ${who} asked to authenticate, but this listener has no key (setAuth)`, "this server does not authenticate peers (it has no key): the client's key cannot be checked");
        }
        if (live >= s.maxConnections) {
          throw new RdmaError("CONNECTION_REFUSED", `the server is full: it holds ${live} connections (its limit); retry later`);
        }
        if (allocated >= s.maxHandshakes) {
          throw new RdmaError("CONNECTION_REFUSED", `the server is busy: ${allocated} connections are being set up (its limit); retry later`);
        }
        if (src.slots >= slotShare) {
          throw new RdmaError("CONNECTION_REFUSED", `the server is busy: ${src.slots} connections from ${source} are being set up (the most one address may have: half of ${s.maxHandshakes}); retry later`);
        }
      } catch (e) {
        if (e instanceof RdmaError && e.code !== "CONNECTION_CLOSED" && !sock.destroyed) {
          // an authentication refusal tells the client no more than AUTH_FAILED_WIRE (never whether the identity exists)
          sendLine(sock, { asyncRdma: PROTOCOL_VERSION, error: wireMessage(e), ...(e.code === "AUTH_FAILED" ? { code: "AUTH_FAILED" } : {}) });
        }
        throw e;
      }
      if (closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      allocated++;
      src.slots++;
      slot = true;
      // A protection domain and pool of its own: no other connection can reach what it grants or lends.
      // Its release (whichever way the connection ends) frees the connection's place under maxConnections.
      fork = ctx.fork(() => live--);
      live++;
      conn = makeConnection(fork, s, { recvDepth: h.recvDepth, eagerMax: h.eagerMax, ...(h.maxMessageSize === undefined ? {} : { maxMessageSize: h.maxMessageSize }) }, holder);
      conn.qp.connect(endpoint, connectAttr(s, h.maxRdAtomic));
      const mine = hello(fork, conn, s);
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
      inProgress--;
      src.sockets--;
      if (slot) {
        allocated--;
        src.slots--;
      }
      if (src.sockets === 0) sources.delete(source);
    }
  };

  server.on("connection", (sock) => void handshake(sock));
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
  return {
    address: () => {
      const a = server.address() as net.AddressInfo;
      return { host: a.address, port: a.port };
    },
    handshakes: () => inProgress,
    sockets: () => sockets,
    connections: () => live,
    context: () => (closed ? null : ctx),
    close: async () => {
      if (closed) return;
      closed = true;
      await new Promise<void>((r) => server.close(() => r()));
      ctx.release();
    },
  };
}

export const sideChannel: Establisher = { name: "tcp", dial, bind };
