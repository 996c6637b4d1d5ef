/**
 * The typed surface of async-rdma/rpc: method maps (name → request and
 * response types), handlers and what they learn about a call, and a call's
 * options. Types only: nothing here runs.
 */
import type { Rdma } from "../index.js";
import type { RpcCodec } from "./codec.js";

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

/** Options of a call. */
export interface CallOptions {
  /** Cancels the call (rejects with ABORTED; the server's handler sees its signal abort). */
  signal?: AbortSignal;
  /** Rejects with TIMEOUT (and cancels the call at the server) after this. */
  timeoutMs?: number;
}

/** The arguments of `call(method, ...)`: the payload may be left out when the method takes bytes or `undefined`. */
export type RpcCallArgs<Req> = [Req] extends [Uint8Array] ? [payload?: Req, opts?: CallOptions] : undefined extends Req ? [payload?: Req, opts?: CallOptions] : [payload: Req, opts?: CallOptions];
