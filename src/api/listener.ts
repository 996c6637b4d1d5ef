/**
 * RdmaListener: accepts connections established by the TCP side channel
 * (sidechannel.ts) or RDMA CM (rdmacm.ts). Every accepted connection gets a
 * protection domain and memory pool of its own (a fork of the listener's
 * context), so no connection can reach memory granted or lent to another
 * (see context.ts).
 */
import { RdmaError, checkInt } from "../errors.js";
import { AsyncQueue } from "../agent/queue.js";
import { signalOf, type Rdma } from "./rdma.js";
import type { ListenerSink, ListenerSource } from "./establish.js";

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
  private source: ListenerSource | null = null;

  private constructor() {}

  /** @internal A listener whose connections come from `open`'s source. */
  static async fromSource(open: (sink: ListenerSink) => Promise<ListenerSource>): Promise<RdmaListener> {
    const l = new RdmaListener();
    l.source = await open({
      push: (rdma) => (l.closed ? void rdma.close() : l.accepted.push(rdma)),
      reject: (e) => {
        l.rejectedCount++;
        if (l.rejected.length >= 100) l.rejected.shift();
        l.rejected.push(e);
      },
    });
    return l;
  }

  /** The bound address (useful with port 0). */
  address(): { host: string; port: number } {
    return this.src().address();
  }

  get port(): number {
    return this.address().port;
  }

  /** @internal Handshakes under way and refused so far (tests and diagnostics). */
  stats(): { handshakes: number; rejected: number } {
    return { handshakes: this.src().handshakes(), rejected: this.rejectedCount };
  }

  private src(): ListenerSource {
    if (!this.source) throw new RdmaError("INVALID_STATE", "the listener is not open");
    return this.source;
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
    await this.source?.close();
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}
