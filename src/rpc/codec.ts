/**
 * Payload codecs: how a method's values become a frame's payload and back.
 * Raw bytes (`rawCodec`, the default) are resolved to `null` once, when a
 * client or server is made, so the raw path calls nothing per message.
 */
import { RdmaError } from "../index.js";
import { dec, EMPTY, enc } from "./frame.js";

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

/** The codec to use, null for raw bytes (so the raw path calls nothing). */
export function codecOf(c: RpcCodec<any> | undefined, what: string): RpcCodec<any> | null {
  if (c === undefined || c === rawCodec) return null;
  if (c === null || typeof c !== "object" || typeof c.encode !== "function" || typeof c.decode !== "function") throw new RdmaError("INVALID_ARGUMENT", `${what} must be an object with encode() and decode()`);
  return c;
}
