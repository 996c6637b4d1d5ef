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
 * This file is the entry point (the package's "./rpc" export) and only
 * re-exports. The parts, one concern each:
 * - frame.ts: the frame codec (the wire bytes of CALL, OK, ERROR, CANCEL);
 * - codec.ts: payload codecs (raw, JSON, a user's);
 * - error.ts: RpcError and how a handler's error crosses the wire;
 * - types.ts: method maps, handlers, call options (types only);
 * - outbox.ts: batching of frames into messages, and what is unsent;
 * - server.ts: RpcServer and its per-connection bounds;
 * - client.ts: RpcClient, calls matched to replies, cancel and timeout.
 */
export { rawCodec, jsonCodec, type RpcCodec } from "./codec.js";
export { RpcError, isRpcError } from "./error.js";
export type { RpcMethod, RpcMethods, RpcUntyped, RpcMethodName, RpcCodecs, RpcContext, RpcHandler, RpcHandlers, CallOptions, RpcCallArgs } from "./types.js";
export { RpcServer, type RpcServerOptions } from "./server.js";
export { RpcClient, type RpcClientOptions } from "./client.js";
