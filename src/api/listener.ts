/**
 * RdmaListener: accepts connections on a TCP side channel. Every accepted
 * connection gets a protection domain and memory pool of its own (a fork of
 * the listener's context), so no connection can reach memory granted or lent
 * to another (see context.ts).
 */
import net from "node:net";
import { RdmaError, checkInt } from "../errors.js";
import { AsyncQueue } from "../agent/queue.js";
import type { Connection } from "../agent/connection.js";
import type { Context } from "./context.js";
import { LineReader, PROTOCOL_VERSION, parseHello, peerEndpoint, sendLine } from "./handshake.js";
import { Rdma, abandon, connectAttr, makeConnection, signalOf } from "./rdma.js";
import type { ResolvedSettings } from "./builder.js";

/** @internal Another way of establishing the listener's connections (RDMA CM: rdmacm.ts). */
export interface ListenerSource {
  address(): { host: string; port: number };
  close(): Promise<void>;
}
/** @internal What a ListenerSource hands its connections and failed handshakes to. */
export interface ListenerSink {
  push(rdma: Rdma): void;
  reject(e: RdmaError): void;
}

/**
 * @example
 * await using listener = await new RdmaBuilder().bind("0.0.0.0:5555");
 * for await (const rdma of listener) serve(rdma);
 */
export class RdmaListener implements AsyncIterable<Rdma> {
  private readonly accepted = new AsyncQueue<Rdma>("accept");
  private closed = false;
  /** Handshakes that failed (bad version, garbage): kept for diagnostics, never thrown at accept(). */
  readonly rejected: RdmaError[] = [];

  private source: ListenerSource | null = null;

  private constructor(
    private readonly server: net.Server,
    private readonly ctx: Context,
    private readonly s: ResolvedSettings,
  ) {}

  /** @internal A listener whose connections come from `open`'s source instead of the TCP side channel. */
  static async fromSource(s: ResolvedSettings, open: (sink: ListenerSink) => Promise<ListenerSource>): Promise<RdmaListener> {
    const l = new RdmaListener(null as unknown as net.Server, null as unknown as Context, s);
    l.source = await open({
      push: (rdma) => (l.closed ? void rdma.close() : l.accepted.push(rdma)),
      reject: (e) => void (l.rejected.length < 100 && l.rejected.push(e)),
    });
    return l;
  }

  static async open(ctx: Context, s: ResolvedSettings, addr: { host: string; port: number }): Promise<RdmaListener> {
    const server = net.createServer({ noDelay: true });
    const l = new RdmaListener(server, ctx, s);
    server.on("connection", (sock) => void l.handshake(sock));
    await new Promise<void>((resolve, reject) => {
      server.once("error", (e: NodeJS.ErrnoException) => reject(new RdmaError("INVALID_ARGUMENT", `cannot listen on ${addr.host}:${addr.port}: ${e.message}`, { errno: e.code ?? "EIO", cause: e })));
      server.listen(addr.port, addr.host, () => resolve());
    });
    return l;
  }

  /** The bound address (useful with port 0). */
  address(): { host: string; port: number } {
    if (this.source) return this.source.address();
    const a = this.server.address() as net.AddressInfo;
    return { host: a.address, port: a.port };
  }

  get port(): number {
    return this.address().port;
  }

  /** Handshakes under way (sockets accepted, connection not yet handed out). */
  private inProgress = 0;

  /** @internal Handshakes under way and refused so far (tests and diagnostics). */
  stats(): { handshakes: number; rejected: number } {
    return { handshakes: this.inProgress, rejected: this.rejectedCount };
  }
  private rejectedCount = 0;

  /**
   * Server side of the side channel. Nothing is allocated until the whole
   * hello is valid (fields, provider, and for tcp an endpoint on the side
   * channel's peer); from then on every failure — a bad or missing "ready",
   * the connect timeout, a closed socket — goes through abandon(), which frees
   * the QP, the CQ, the posted receive buffers and the connection's PD.
   */
  private async handshake(sock: net.Socket): Promise<void> {
    if (this.closed) return void sock.destroy();
    this.inProgress++;
    const holder: { rdma: Rdma | null } = { rdma: null };
    let conn: Connection | null = null;
    let ctx: Context | null = null;
    sock.on("error", () => {});
    const timer = setTimeout(() => sock.destroy(new Error("timeout")), this.s.connectTimeoutMs);
    try {
      const reader = new LineReader(sock);
      let hello;
      let endpoint;
      try {
        hello = parseHello(await reader.nextJson(), this.ctx.provider.name);
        endpoint = peerEndpoint(hello.endpoint, sock);
      } catch (e) {
        if (e instanceof RdmaError && e.code !== "CONNECTION_CLOSED") sendLine(sock, { asyncRdma: PROTOCOL_VERSION, error: e.message });
        throw e;
      }
      if (this.closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      ctx = this.ctx.fork();
      conn = makeConnection(ctx, this.s, { recvDepth: hello.recvDepth, eagerMax: hello.eagerMax, ...(hello.maxMessageSize === undefined ? {} : { maxMessageSize: hello.maxMessageSize }) }, holder);
      conn.qp.connect(endpoint, connectAttr(this.s));
      sendLine(sock, {
        asyncRdma: PROTOCOL_VERSION,
        provider: this.ctx.provider.name,
        endpoint: conn.qp.localEndpoint({ portNum: this.s.port, gidIndex: this.s.gidIndex }),
        recvDepth: this.s.recvDepth,
        eagerMax: this.s.eagerMax,
        maxMessageSize: this.s.maxMessageSize,
      });
      const ready = await reader.nextJson();
      if (ready.ready !== true) throw new RdmaError("PROTOCOL", "the client did not confirm the connection");
      if (conn.failure) throw conn.failure;
      sock.end();
      conn.start();
      const rdma = new Rdma(conn, ctx, this.s, null);
      holder.rdma = rdma;
      conn = null;
      ctx = null;
      if (this.closed) await rdma.close();
      else this.accepted.push(rdma);
    } catch (e) {
      sock.destroy();
      abandon(conn, ctx);
      this.rejectedCount++;
      if (this.rejected.length < 100) this.rejected.push(e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e)));
    } finally {
      clearTimeout(timer);
      this.inProgress--;
    }
  }

  /** The next connection. */
  accept(opts?: { signal?: AbortSignal; timeoutMs?: number }): Promise<Rdma> {
    let o: { signal?: AbortSignal; timeoutMs?: number };
    try {
      const signal = signalOf(opts, "accept");
      const t = opts?.timeoutMs;
      o = { ...(signal === undefined ? {} : { signal }), ...(t === undefined ? {} : { timeoutMs: checkInt("timeoutMs", t, 1, 2 ** 31) }) };
    } catch (e) {
      return Promise.reject(e);
    }
    if (this.closed) return Promise.reject(new RdmaError("CONNECTION_CLOSED", "the listener is closed"));
    return this.accepted.take(o);
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Rdma> {
    for (;;) {
      try {
        yield await this.accept();
      } catch (e) {
        if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED" && this.closed) return;
        throw e;
      }
    }
  }

  /** Stops listening; connections already accepted stay open. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.accepted.fail(new RdmaError("CONNECTION_CLOSED", "the listener is closed"));
    if (this.source) return this.source.close();
    await new Promise<void>((r) => this.server.close(() => r()));
    this.ctx.release();
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}
