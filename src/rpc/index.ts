/**
 * async-rdma/rpc: request/response calls over one connection's two-sided
 * messages (send/receive), a layer above the API.
 *
 * - `RpcServer`: a handler per method; `serve(rdma)` answers one connection,
 *   `listen(listener)` every connection a listener accepts.
 * - `RpcClient.call(method, payload, { signal, timeoutMs })`: many calls in
 *   flight, matched by id; an abort or timeout reaches the server (its
 *   handler's `signal` aborts) and the reply, if any, is dropped.
 * - Payloads of any size (small ones go eagerly, large ones by rendezvous
 *   READ underneath). Frames queued before the next microtask checkpoint
 *   (e.g. the calls of one Promise.all, the replies of synchronous handlers to
 *   one message) travel in one message.
 * - A handler's error comes back as an `RpcError` with its `code` (the
 *   error's own string `code`, else "HANDLER_ERROR"), message and `details`
 *   (the error's `details` property, when it is JSON of at most 16 KiB).
 * - A server holds a bounded amount per connection: a call counts against
 *   `maxInFlight` from the moment it starts until its reply has been sent
 *   (the send settled), and replies not yet sent count against
 *   `maxQueuedBytes`. Past either bound the server stops reading the
 *   connection (the client waits for credits), so a client that does not
 *   read its replies is held back, not buffered.
 *
 * - Typed: `RpcClient<Methods>` / `RpcServer<Methods>` with a method map
 *   (`{ name: { request: Req; response: Res } }`) check method names and
 *   payload types at compile time; without a map both take and give bytes.
 * - Payload codecs: raw bytes (the default: nothing is copied or converted),
 *   `jsonCodec`, or any `{ encode, decode }`; per client/server or per method.
 *
 * One RpcClient or RpcServer per connection: each consumes the connection's
 * receive(). Use `newConnection()` for more.
 *
 * Frame (big-endian), several per message:
 *   0 u8 magic 0x52   1 u8 kind (1 CALL, 2 OK, 3 ERROR, 4 CANCEL)
 *   2 u16 method length   4 u32 call id   8 u32 payload length
 *   12 method (UTF-8, CALL only)   then the payload (ERROR: JSON {code, message},
 *   and "details" when the handler's error had some)
 */
import { RdmaError, type LocalMr, type Rdma, type RdmaListener } from "../index.js";

const MAGIC = 0x52;
const CALL = 1;
const OK = 2;
const ERROR = 3;
const CANCEL = 4;
const HDR = 12;
/**
 * Frames are gathered into one message up to the peer's eager threshold
 * (rdma.peerEagerThreshold: the batch is one SEND, never a rendezvous), its
 * maxMessageSize, or 4 KiB, whichever is least; a larger frame travels alone.
 * The connection's default eager threshold leaves 64 bytes beyond 4 KiB for
 * this framing, so a 4 KiB call alone is still one eager message.
 */
const MIN_BATCH_BYTES = 256;
/**
 * And at most this: a batch buffer is registered memory held until its send
 * completes, so its size must not follow a peer's advertised threshold (up
 * to 1 MiB) — 128 small replies the peer never takes would pin 128 buffers.
 */
const MAX_BATCH_BYTES = 4096;
const MAX_METHOD = 1024;
/** Batch buffers kept for reuse per connection (each one batch, registered). */
const SPARE_BUFFERS = 8;
/** Default of `RpcServerOptions.maxInFlight`. */
const DEFAULT_MAX_IN_FLIGHT = 128;
/** Default of `RpcServerOptions.maxQueuedBytes`: 16 MiB. */
const DEFAULT_MAX_QUEUED_BYTES = 16 << 20;
/** Default of `RpcServerOptions.replyTimeoutMs`: as long as a connection's rendezvous deadline. */
const DEFAULT_REPLY_TIMEOUT_MS = 60_000;
/** The largest JSON of a handler error's `details` carried to the caller (bytes); larger ones are dropped. */
const MAX_DETAILS = 16 * 1024;
/**
 * While a server waits for room (calls running, replies unsent) it reads
 * nothing, so nothing tells it the connection ended: it looks this often.
 * (Replies waiting to be sent settle at once when the connection ends; only
 * handlers that never return need this.)
 */
const CLOSED_POLL_MS = 1000;

/**
 * An error a handler threw (or the server's answer to an unknown method), carried back to the caller.
 * A handler may throw one itself (`new RpcError("EQUOTA", "over quota", "put", { used: 5 })`), or any
 * error (or plain object) with a string `code`, a `message` and a JSON-able `details`.
 * `D` is the type of `details` as the caller expects it (see `isRpcError`); it is not checked at run time.
 */
export class RpcError<D = unknown> extends Error {
  override readonly name = "RpcError";
  /** `code`: the handler error's code; `message`: its message; `method`: the method called; `details`: its `details`. */
  constructor(
    /** The handler error's `code` ("HANDLER_ERROR" when it had none; "NOT_FOUND" for an unknown method). */
    readonly code: string,
    message: string,
    /** The method called. */
    readonly method: string,
    /**
     * The handler error's `details` property, as JSON carries it (parsed
     * back: objects, arrays, strings, numbers, booleans, null); undefined
     * when it had none, or when its JSON was over 16 KiB or could not be
     * made (a cycle, a BigInt).
     */
    readonly details?: D,
  ) {
    super(message);
  }
}

/**
 * Narrows a call's rejection to an RpcError (of `code`, when given) whose `details` the caller
 * expects to be a `D` (taken on trust: details are the server's JSON).
 *
 * @example
 * try { await client.call("put", req); }
 * catch (e) { if (isRpcError<{ used: number }>(e, "EQUOTA")) console.log(e.details?.used); }
 */
export function isRpcError<D = unknown>(e: unknown, code?: string): e is RpcError<D> {
  return e instanceof RpcError && (code === undefined || e.code === code);
}

/**
 * How a method's payloads become bytes and back. `decode` may keep the bytes it is given (they are
 * the call's own copy). A throw from `encode` fails the call (the client's: INVALID_ARGUMENT before
 * anything is sent; the server's: the caller gets an RpcError with the thrown code); a throw from
 * the server's `decode` answers the caller with an RpcError "BAD_REQUEST", from the client's
 * `decode` rejects that call with an RpcError "BAD_REPLY".
 */
export interface RpcCodec<T = unknown> {
  /** The payload's bytes on the wire; a throw fails the call (client: INVALID_ARGUMENT, nothing sent). */
  encode(value: T): Uint8Array;
  /** The value of received bytes; a throw fails that call only (server: BAD_REQUEST, client: BAD_REPLY). */
  decode(bytes: Uint8Array): T;
}

/** Bytes as they are (the default): nothing copied, nothing converted. */
export const rawCodec: RpcCodec<Uint8Array> = Object.freeze({
  encode: (v: Uint8Array): Uint8Array => v,
  decode: (b: Uint8Array): Uint8Array => b,
});

/** JSON as UTF-8; `undefined` travels as an empty payload (and comes back as `undefined`). */
export const jsonCodec: RpcCodec<unknown> = Object.freeze({
  encode: (v: unknown): Uint8Array => (v === undefined ? EMPTY : enc.encode(JSON.stringify(v))),
  decode: (b: Uint8Array): unknown => (b.length === 0 ? undefined : JSON.parse(dec.decode(b))),
});

/** One method of a method map: what the caller sends and what the handler answers. */
export interface RpcMethod<Req = Uint8Array, Res = Uint8Array> {
  request: Req;
  response: Res;
}

/** A method map: method name → its request and response types. */
export type RpcMethods = { [method: string]: RpcMethod<any, any> };

/** The map of an untyped client or server: any method name, bytes in and out. */
export type RpcUntyped = Record<string, RpcMethod<Uint8Array, Uint8Array>>;

/** The method names of a map (string keys only). */
export type RpcMethodName<M extends RpcMethods> = keyof M & string;

/** The codec of each method, where it differs from the client's or server's `codec`. */
export type RpcCodecs<M extends RpcMethods> = { [K in RpcMethodName<M>]?: RpcCodec<any> };

/** What a handler learns about its call. */
export interface RpcContext {
  method: string;
  /** Aborts when the caller cancels (abort, timeout) or the connection ends. */
  signal: AbortSignal;
  /** The connection the call came on. */
  rdma: Rdma;
}

/**
 * A method's implementation: the call's payload in, the reply's bytes out
 * (nothing: an empty reply). A thrown error goes back to the caller as an
 * RpcError with the error's `code`, `message` and `details`.
 */
export type RpcHandler<Req = Uint8Array, Res = Uint8Array> = (payload: Req, ctx: RpcContext) => Res | void | Promise<Res | void>;

/** A handler for every method of the map `M`. */
export type RpcHandlers<M extends RpcMethods> = { [K in RpcMethodName<M>]: RpcHandler<M[K]["request"], M[K]["response"]> };

interface Frame {
  kind: number;
  id: number;
  method: string;
  payload: Uint8Array;
}

const enc = new TextEncoder();
const dec = new TextDecoder("utf-8", { fatal: true });
const EMPTY = new Uint8Array(0);

function encodeFrame(kind: number, id: number, method: Uint8Array | null, payload: Uint8Array): Uint8Array {
  const m = method ?? EMPTY;
  const out = new Uint8Array(HDR + m.length + payload.length);
  const v = new DataView(out.buffer);
  v.setUint8(0, MAGIC);
  v.setUint8(1, kind);
  v.setUint16(2, m.length);
  v.setUint32(4, id);
  v.setUint32(8, payload.length);
  out.set(m, HDR);
  out.set(payload, HDR + m.length);
  return out;
}

/** Every frame of a message; throws PROTOCOL naming what is wrong. */
function decodeFrames(buf: Uint8Array): Frame[] {
  const out: Frame[] = [];
  const v = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  let off = 0;
  while (off < buf.length) {
    if (buf.length - off < HDR) throw new RdmaError("PROTOCOL", `rpc: truncated frame header (${buf.length - off} bytes)`);
    if (v.getUint8(off) !== MAGIC) throw new RdmaError("PROTOCOL", "rpc: bad frame magic (is the peer an RpcClient/RpcServer?)");
    const kind = v.getUint8(off + 1);
    const mlen = v.getUint16(off + 2);
    const id = v.getUint32(off + 4);
    const plen = v.getUint32(off + 8);
    if (kind < CALL || kind > CANCEL) throw new RdmaError("PROTOCOL", `rpc: unknown frame kind ${kind}`);
    if (kind !== CALL && mlen !== 0) throw new RdmaError("PROTOCOL", "rpc: method name on a frame that is not a call");
    if (mlen > MAX_METHOD) throw new RdmaError("PROTOCOL", `rpc: method name of ${mlen} bytes`);
    const end = off + HDR + mlen + plen;
    if (end > buf.length) throw new RdmaError("PROTOCOL", "rpc: frame longer than its message");
    let method = "";
    if (mlen > 0) {
      try {
        method = dec.decode(buf.subarray(off + HDR, off + HDR + mlen));
      } catch {
        throw new RdmaError("PROTOCOL", "rpc: method name is not UTF-8");
      }
    }
    // A copy: the message's buffer goes back to the connection at once.
    out.push({ kind, id, method, payload: buf.slice(off + HDR + mlen, end) });
    off = end;
  }
  return out;
}

/** The ids of the CALL frames in `b` (frames this side encoded, so well-formed): the calls of a message whose send failed. */
function callIds(b: Uint8Array): number[] {
  const ids: number[] = [];
  const v = new DataView(b.buffer, b.byteOffset, b.byteLength);
  for (let off = 0; off + HDR <= b.length; off += HDR + v.getUint16(off + 2) + v.getUint32(off + 8)) {
    if (v.getUint8(off + 1) === CALL) ids.push(v.getUint32(off + 4));
  }
  return ids;
}

/** What an Outbox reports to its owner. */
interface OutboxHost {
  /** A message could not be sent (the connection lives on, unless `e` says it closed); `ids`: the CALL frames it carried. */
  failed(e: unknown, ids: number[]): void;
  /** Frames left the box (their send settled, or they were dropped): room may have come back. */
  drained(): void;
}

/**
 * Frames queued before the next microtask checkpoint go out together. A
 * frame counts (`unsentFrames`, `unsentBytes`) from push until the send of
 * its message settles: what the box holds is what has not reached the peer.
 */
class Outbox {
  private frames: Uint8Array[] = [];
  private scheduled = false;
  /** Set by the owner (or a closing connection): later frames are dropped. */
  failure: unknown = null;
  /** Frames pushed whose message's send has not settled. */
  unsentFrames = 0;
  /** Their bytes. */
  unsentBytes = 0;
  /** Registered batch buffers whose send completed: reused, so a batch costs no allocation or registration. */
  private readonly spare: LocalMr[] = [];
  private readonly batchMax: number;

  constructor(
    private readonly rdma: Rdma,
    private readonly host: OutboxHost,
    /** The peer's maxMessageSize: a batch never exceeds it (a single larger frame is the owner's to refuse). */
    peerMax: number,
  ) {
    this.batchMax = Math.min(peerMax, MAX_BATCH_BYTES, Math.max(MIN_BATCH_BYTES, rdma.peerEagerThreshold));
  }

  push(frame: Uint8Array): void {
    if (this.failure) return;
    this.frames.push(frame);
    this.unsentFrames++;
    this.unsentBytes += frame.length;
    if (!this.scheduled) {
      this.scheduled = true;
      queueMicrotask(() => this.flush());
    }
  }

  /** The connection ended: the spare buffers go back to it. */
  close(): void {
    for (const m of this.spare.splice(0)) m[Symbol.dispose]();
  }

  private settled(count: number, bytes: number): void {
    this.unsentFrames -= count;
    this.unsentBytes -= bytes;
    this.host.drained();
  }

  private flush(): void {
    this.scheduled = false;
    const frames = this.frames;
    this.frames = [];
    let batch: Uint8Array[] = [];
    let bytes = 0;
    const out = (list: Uint8Array[], n: number): void => {
      const count = list.length;
      if (count === 0) return;
      if (this.failure) return this.settled(count, n);
      let buf: LocalMr | undefined;
      try {
        buf = n <= this.batchMax ? this.spare.pop() : undefined;
        buf ??= this.rdma.allocLocalMr(Math.max(n, this.batchMax));
      } catch (e) {
        this.settled(count, n);
        // A closing connection: its receive loop ends every call with CONNECTION_CLOSED.
        if ((e instanceof RdmaError && e.code === "CONNECTION_CLOSED") || this.rdma.isClosed) {
          this.failure ??= e;
          return;
        }
        const ids: number[] = [];
        for (const f of list) if (f[1] === CALL) ids.push(new DataView(f.buffer, f.byteOffset, HDR).getUint32(4));
        return this.host.failed(e, ids);
      }
      const whole = buf;
      const b = whole.bytes;
      let o = 0;
      for (const f of list) {
        b.set(f, o);
        o += f.length;
      }
      this.rdma.send(o === whole.length ? whole : whole.slice(0, o)).then(
        () => {
          if (whole.length === this.batchMax && !this.failure && this.spare.length < SPARE_BUFFERS) this.spare.push(whole);
          else whole[Symbol.dispose]();
          this.settled(count, n);
        },
        (e: unknown) => {
          let ids: number[] = [];
          if (!this.rdma.isClosed) {
            try {
              ids = callIds(whole.bytes.subarray(0, o));
            } catch {
              /* the memory went with the connection */
            }
          }
          whole[Symbol.dispose]();
          this.settled(count, n);
          if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED") return;
          this.host.failed(e, ids);
        },
      );
    };
    for (const f of frames) {
      if (bytes > 0 && bytes + f.length > this.batchMax) {
        out(batch, bytes);
        batch = [];
        bytes = 0;
      }
      batch.push(f);
      bytes += f.length;
    }
    out(batch, bytes);
  }
}

/** The reply to call `id`; a reply the caller would refuse (over its maxMessageSize) fails that call only, OUT_OF_RANGE. */
function okFrame(id: number, v: unknown, peerMax: number): Uint8Array {
  const p = v instanceof Uint8Array ? v : EMPTY;
  // checked before the copy
  if (HDR + p.length > peerMax) return errorFrame(id, new RdmaError("OUT_OF_RANGE", `the reply of ${p.length} bytes exceeds the caller's maxMessageSize (${peerMax})`));
  return encodeFrame(OK, id, null, p);
}

/** The reply to call `id` through a codec; a value the codec cannot encode answers as the error it threw. */
function encodedFrame(id: number, v: unknown, codec: RpcCodec<any>, peerMax: number): Uint8Array {
  let b: Uint8Array;
  try {
    b = codec.encode(v);
  } catch (e) {
    return errorFrame(id, e);
  }
  if (!(b instanceof Uint8Array)) return errorFrame(id, { code: "HANDLER_ERROR", message: "the codec's encode() did not return a Uint8Array" });
  return okFrame(id, b, peerMax);
}

function errorFrame(id: number, e: unknown): Uint8Array {
  const code = typeof (e as { code?: unknown })?.code === "string" ? (e as { code: string }).code : "HANDLER_ERROR";
  const m = e !== null && typeof e === "object" ? (e as { message?: unknown }).message : undefined;
  const message = typeof m === "string" ? m : String(e);
  let json = JSON.stringify({ code: code.slice(0, 100), message: message.slice(0, 4000) });
  const details = e !== null && typeof e === "object" ? (e as { details?: unknown }).details : undefined;
  if (details !== undefined) {
    // The error is the server's own (its handler threw it): stringify it whole, then bound what goes out.
    let d: string | undefined;
    try {
      d = JSON.stringify(details);
    } catch {
      /* a cycle, a BigInt: no details */
    }
    if (d !== undefined && d.length <= MAX_DETAILS && Buffer.byteLength(d) <= MAX_DETAILS) json = `${json.slice(0, -1)},"details":${d}}`;
  }
  return encodeFrame(ERROR, id, null, enc.encode(json));
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

/** The codec to use, null for raw bytes (so the raw path calls nothing). */
function codecOf(c: RpcCodec<any> | undefined, what: string): RpcCodec<any> | null {
  if (c === undefined || c === rawCodec) return null;
  if (c === null || typeof c !== "object" || typeof c.encode !== "function" || typeof c.decode !== "function") throw new RdmaError("INVALID_ARGUMENT", `${what} must be an object with encode() and decode()`);
  return c;
}

/** Options of a call. */
export interface CallOptions {
  /** Cancels the call (rejects with ABORTED; the server's handler sees its signal abort). */
  signal?: AbortSignal;
  /** Rejects with TIMEOUT (and cancels the call at the server) after this. */
  timeoutMs?: number;
}

/** The arguments of `call(method, ...)`: the payload may be left out when the method takes bytes or `undefined`. */
export type RpcCallArgs<Req> = [Req] extends [Uint8Array] ? [payload?: Req, opts?: CallOptions] : undefined extends Req ? [payload?: Req, opts?: CallOptions] : [payload: Req, opts?: CallOptions];

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
    const queue = (frame: Uint8Array): void => {
      outbox.push(frame);
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
          frames = decodeFrames(msg.bytes);
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
          const done = (frame: Uint8Array | null): void => {
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
        frames = decodeFrames(msg.bytes);
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
        } else {
          let code = "HANDLER_ERROR";
          let message = "the handler failed";
          let details: unknown;
          try {
            const j = JSON.parse(dec.decode(f.payload)) as { code?: unknown; message?: unknown; details?: unknown };
            if (typeof j.code === "string") code = j.code;
            if (typeof j.message === "string") message = j.message;
            details = j.details;
          } catch {
            /* keep the defaults */
          }
          p.reject(new RpcError(code, `${p.method}: ${message}`, p.method, details));
        }
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
    return new Promise<unknown>((resolve, reject) => {
      let timer: NodeJS.Timeout | null = null;
      const cleanup = (): void => {
        if (timer) clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
      };
      const cancel = (e: RdmaError): void => {
        if (!this.pending.delete(id)) return;
        cleanup();
        this.outbox.push(encodeFrame(CANCEL, id, null, new Uint8Array(0)));
        reject(e);
      };
      const onAbort = (): void => cancel(new RdmaError("ABORTED", `${method} aborted`));
      if (timeoutMs !== undefined) timer = setTimeout(() => cancel(new RdmaError("TIMEOUT", `${method} timed out after ${timeoutMs} ms`)), timeoutMs);
      signal?.addEventListener("abort", onAbort, { once: true });
      this.pending.set(id, {
        method,
        codec,
        resolve: (v) => {
          cleanup();
          resolve(v);
        },
        reject: (e) => {
          cleanup();
          reject(e);
        },
      });
      this.outbox.push(encodeFrame(CALL, id, m, payload as Uint8Array));
    });
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
