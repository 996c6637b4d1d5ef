/**
 * The RPC server: a handler per method, answering the calls of each
 * connection it serves. What one connection holds is bounded: a call counts
 * against `maxInFlight` from its start until its reply has been sent, and
 * unsent replies against `maxQueuedBytes`; past either the server reads no
 * more of the connection (the client waits for credits), and replies left
 * untaken past `replyTimeoutMs` close it. A cancelled call gets no reply.
 */
import { RdmaError, type Rdma, type RdmaListener } from "../index.js";
import { peekBytes } from "../memory/mr.js";
import { codecOf, type RpcCodec } from "./codec.js";
import { errorFrame } from "./error.js";
import { CALL, CANCEL, decodeFrames, EMPTY, enc, HDR, MAX_METHOD, OK, type Frame } from "./frame.js";
import { Outbox, type OutboxHost } from "./outbox.js";
import type { RpcCodecs, RpcContext, RpcHandler, RpcHandlers, RpcMethods, RpcUntyped } from "./types.js";

/** Default of `RpcServerOptions.maxInFlight`. */
const DEFAULT_MAX_IN_FLIGHT = 128;
/** Default of `RpcServerOptions.maxQueuedBytes`: 16 MiB. */
const DEFAULT_MAX_QUEUED_BYTES = 16 << 20;
/** Default of `RpcServerOptions.replyTimeoutMs`: as long as a connection's rendezvous deadline. */
const DEFAULT_REPLY_TIMEOUT_MS = 60_000;
/**
 * While a server waits for room (calls running, replies unsent) it reads
 * nothing, so nothing tells it the connection ended: it looks this often.
 * (Replies waiting to be sent settle at once when the connection ends; only
 * handlers that never return need this.)
 */
const CLOSED_POLL_MS = 1000;

/** A reply: an OK frame's parts (its payload is copied once, into the message), or a frame encoded already (an error). */
type Reply = { id: number; payload: Uint8Array } | Uint8Array;

/** The reply to call `id`; a reply the caller would refuse (over its maxMessageSize) fails that call only, OUT_OF_RANGE. */
function okFrame(id: number, v: unknown, peerMax: number): Reply {
  const p = v instanceof Uint8Array ? v : EMPTY;
  // checked before the copy
  if (HDR + p.length > peerMax) return errorFrame(id, new RdmaError("OUT_OF_RANGE", `the reply of ${p.length} bytes exceeds the caller's maxMessageSize (${peerMax})`));
  return { id, payload: p };
}

/** The reply to call `id` through a codec; a value the codec cannot encode answers as the error it threw. */
function encodedFrame(id: number, v: unknown, codec: RpcCodec<any>, peerMax: number): Reply {
  let b: Uint8Array;
  try {
    b = codec.encode(v);
  } catch (e) {
    return errorFrame(id, e);
  }
  if (!(b instanceof Uint8Array)) return errorFrame(id, { code: "HANDLER_ERROR", message: "the codec's encode() did not return a Uint8Array" });
  return okFrame(id, b, peerMax);
}

/** Options of `new RpcServer(handlers, opts)`. */
export interface RpcServerOptions<M extends RpcMethods = RpcUntyped> {
  /** How every method's payloads are encoded (default `rawCodec`: the handler gets the bytes, returns bytes). */
  codec?: RpcCodec<any>;
  /** Per method, where it differs from `codec`. */
  codecs?: RpcCodecs<M>;
  /**
   * Calls of one connection counted at once (default 128): a call counts
   * from the moment its handler starts until its reply has been sent (or,
   * cancelled, until its handler returned). Past it the server reads no
   * more of the connection's messages, and the client waits for credits.
   */
  maxInFlight?: number;
  /**
   * Bytes of replies of one connection waiting to be sent (default 16 MiB).
   * Past it the server reads no more of the connection's messages until
   * replies have left, so a client that does not read its replies is held
   * back instead of buffered. Calls already running still reply (their
   * replies wait too): what a connection holds is at most this plus the
   * replies of `maxInFlight` calls.
   */
  maxQueuedBytes?: number;
  /**
   * While the server waits for room and replies are waiting to be sent,
   * how long it waits without the client taking any of them (default
   * 60000 ms; 0: forever). Past it the connection is closed and `serve()`
   * rejects with TIMEOUT: a client that stopped reading does not keep its
   * connection and its replies forever.
   */
  replyTimeoutMs?: number;
}

/** A method as the server holds it: its handler and its codec (null: raw bytes). */
interface Method {
  fn: RpcHandler<any, any>;
  codec: RpcCodec<any> | null;
}

/** One connection being served: what its calls hold. */
interface Served {
  running: Map<number, Running>;
  outbox: Outbox;
}

/**
 * Answers calls with a handler per method. `M`, a method map, types the
 * handlers (names, payloads, replies); without it they take and give bytes.
 *
 * @example
 * const server = new RpcServer({ echo: (payload) => payload });
 * void server.listen(await new RdmaBuilder().bind("0.0.0.0:5555"));
 *
 * @example
 * type Api = { add: { request: { a: number; b: number }; response: number } };
 * const typed = new RpcServer<Api>({ add: ({ a, b }) => a + b }, { codec: jsonCodec });
 */
export class RpcServer<M extends RpcMethods = RpcUntyped> {
  private readonly handlers: Map<string, Method>;
  private readonly maxInFlight: number;
  private readonly maxQueuedBytes: number;
  private readonly replyTimeoutMs: number;
  private readonly served = new Set<Served>();
  /** Peaks over every connection (for tests): calls in flight on one connection, and its reply bytes unsent. */
  private peakInFlight = 0;
  private peakQueuedBytes = 0;
  /** Connections whose serve() waits for room now. */
  private waiting = 0;

  /** `handlers`: method name → handler. */
  constructor(handlers: RpcHandlers<NoInfer<M>>, opts: RpcServerOptions<NoInfer<M>> = {}) {
    if (handlers === null || typeof handlers !== "object") throw new RdmaError("INVALID_ARGUMENT", "RpcServer: handlers must be an object of functions");
    if (opts.codecs !== undefined && (opts.codecs === null || typeof opts.codecs !== "object")) throw new RdmaError("INVALID_ARGUMENT", "RpcServer: codecs must be an object of codecs");
    const all = codecOf(opts.codec, "RpcServer: codec");
    const per = (opts.codecs ?? {}) as Record<string, RpcCodec<any> | undefined>;
    this.handlers = new Map();
    for (const [k, h] of Object.entries(handlers as Record<string, unknown>)) {
      if (typeof h !== "function") throw new RdmaError("INVALID_ARGUMENT", `RpcServer: handler ${JSON.stringify(k)} is not a function`);
      if (enc.encode(k).length > MAX_METHOD) throw new RdmaError("INVALID_ARGUMENT", `RpcServer: method name ${JSON.stringify(k.slice(0, 40))}… is longer than ${MAX_METHOD} bytes`);
      const own = Object.hasOwn(per, k) ? per[k] : undefined;
      this.handlers.set(k, { fn: h as RpcHandler<any, any>, codec: own === undefined ? all : codecOf(own, `RpcServer: codecs.${k}`) });
    }
    const m = opts.maxInFlight ?? DEFAULT_MAX_IN_FLIGHT;
    if (!Number.isInteger(m) || m < 1) throw new RdmaError("INVALID_ARGUMENT", "RpcServer: maxInFlight must be a positive integer");
    this.maxInFlight = m;
    const q = opts.maxQueuedBytes ?? DEFAULT_MAX_QUEUED_BYTES;
    if (!Number.isSafeInteger(q) || q < 1) throw new RdmaError("INVALID_ARGUMENT", "RpcServer: maxQueuedBytes must be a positive integer");
    this.maxQueuedBytes = q;
    const t = opts.replyTimeoutMs ?? DEFAULT_REPLY_TIMEOUT_MS;
    if (!Number.isInteger(t) || t < 0 || t > 2 ** 31) throw new RdmaError("INVALID_ARGUMENT", "RpcServer: replyTimeoutMs must be an integer from 0 to 2^31 ms");
    this.replyTimeoutMs = t;
  }

  /** Answers calls on every connection `listener` accepts until it closes (connections already served go on). */
  async listen(listener: RdmaListener): Promise<void> {
    for await (const rdma of listener) void this.serve(rdma).catch(() => {});
  }

  /**
   * @internal What the server holds now, over every connection it serves:
   * handlers running, replies not yet sent and their bytes, connections
   * waiting for room; and the peaks of one connection's calls in flight and
   * reply bytes unsent since the server was made.
   */
  stats(): { connections: number; running: number; unsentReplies: number; queuedBytes: number; waiting: number; peakInFlight: number; peakQueuedBytes: number } {
    let running = 0;
    let unsentReplies = 0;
    let queuedBytes = 0;
    for (const s of this.served) {
      running += s.running.size;
      unsentReplies += s.outbox.unsentFrames;
      queuedBytes += s.outbox.unsentBytes;
    }
    return { connections: this.served.size, running, unsentReplies, queuedBytes, waiting: this.waiting, peakInFlight: this.peakInFlight, peakQueuedBytes: this.peakQueuedBytes };
  }

  /**
   * Answers calls on `rdma` until the connection closes (resolves), the
   * peer breaks the protocol (the connection is closed; rejects PROTOCOL)
   * or leaves its replies untaken past `replyTimeoutMs` (the connection is
   * closed; rejects TIMEOUT).
   */
  async serve(rdma: Rdma): Promise<void> {
    const running = new Map<number, Running>();
    const peerMax = rdma.peerLimits?.maxMessageSize ?? 2 ** 32 - 1;
    let wake: (() => void) | null = null;
    let ended = false;
    /** Messages of replies whose send settled: progress, for the reply deadline. */
    let drains = 0;
    const host: OutboxHost = {
      // A reply that cannot be sent (the client did not take it within its rendezvous deadline):
      // its caller would wait forever, so the connection ends.
      failed: (e) => {
        outbox.failure ??= e;
        void rdma.close().catch(() => {});
      },
      drained: () => {
        drains++;
        if (ended && outbox.unsentFrames === 0) this.served.delete(me);
        const w = wake;
        wake = null;
        w?.();
      },
    };
    const outbox = new Outbox(rdma, host, peerMax);
    const me: Served = { running, outbox };
    this.served.add(me);
    const maxInFlight = this.maxInFlight;
    const maxQueuedBytes = this.maxQueuedBytes;
    const replyTimeoutMs = this.replyTimeoutMs;
    const full = (): boolean => running.size + outbox.unsentFrames >= maxInFlight || outbox.unsentBytes >= maxQueuedBytes;
    /**
     * Waits until a call may start; false when the connection ended meanwhile.
     * Throws TIMEOUT when replies wait and none was taken for replyTimeoutMs.
     */
    const room = async (): Promise<boolean> => {
      this.waiting++;
      let seen = drains;
      let since = performance.now();
      try {
        while (full()) {
          if (rdma.isClosed) return false;
          let delay = running.size > 0 ? CLOSED_POLL_MS : -1;
          if (outbox.unsentFrames > 0 && replyTimeoutMs > 0) {
            const now = performance.now();
            if (drains !== seen) {
              seen = drains;
              since = now;
            }
            const left = since + replyTimeoutMs - now;
            if (left <= 0) throw new RdmaError("TIMEOUT", `rpc: the client took none of its ${outbox.unsentFrames} waiting replies (${outbox.unsentBytes} bytes) within ${replyTimeoutMs} ms (replyTimeoutMs); connection closed`);
            delay = delay < 0 ? Math.ceil(left) : Math.min(delay, Math.ceil(left));
          }
          let timer: NodeJS.Timeout | undefined;
          await new Promise<void>((r) => {
            wake = r;
            if (delay >= 0) timer = setTimeout(r, delay);
          });
          if (timer) clearTimeout(timer);
        }
        return !rdma.isClosed;
      } finally {
        this.waiting--;
      }
    };
    /** A reply (or error) for call `id` is queued: it counts until its send settles. */
    const queue = (frame: Reply): void => {
      if (frame instanceof Uint8Array) outbox.push(frame);
      else outbox.pushFrame(OK, frame.id, null, frame.payload);
      const n = running.size + outbox.unsentFrames;
      if (n > this.peakInFlight) this.peakInFlight = n;
      if (outbox.unsentBytes > this.peakQueuedBytes) this.peakQueuedBytes = outbox.unsentBytes;
    };
    try {
      for (;;) {
        if (full() && !(await room())) return;
        let msg;
        try {
          msg = await rdma.receive();
        } catch (e) {
          if (e instanceof RdmaError && (e.code === "CONNECTION_CLOSED" || rdma.isClosed)) return;
          throw e;
        }
        let frames: Frame[];
        try {
          frames = decodeFrames(peekBytes(msg));
        } catch (e) {
          // the connection closed between the arrival and now (its memory is gone)
          if (rdma.isClosed && !(e instanceof RdmaError && e.code === "PROTOCOL")) return;
          throw e;
        } finally {
          msg[Symbol.dispose]();
        }
        for (const f of frames) {
          if (f.kind === CANCEL) {
            running.get(f.id)?.abort(new RdmaError("ABORTED", "the caller cancelled the call"));
            continue;
          }
          if (f.kind !== CALL) throw new RdmaError("PROTOCOL", `rpc: a client sent a frame of kind ${f.kind}`);
          // The limit holds per call: the rest of this message waits (and nothing more is read).
          if (full() && !(await room())) return;
          if (running.has(f.id)) throw new RdmaError("PROTOCOL", `rpc: call id ${f.id} is already running`);
          const h = this.handlers.get(f.method);
          if (h === undefined) {
            queue(errorFrame(f.id, Object.assign(new Error(`no such method: ${JSON.stringify(f.method)}`), { code: "NOT_FOUND" })));
            continue;
          }
          const call = new Running(f.method, rdma);
          running.set(f.id, call);
          if (running.size + outbox.unsentFrames > this.peakInFlight) this.peakInFlight = running.size + outbox.unsentFrames;
          const done = (frame: Reply | null): void => {
            running.delete(f.id);
            // a cancelled call gets no reply: the caller has forgotten it
            if (!call.aborted && frame !== null) queue(frame);
            const w = wake;
            wake = null;
            w?.();
          };
          const codec = h.codec;
          let req: unknown = f.payload;
          if (codec !== null) {
            try {
              req = codec.decode(f.payload);
            } catch (e) {
              done(errorFrame(f.id, { code: "BAD_REQUEST", message: `the payload could not be decoded: ${e instanceof Error ? e.message : String(e)}` }));
              continue;
            }
          }
          let r;
          try {
            r = h.fn(req, call);
          } catch (e) {
            done(errorFrame(f.id, e));
            continue;
          }
          // A synchronous handler's reply needs no promise turn.
          if (codec === null && (r instanceof Uint8Array || r === undefined)) done(okFrame(f.id, r, peerMax));
          else if (codec === null)
            Promise.resolve(r).then(
              (v) => done(call.aborted ? null : okFrame(f.id, v, peerMax)),
              (e: unknown) => done(call.aborted ? null : errorFrame(f.id, e)),
            );
          else if (typeof (r as { then?: unknown } | null | undefined)?.then !== "function") done(encodedFrame(f.id, r, codec, peerMax));
          else
            Promise.resolve(r).then(
              (v) => done(call.aborted ? null : encodedFrame(f.id, v, codec, peerMax)),
              (e: unknown) => done(call.aborted ? null : errorFrame(f.id, e)),
            );
        }
      }
    } catch (e) {
      await rdma.close().catch(() => {});
      throw e;
    } finally {
      for (const c of running.values()) c.abort(new RdmaError("CONNECTION_CLOSED", "the connection ended"));
      ended = true;
      outbox.failure ??= new RdmaError("CONNECTION_CLOSED", "the connection ended");
      outbox.close();
      // Replies still being sent settle when the connection's teardown rejects them.
      if (outbox.unsentFrames === 0) this.served.delete(me);
    }
  }
}

/** A call being handled: its context, with the AbortSignal made only if the handler asks for it. */
class Running implements RpcContext {
  private ac: AbortController | null = null;
  private reason: unknown = undefined;
  aborted = false;

  constructor(
    readonly method: string,
    readonly rdma: Rdma,
  ) {}

  get signal(): AbortSignal {
    if (this.ac === null) {
      this.ac = new AbortController();
      if (this.aborted) this.ac.abort(this.reason);
    }
    return this.ac.signal;
  }

  abort(reason: unknown): void {
    if (this.aborted) return;
    this.aborted = true;
    this.reason = reason;
    this.ac?.abort(reason);
  }
}

