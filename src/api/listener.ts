/**
 * RdmaListener: accepts connections established by the TCP side channel
 * (sidechannel.ts) or RDMA CM (rdmacm.ts). Every accepted connection gets a
 * protection domain and memory pool of its own (a fork of the listener's
 * context), so no connection can reach memory granted or lent to another
 * (see context.ts).
 */
import { RdmaError, checkInt } from "../errors.js";
import { AsyncQueue } from "../agent/queue.js";
import { whenReady, type Rdma } from "./rdma.js";
import { signalOf } from "./operands.js";
import type { ListenerSink, ListenerSource } from "./establish/establisher.js";
import type { Context } from "./context.js";
import { LocalMemory, LocalMr } from "../memory/mr.js";
import { SharedMr, shareIn, type ShareOptions } from "./shared.js";

/** A listener's counters (RdmaListener.stats()). */
export interface ListenerStats {
  /** Handshakes under way (accepted sockets not yet handed out as connections). */
  handshakes: number;
  /** Handshakes refused so far (bad version, failed authentication, garbage). */
  rejected: number;
  /** Side-channel sockets open (0 over RDMA CM). */
  sockets: number;
  /** Connections held against setMaxConnections: being set up, or established and not yet closed. */
  connections: number;
  /** Connections ready so far (handed to accept() or waiting for it). */
  accepted: number;
  /** Connections ready and not yet taken by accept(). */
  waiting: number;
}

/**
 * @example
 * await using listener = await new RdmaBuilder().bind("0.0.0.0:5555");
 * for await (const rdma of listener) serve(rdma);
 */
export class RdmaListener implements AsyncIterable<Rdma> {
  private readonly accepted = new AsyncQueue<Rdma>("accept");
  private closed = false;
  /** Handshakes that failed (bad version, garbage): the last 100, kept for diagnostics, never thrown at accept(). */
  readonly rejected: RdmaError[] = [];
  private rejectedCount = 0;
  private acceptedCount = 0;
  private source: ListenerSource | null = null;

  private constructor() {}

  /** @internal A listener whose connections come from `open`'s source. */
  static async fromSource(open: (sink: ListenerSink) => Promise<ListenerSource>): Promise<RdmaListener> {
    const l = new RdmaListener();
    l.source = await open({
      push: (rdma) => {
        if (l.closed) return void rdma.close();
        whenReady(rdma).then(
          (r) => (l.closed ? void r.close() : (l.acceptedCount++, l.accepted.push(r))),
          (e: unknown) => l.refuse(e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e))),
        );
      },
      reject: (e) => l.refuse(e),
    });
    return l;
  }

  private refuse(e: RdmaError): void {
    this.rejectedCount++;
    if (this.rejected.length >= 100) this.rejected.shift();
    this.rejected.push(e);
  }

  /** The bound address (useful with port 0). */
  address(): { host: string; port: number } {
    return this.src().address();
  }

  /** The bound port (useful with port 0). */
  get port(): number {
    return this.address().port;
  }

  /**
   * The listener's counters: handshakes under way, handshakes refused so far
   * (see `rejected` for the last ones), side-channel sockets open,
   * connections held (counted against setMaxConnections), connections handed
   * out so far and those waiting for accept().
   */
  stats(): ListenerStats {
    const src = this.src();
    return { handshakes: src.handshakes(), rejected: this.rejectedCount, sockets: src.sockets(), connections: src.connections(), accepted: this.acceptedCount, waiting: this.accepted.length };
  }

  private src(): ListenerSource {
    if (!this.source) throw new RdmaError("INVALID_STATE", "the listener is not open");
    return this.source;
  }

  private ctx(what: string): Context {
    if (this.closed) throw new RdmaError("INVALID_STATE", `${what}: the listener is closed`);
    const c = this.src().context();
    if (!c) throw new RdmaError("INVALID_STATE", `${what}: this RDMA CM listener is bound to no RDMA device yet: bind it to a device's address (or set the device)`);
    return c;
  }

  /**
   * Registered, zeroed memory owned by the listener: the source of regions
   * shared with all its connections (share()). It lives until disposed or
   * until the listener and every connection it accepted are closed. (It is
   * registered in the listener's own protection domain: use it locally and
   * through shares; a connection sends from its own memory.)
   */
  allocLocalMr(size: number): LocalMr {
    const c = this.ctx("allocLocalMr");
    checkInt("size", size, 1, c.device.attr.maxMrSize);
    return new LocalMr(new LocalMemory(c.pool, c.pool.alloc(size)), 0, size);
  }

  /**
   * Shares `lmr` (from this listener's allocLocalMr) by name with every
   * connection the listener accepts, present and future: each peer opens it
   * with openSharedMr(name). The listener keeps full access. Closing the
   * listener revokes its shares.
   */
  share(name: string, lmr: LocalMr, opts?: ShareOptions): SharedMr {
    const c = this.ctx("share");
    if (!(lmr instanceof LocalMr)) throw new RdmaError("INVALID_ARGUMENT", "share: lmr must be a LocalMr from this listener's allocLocalMr");
    lmr.mem.check("share");
    if (lmr.mem.alloc.mr.pd !== c.pd) throw new RdmaError("INVALID_ARGUMENT", "share: a listener shares memory from its own allocLocalMr (a connection shares its own memory with rdma.share)");
    return shareIn(c.shares, name, lmr, opts);
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

  /** `for await (const rdma of listener)`: every accepted connection, until the listener closes. */
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
    this.source?.context()?.shares.close();
    await this.source?.close();
  }

  /** `await using listener = ...`: closes the listener at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}
