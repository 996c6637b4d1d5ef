/**
 * The RPC client: calls matched to replies by id, many in flight. Each call
 * settles exactly once (reply, error, abort, timeout, or the connection's
 * end); an abort or timeout sends a CANCEL so the server's handler sees its
 * signal abort, and a reply that comes later is dropped. A call too large
 * for the server's maxMessageSize is refused before it is queued.
 */
import { RdmaError, type Rdma } from "../index.js";
import { peekBytes } from "../memory/mr.js";
import { codecOf, type RpcCodec } from "./codec.js";
import { decodeError, RpcError } from "./error.js";
import { CALL, CANCEL, decodeFrames, EMPTY, enc, ERROR, HDR, MAX_METHOD, OK, type Frame } from "./frame.js";
import { Outbox } from "./outbox.js";
import { abortableWait, type Settle } from "../transport/wait.js";
import type { CallOptions, RpcCallArgs, RpcCodecs, RpcMethodName, RpcMethods, RpcUntyped } from "./types.js";

/** Options of `new RpcClient(rdma, opts)`. */
export interface RpcClientOptions<M extends RpcMethods = RpcUntyped> {
  /** Deadline of calls that give none (ms). */
  timeoutMs?: number;
  /** How every method's payloads are encoded (default `rawCodec`: bytes in, bytes out). */
  codec?: RpcCodec<any>;
  /** Per method, where it differs from `codec`. */
  codecs?: RpcCodecs<M>;
}

const NO_OPTIONS: CallOptions = Object.freeze({});

/** A call waiting for its reply. */
interface Pending {
  resolve: (v: unknown) => void;
  reject: (e: unknown) => void;
  method: string;
  /** Decodes the reply; null: raw bytes. */
  codec: RpcCodec<any> | null;
}

/**
 * Calls methods of an RpcServer over one connection. `M`, a method map,
 * types the calls (names, payloads, replies); without it they take and
 * give bytes.
 *
 * @example
 * const client = new RpcClient(await new RdmaBuilder().connect("10.0.0.1:5555"));
 * const reply = await client.call("echo", new TextEncoder().encode("hi"), { timeoutMs: 1_000 });
 *
 * @example
 * type Api = { add: { request: { a: number; b: number }; response: number } };
 * const typed = new RpcClient<Api>(rdma, { codec: jsonCodec });
 * const three: number = await typed.call("add", { a: 1, b: 2 });
 */
export class RpcClient<M extends RpcMethods = RpcUntyped> {
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  private readonly codec: RpcCodec<any> | null;
  private readonly codecs: Map<string, RpcCodec<any> | null> | null;
  private failure: unknown = null;
  private readonly outbox: Outbox;
  private readonly loop: Promise<void>;
  /** The server's maxMessageSize: a larger call is refused before it is queued. */
  private readonly peerMax: number;

  /** A client on `rdma` (it consumes the connection's receive()); `defaults.timeoutMs` applies to calls that give none. */
  constructor(
    readonly rdma: Rdma,
    private readonly defaults: RpcClientOptions<NoInfer<M>> = {},
  ) {
    this.codec = codecOf(defaults.codec, "RpcClient: codec");
    const per = defaults.codecs;
    if (per !== undefined && (per === null || typeof per !== "object")) throw new RdmaError("INVALID_ARGUMENT", "RpcClient: codecs must be an object of codecs");
    this.codecs = null;
    if (per !== undefined) {
      this.codecs = new Map();
      for (const [k, c] of Object.entries(per as Record<string, RpcCodec<any> | undefined>)) if (c !== undefined) this.codecs.set(k, codecOf(c, `RpcClient: codecs.${k}`));
    }
    this.peerMax = rdma.peerLimits?.maxMessageSize ?? 2 ** 32 - 1;
    this.outbox = new Outbox(
      rdma,
      {
        // A message that could not be sent fails its own calls only (the connection lives on;
        // if it closed, the receive loop ends every call).
        failed: (e, ids) => {
          for (const id of ids) {
            const p = this.pending.get(id);
            if (!p) continue;
            this.pending.delete(id);
            p.reject(e);
          }
        },
        drained: () => {},
      },
      this.peerMax,
    );
    this.loop = this.receiveLoop();
  }

  private fail(e: unknown): void {
    if (this.failure) return;
    this.failure = e;
    this.outbox.close();
    for (const p of [...this.pending.values()]) p.reject(e);
    this.pending.clear();
  }

  private async receiveLoop(): Promise<void> {
    for (;;) {
      let msg;
      try {
        msg = await this.rdma.receive();
      } catch (e) {
        return this.fail(e instanceof RdmaError ? e : new RdmaError("CONNECTION_CLOSED", String(e)));
      }
      let frames: Frame[];
      try {
        frames = decodeFrames(peekBytes(msg));
        for (const f of frames) if (f.kind !== OK && f.kind !== ERROR) throw new RdmaError("PROTOCOL", `rpc: a server sent a frame of kind ${f.kind}`);
      } catch (e) {
        this.fail(this.rdma.isClosed && !(e instanceof RdmaError && e.code === "PROTOCOL") ? new RdmaError("CONNECTION_CLOSED", "the connection closed") : e);
        await this.rdma.close().catch(() => {});
        return;
      } finally {
        msg[Symbol.dispose]();
      }
      for (const f of frames) {
        const p = this.pending.get(f.id);
        if (!p) continue; // cancelled meanwhile
        this.pending.delete(f.id);
        if (f.kind === OK) {
          if (p.codec === null) p.resolve(f.payload);
          else {
            let v: unknown;
            try {
              v = p.codec.decode(f.payload);
            } catch (e) {
              p.reject(new RpcError("BAD_REPLY", `${p.method}: the reply could not be decoded: ${e instanceof Error ? e.message : String(e)}`, p.method));
              continue;
            }
            p.resolve(v);
          }
        } else p.reject(decodeError(f.payload, p.method));
      }
    }
  }

  /** Calls `method` with `payload` (encoded by the method's codec); resolves to the handler's reply (decoded by it). */
  call<K extends RpcMethodName<M>>(method: K, ...args: RpcCallArgs<M[K]["request"]>): Promise<M[K]["response"]>;
  call(method: string, value?: unknown, opts: CallOptions = NO_OPTIONS): Promise<unknown> {
    if (this.failure) return Promise.reject(this.failure);
    if (typeof method !== "string" || method.length === 0) return Promise.reject(new RdmaError("INVALID_ARGUMENT", "call: method must be a non-empty string"));
    let codec = this.codec;
    if (this.codecs !== null) {
      const own = this.codecs.get(method);
      if (own !== undefined) codec = own;
    }
    let payload: unknown = value;
    if (codec === null) {
      if (payload === undefined) payload = EMPTY;
    }
    else {
      try {
        payload = codec.encode(value);
      } catch (e) {
        return Promise.reject(new RdmaError("INVALID_ARGUMENT", `call: ${method}: the payload could not be encoded: ${e instanceof Error ? e.message : String(e)}`));
      }
    }
    if (!(payload instanceof Uint8Array)) return Promise.reject(new RdmaError("INVALID_ARGUMENT", codec === null ? "call: payload must be a Uint8Array" : `call: ${method}: the codec's encode() did not return a Uint8Array`));
    const m = this.methodBytes(method);
    if (m.length > MAX_METHOD) return Promise.reject(new RdmaError("INVALID_ARGUMENT", `call: method name longer than ${MAX_METHOD} bytes`));
    // Refused here, this call only: queued, it would fail the send of the message it shares.
    if (HDR + m.length + payload.length > this.peerMax) return Promise.reject(new RdmaError("OUT_OF_RANGE", `call: a ${payload.length}-byte payload exceeds the server's maxMessageSize (${this.peerMax} bytes per call, with ${HDR + m.length} bytes of header and method name)`));
    const { signal } = opts;
    if (signal !== undefined && !(signal instanceof AbortSignal)) return Promise.reject(new RdmaError("INVALID_ARGUMENT", "signal must be an AbortSignal"));
    if (signal?.aborted) return Promise.reject(new RdmaError("ABORTED", `${method} aborted`));
    const timeoutMs = opts.timeoutMs ?? this.defaults.timeoutMs;
    if (timeoutMs !== undefined && (!Number.isInteger(timeoutMs) || timeoutMs < 1)) return Promise.reject(new RdmaError("INVALID_ARGUMENT", "call: timeoutMs must be a positive integer"));
    const id = this.nextId;
    this.nextId = (this.nextId + 1) >>> 0 || 1;
    if (timeoutMs === undefined && signal === undefined) {
      // Nothing to watch: the promise's own ends are the pending call's.
      return new Promise<unknown>((resolve, reject) => {
        this.pending.set(id, { method, codec, resolve, reject });
        this.outbox.pushFrame(CALL, id, m, payload as Uint8Array);
      });
    }
    // A call ends once: its reply or error (the pending entry's ends), or an abort or timeout,
    // which also tells the server (CANCEL) while the call is still pending.
    const cancel = (w: Settle<unknown>, e: RdmaError): void => {
      if (!this.pending.delete(id)) return;
      this.outbox.pushFrame(CANCEL, id, null, EMPTY);
      w.reject(e);
    };
    return abortableWait<unknown>(
      (w) => {
        this.pending.set(id, { method, codec, resolve: w.resolve, reject: w.reject });
        this.outbox.pushFrame(CALL, id, m, payload as Uint8Array);
      },
      {
        signal,
        timeoutMs,
        onAbort: (w) => cancel(w, new RdmaError("ABORTED", `${method} aborted`)),
        onTimeout: (w) => cancel(w, new RdmaError("TIMEOUT", `${method} timed out after ${timeoutMs} ms`)),
      },
    );
  }

  private readonly methods = new Map<string, Uint8Array>();

  private methodBytes(method: string): Uint8Array {
    let m = this.methods.get(method);
    if (m === undefined) {
      m = enc.encode(method);
      if (this.methods.size < 256) this.methods.set(method, m);
    }
    return m;
  }

  /** Calls in flight. */
  get inFlight(): number {
    return this.pending.size;
  }

  /** Closes the connection; calls in flight reject with CONNECTION_CLOSED. */
  async close(): Promise<void> {
    await this.rdma.close();
    await this.loop;
  }
}
