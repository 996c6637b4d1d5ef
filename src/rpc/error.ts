/**
 * How a handler's error crosses the wire: the ERROR frame's payload is JSON
 * `{ code, message }` (the code cut to 100 characters, the message to 4000),
 * with `details` when the handler's error had some whose JSON is at most
 * 16 KiB; the caller gets it back as an `RpcError`, and an ERROR payload it
 * cannot read as the defaults ("HANDLER_ERROR", "the handler failed").
 */
import { dec, enc, encodeFrame, ERROR } from "./frame.js";

/** The largest JSON of a handler error's `details` carried to the caller (bytes); larger ones are dropped. */
const MAX_DETAILS = 16 * 1024;

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

/** The ERROR frame answering call `id` with the error `e` a handler threw (or an `{ code, message }` of the server's own). */
export function errorFrame(id: number, e: unknown): Uint8Array {
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

/** The RpcError a caller of `method` gets from an ERROR frame's payload. */
export function decodeError(payload: Uint8Array, method: string): RpcError {
  let code = "HANDLER_ERROR";
  let message = "the handler failed";
  let details: unknown;
  try {
    const j = JSON.parse(dec.decode(payload)) as { code?: unknown; message?: unknown; details?: unknown };
    if (typeof j.code === "string") code = j.code;
    if (typeof j.message === "string") message = j.message;
    details = j.details;
  } catch {
    /* keep the defaults */
  }
  return new RpcError(code, `${method}: ${message}`, method, details);
}
