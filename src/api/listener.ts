/**
 * RdmaListener: accepts connections on a TCP side channel; every accepted
 * connection shares the listener's protection domain and memory pool.
 */
import net from "node:net";
import { RdmaError } from "../errors.js";
import { AsyncQueue } from "../agent/queue.js";
import type { Connection } from "../agent/connection.js";
import type { Context } from "./context.js";
import { LineReader, PROTOCOL_VERSION, fixupEndpoint, parseHello, sendLine } from "./handshake.js";
import { Rdma, connectAttr, makeConnection } from "./rdma.js";
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

  private async handshake(sock: net.Socket): Promise<void> {
    if (this.closed) return void sock.destroy();
    const holder: { rdma: Rdma | null } = { rdma: null };
    let conn: Connection | null = null;
    const timer = setTimeout(() => sock.destroy(new Error("timeout")), this.s.connectTimeoutMs);
    try {
      const reader = new LineReader(sock);
      let hello;
      try {
        hello = parseHello(await reader.nextJson(), this.ctx.provider.name);
      } catch (e) {
        if (e instanceof RdmaError && e.code !== "CONNECTION_CLOSED") sendLine(sock, { asyncRdma: PROTOCOL_VERSION, error: e.message });
        throw e;
      }
      this.ctx.retain();
      try {
        conn = makeConnection(this.ctx, this.s, { recvDepth: hello.recvDepth, eagerMax: hello.eagerMax, ...(hello.maxMessageSize === undefined ? {} : { maxMessageSize: hello.maxMessageSize }) }, holder);
      } catch (e) {
        this.ctx.release();
        throw e;
      }
      conn.qp.connect(fixupEndpoint(hello.endpoint, sock), connectAttr(this.s));
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
      sock.end();
      conn.start();
      const rdma = new Rdma(conn, this.ctx, this.s, null);
      holder.rdma = rdma;
      if (this.closed) await rdma.close();
      else this.accepted.push(rdma);
    } catch (e) {
      sock.destroy();
      if (conn) {
        try {
          conn.qp.destroy();
          conn.cq.destroy();
        } catch {
          /* best effort */
        }
        this.ctx.release();
      }
      if (this.rejected.length < 100) this.rejected.push(e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e)));
    } finally {
      clearTimeout(timer);
    }
  }

  /** The next connection. */
  accept(opts: { signal?: AbortSignal; timeoutMs?: number } = {}): Promise<Rdma> {
    if (this.closed) return Promise.reject(new RdmaError("CONNECTION_CLOSED", "the listener is closed"));
    return this.accepted.take(opts);
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
