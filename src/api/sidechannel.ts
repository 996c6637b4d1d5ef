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
 * provider, and for tcp an endpoint on the side channel's own peer); from
 * then on every failure goes through abandon(). Handshakes that hold
 * resources (a valid hello, no "ready" yet) are bounded per listener
 * (`maxHandshakes`), and so are the sockets still before their hello.
 */
import net from "node:net";
import { RdmaError } from "../errors.js";
import type { DeviceAttr } from "../transport/types.js";
import type { Connection } from "../agent/connection.js";
import { Context } from "./context.js";
import { LineReader, PROTOCOL_VERSION, parseHello, peerEndpoint, sendLine } from "./handshake.js";
import { Rdma } from "./rdma.js";
import { abandon, connectAttr, makeConnection } from "./setup.js";
import type { ResolvedSettings } from "./builder.js";
import type { Establisher, ListenerSink, ListenerSource } from "./establish.js";

/** Sockets still before their hello, per listener, for each handshake slot (they cost a socket and ≤ 16 KiB each). */
const PRE_HELLO_PER_SLOT = 16;

async function openContext(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings): Promise<{ ctx: Context; s: ResolvedSettings }> {
  const ctx = await Context.open(base.provider, base.device);
  try {
    return { ctx, s: resolve(ctx.device.attr) };
  } catch (e) {
    ctx.release();
    throw e;
  }
}

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
        else if (e.code === "ECONNREFUSED") reject(new RdmaError("CONNECTION_REFUSED", `connection to ${addr.host}:${addr.port} refused: is the server listening?`, { errno: e.code, cause: e }));
        else reject(new RdmaError("CONNECTION_REFUSED", `cannot reach ${addr.host}:${addr.port}: ${e.message}`, { errno: e.code ?? "EIO", cause: e }));
      });
    });
    const reader = new LineReader(sock);
    conn = makeConnection(c, s, { recvDepth: 0, eagerMax: 0 }, holder);
    sendLine(sock, hello(c, conn, s));
    const reply = parseHello(await reader.nextJson().catch(rethrowTimeout(s, addr)), c.provider.name);
    const endpoint = peerEndpoint(reply.endpoint, sock);
    conn.setPeer({ recvDepth: reply.recvDepth, eagerMax: reply.eagerMax, ...(reply.maxMessageSize === undefined ? {} : { maxMessageSize: reply.maxMessageSize }) });
    conn.qp.connect(endpoint, connectAttr(s, reply.maxRdAtomic));
    sendLine(sock, { ready: true });
    sock.end();
    conn.start();
    const settings = s;
    const rdma = new Rdma(conn, c, s, { addr, redial: (again) => dial(settings, () => settings, addr, undefined, again) });
    holder.rdma = rdma;
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

function rethrowTimeout(s: ResolvedSettings, addr: { host: string; port: number }) {
  return (e: unknown): never => {
    if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED" && (e.cause as Error | undefined)?.message === "timeout") {
      throw new RdmaError("TIMEOUT", `handshake with ${addr.host}:${addr.port} timed out after ${s.connectTimeoutMs} ms`);
    }
    throw e;
  };
}

/** Server side: a TCP listener whose accepted sockets run the handshake. */
async function bind(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, sink: ListenerSink): Promise<ListenerSource> {
  const { ctx, s } = await openContext(base, resolve);
  const server = net.createServer({ noDelay: true });
  // Sockets still before their hello: bounded (the kernel closes the excess at once).
  server.maxConnections = s.maxHandshakes * PRE_HELLO_PER_SLOT;
  let closed = false;
  /** Sockets accepted and not yet done with (any stage). */
  let inProgress = 0;
  /** Handshakes that hold resources: a valid hello, no "ready" yet. */
  let allocated = 0;

  const handshake = async (sock: net.Socket): Promise<void> => {
    if (closed) return void sock.destroy();
    inProgress++;
    const holder: { rdma: Rdma | null } = { rdma: null };
    let conn: Connection | null = null;
    let fork: Context | null = null;
    let slot = false;
    sock.on("error", () => {});
    const timer = setTimeout(() => sock.destroy(new Error("timeout")), s.connectTimeoutMs);
    try {
      const reader = new LineReader(sock);
      let h;
      let endpoint;
      try {
        h = parseHello(await reader.nextJson(), ctx.provider.name);
        endpoint = peerEndpoint(h.endpoint, sock);
        if (allocated >= s.maxHandshakes) {
          throw new RdmaError("CONNECTION_REFUSED", `the server is busy: ${allocated} connections are being set up (its limit); retry later`);
        }
      } catch (e) {
        if (e instanceof RdmaError && e.code !== "CONNECTION_CLOSED") sendLine(sock, { asyncRdma: PROTOCOL_VERSION, error: e.message });
        throw e;
      }
      if (closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      allocated++;
      slot = true;
      // A protection domain and pool of its own: no other connection can reach what it grants or lends.
      fork = ctx.fork();
      conn = makeConnection(fork, s, { recvDepth: h.recvDepth, eagerMax: h.eagerMax, ...(h.maxMessageSize === undefined ? {} : { maxMessageSize: h.maxMessageSize }) }, holder);
      conn.qp.connect(endpoint, connectAttr(s, h.maxRdAtomic));
      sendLine(sock, hello(fork, conn, s));
      const ready = await reader.nextJson();
      if (ready.ready !== true) throw new RdmaError("PROTOCOL", "the client did not confirm the connection");
      if (conn.failure) throw conn.failure;
      sock.end();
      conn.start();
      const rdma = new Rdma(conn, fork, s, null);
      holder.rdma = rdma;
      conn = null;
      fork = null;
      sink.push(rdma);
    } catch (e) {
      sock.destroy();
      abandon(conn, fork);
      sink.reject(e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e)));
    } finally {
      clearTimeout(timer);
      inProgress--;
      if (slot) allocated--;
    }
  };

  server.on("connection", (sock) => void handshake(sock));
  try {
    await new Promise<void>((res, reject) => {
      server.once("error", (e: NodeJS.ErrnoException) => reject(new RdmaError("INVALID_ARGUMENT", `cannot listen on ${addr.host}:${addr.port}: ${e.message}`, { errno: e.code ?? "EIO", cause: e })));
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
