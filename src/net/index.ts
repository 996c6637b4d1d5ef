/**
 * async-rdma/net: `node:net`'s server and client over RDMA connections.
 *
 * @example
 * import { createServer, connect } from "async-rdma/net";
 * const server = createServer((socket) => socket.pipe(socket)).listen(5555);
 * const socket = connect(5555, "127.0.0.1", { provider: "tcp" });
 */
import { EventEmitter } from "node:events";
import { isIP } from "node:net";
import { RdmaError } from "../errors.js";
import { RdmaBuilder } from "../api/builder.js";
import type { RdmaListener } from "../api/listener.js";
import type { Rdma } from "../api/rdma.js";
import { RdmaStream as Stream, type OnRead, type StreamOptions } from "../api/stream.js";
import type { AuthOptions } from "../api/auth.js";
import type { ProviderChoice } from "../transport/providers.js";
import type { PollingMode } from "../agent/poller.js";

/** A stream over an RDMA connection: what `connect` returns and a server hands out. */
export type RdmaStream = Stream<Rdma>;
/** The stream class (a `stream.Duplex`): what `connect` returns and a server hands out. */
export const RdmaStream = Stream;
/** The `onread` option of `connect()` (as `net.connect`'s). */
export type { OnRead };

/**
 * The connection's settings. `builder` gives them all (any RdmaBuilder you set up);
 * the other fields are shorthands applied on top of it.
 */
export interface RdmaNetOptions extends Omit<StreamOptions, "onread"> {
  /** A builder carrying every setting; default: `new RdmaBuilder()`. */
  builder?: RdmaBuilder;
  /** "verbs", "tcp" or "auto" (default: the builder's, i.e. ASYNC_RDMA_PROVIDER or "auto"). */
  provider?: ProviderChoice;
  /** The RDMA device (e.g. "rxe0"). */
  device?: string;
  /** Peer authentication (RdmaBuilder.setAuth). */
  auth?: AuthOptions | null;
  /** Completion polling (RdmaBuilder.setPolling). */
  polling?: PollingMode;
  /** Receive depth: messages the peer may send ahead (RdmaBuilder.setRecvDepth). */
  recvDepth?: number;
  /** Send queue depth (RdmaBuilder.setQpCaps({ maxSendWr })). */
  maxSendWr?: number;
  /** How long connecting may take, ms (RdmaBuilder.setConnectTimeout). */
  connectTimeout?: number;
}

/** Options of a socket that connect() dials: the connection's, and `onread` (as `net.connect`'s). */
export interface DialOptions extends RdmaNetOptions {
  /**
   * Incoming bytes are copied into one buffer of yours (or one `buffer()`
   * returns, asked before each delivery) and handed to `callback(nread,
   * buffer)` instead of 'data' events; returning false pauses the socket
   * (`resume()` or `read()` goes on, and 'end' waits for it). No buffer is
   * allocated per chunk. A server's sockets do not take it (as
   * `net.Server`'s).
   */
  onread?: OnRead | null;
}

/** Options of connect()/createConnection() given as one object. */
export interface ConnectOptions extends DialOptions {
  port: number;
  host?: string;
}

function builderOf(o: RdmaNetOptions): RdmaBuilder {
  const b = o.builder ?? new RdmaBuilder();
  if (o.provider !== undefined) b.setProvider(o.provider);
  if (o.device !== undefined) b.setDevice(o.device);
  if (o.auth !== undefined) b.setAuth(o.auth);
  if (o.polling !== undefined) b.setPolling(o.polling);
  if (o.recvDepth !== undefined) b.setRecvDepth(o.recvDepth);
  if (o.maxSendWr !== undefined) b.setQpCaps({ maxSendWr: o.maxSendWr });
  if (o.connectTimeout !== undefined) b.setConnectTimeout(o.connectTimeout);
  return b;
}

function streamOpts(o: RdmaNetOptions): StreamOptions {
  return { ...(o.allowHalfOpen === undefined ? {} : { allowHalfOpen: o.allowHalfOpen }) };
}

/** A dialed socket's: `onread` too (as `net.connect`; a server's sockets do not take it, as net.Server's). */
function connectStreamOpts(o: DialOptions): StreamOptions {
  return { ...streamOpts(o), ...(o.onread === undefined ? {} : { onread: o.onread }) };
}

function hostPort(host: string, port: number): string {
  return isIP(host) === 6 ? `[${host}]:${port}` : `${host}:${port}`;
}

/**
 * A client socket: an {@link RdmaStream} that connects itself. Writes made
 * before 'connect' are held and sent once it is connected.
 */
export class Socket extends Stream<Rdma> {
  /** @internal */
  constructor(opts: StreamOptions) {
    super(null, opts);
  }

  /** @internal */
  start(b: RdmaBuilder, host: string, port: number): this {
    b.connect(hostPort(host, port)).then(
      (rdma: Rdma) => {
        if (this.destroyed) return void rdma.close().catch(() => {});
        try {
          this.attach(rdma);
        } catch (e) {
          void rdma.close().catch(() => {});
          return void this.destroy(e as Error);
        }
        this.emit("connect");
        this.emit("ready");
      },
      (e: unknown) => this.destroy(e instanceof Error ? e : new Error(String(e))),
    );
    return this;
  }
}

type ConnectArgs = [port: number, host?: string, options?: DialOptions, listener?: () => void] | [options: ConnectOptions, listener?: () => void];

/**
 * Connects to an `async-rdma/net` server (as `net.connect`): returns the
 * socket at once; 'connect' when connected, 'error' if it cannot be.
 * `connect(port[, host][, options][, listener])` or `connect(options[, listener])`; host defaults to "localhost".
 */
export function connect(...args: ConnectArgs): Socket {
  let port: number;
  let host = "localhost";
  let opts: DialOptions = {};
  let listener: (() => void) | undefined;
  if (typeof args[0] === "object" && args[0] !== null) {
    const o = args[0];
    port = o.port;
    host = o.host ?? host;
    opts = o;
    listener = typeof args[1] === "function" ? args[1] : undefined;
  } else {
    port = args[0];
    for (const a of args.slice(1)) {
      if (typeof a === "string") host = a;
      else if (typeof a === "function") listener = a as () => void;
      else if (a && typeof a === "object") opts = a as DialOptions;
    }
  }
  if (!Number.isInteger(port) || port < 0 || port > 65535) throw new RdmaError("INVALID_ARGUMENT", `connect: port must be an integer in 0..65535, got ${String(port)}`);
  const b = builderOf(opts);
  const s = new Socket(connectStreamOpts(opts));
  if (listener) s.once("connect", listener);
  return s.start(b, host, port);
}

/** Same as {@link connect}. */
export const createConnection = connect;

/**
 * A server (as `net.Server`): 'listening', 'connection' (an {@link RdmaStream}),
 * 'error', and 'close' once it stopped listening and its connections ended.
 */
export class Server extends EventEmitter {
  private listener: RdmaListener | null = null;
  private readonly opts: RdmaNetOptions;
  private readonly sockets = new Set<RdmaStream>();
  private closing = false;
  private opening = false;
  /** Accepted for `net.Server` compatibility (not enforced: see the builder's setMaxConnections). */
  maxConnections: number | undefined = undefined;

  /** A server with `opts` (see RdmaNetOptions); `connectionListener` is added for 'connection'. */
  constructor(opts: RdmaNetOptions = {}, connectionListener?: (socket: RdmaStream) => void) {
    super();
    this.opts = opts;
    if (connectionListener) this.on("connection", connectionListener);
  }

  /** Whether the server is listening. */
  get listening(): boolean {
    return this.listener !== null && !this.closing;
  }

  /** `listen(port[, host][, backlog][, cb])` or `listen({ port, host }[, cb])`; host defaults to "0.0.0.0". */
  listen(...args: unknown[]): this {
    let port = 0;
    let host = "0.0.0.0";
    let cb: (() => void) | undefined;
    for (const [i, a] of args.entries()) {
      if (typeof a === "function") cb = a as () => void;
      else if (typeof a === "number" && i === 0) port = a;
      else if (typeof a === "string" && i === 0 && /^\d+$/.test(a)) port = Number(a);
      else if (typeof a === "string") host = a;
      else if (a && typeof a === "object") {
        const o = a as { port?: number; host?: string };
        port = o.port ?? 0;
        host = o.host ?? host;
      }
    }
    if (this.listener || this.opening) throw new RdmaError("INVALID_STATE", "listen: the server is already listening");
    if (cb) this.once("listening", cb);
    this.opening = true;
    this.closing = false;
    builderOf(this.opts)
      .bind(hostPort(host, port))
      .then(
        (l) => {
          this.opening = false;
          if (this.closing) return void l.close().then(() => this.maybeClosed());
          this.listener = l;
          this.emit("listening");
          void this.acceptLoop(l);
        },
        (e: unknown) => {
          this.opening = false;
          this.emit("error", e instanceof Error ? e : new Error(String(e)));
        },
      );
    return this;
  }

  private async acceptLoop(l: RdmaListener): Promise<void> {
    for (;;) {
      let rdma: Rdma;
      try {
        rdma = await l.accept();
      } catch (e) {
        if (!this.closing) this.emit("error", e instanceof Error ? e : new Error(String(e)));
        return;
      }
      let s: RdmaStream;
      try {
        s = new Stream<Rdma>(rdma, streamOpts(this.opts));
      } catch {
        void rdma.close().catch(() => {});
        continue;
      }
      this.sockets.add(s);
      s.once("close", () => {
        this.sockets.delete(s);
        this.maybeClosed();
      });
      this.emit("connection", s);
    }
  }

  /** The bound address: `{ address, family, port }` (null before 'listening'). */
  address(): { address: string; family: string; port: number } | null {
    if (!this.listener) return null;
    const a = this.listener.address();
    return { address: a.host, family: isIP(a.host) === 6 ? "IPv6" : "IPv4", port: a.port };
  }

  /**
   * Stops accepting connections; 'close' (and `cb`) once every connection
   * the server handed out has closed, as `net.Server`.
   */
  close(cb?: (err?: Error) => void): this {
    if (cb) this.once("close", cb);
    if (this.closing) return this;
    this.closing = true;
    const l = this.listener;
    this.listener = null;
    if (l) void l.close().then(() => this.maybeClosed());
    else if (!this.opening) queueMicrotask(() => this.maybeClosed());
    return this;
  }

  private closedEmitted = false;
  private maybeClosed(): void {
    if (!this.closing || this.opening || this.closedEmitted || this.sockets.size > 0) return;
    this.closedEmitted = true;
    this.emit("close");
  }

  /** Calls back with the number of open connections (as `net.Server`). */
  getConnections(cb: (err: Error | null, count: number) => void): this {
    const n = this.sockets.size;
    queueMicrotask(() => cb(null, n));
    return this;
  }

  /** Accepted for `net.Server` compatibility; the listener keeps the process alive while it listens. */
  ref(): this {
    return this;
  }

  /** See {@link Server.ref}. */
  unref(): this {
    return this;
  }

  /** `await using server = ...`: closes the server. */
  async [Symbol.asyncDispose](): Promise<void> {
    await new Promise<void>((r) => this.close(() => r()));
  }
}

/** `createServer([options][, connectionListener])`, as `net.createServer`. */
export function createServer(options?: RdmaNetOptions | ((socket: RdmaStream) => void), connectionListener?: (socket: RdmaStream) => void): Server {
  if (typeof options === "function") return new Server({}, options);
  return new Server(options ?? {}, connectionListener);
}
