/**
 * What an RdmaStream sees of its connection, and the options it is opened
 * with: the narrow interface the stream's parts (stream.ts, stream-ring.ts,
 * stream-wire.ts) are written against, so none of them imports rdma.ts
 * (which imports stream.ts for `createStream()`).
 *
 * Invariant: a stream uses its connection only through these members; an
 * Rdma has them all, and so may anything else a stream is run on in tests.
 */
import type { LocalMr, RemoteMr } from "../memory/mr.js";
import type { PeerInfo } from "./establish/auth.js";
import type { SharedMr, ShareOptions } from "./shared.js";

/**
 * What a stream uses of its connection (an Rdma). Structural, so this file
 * does not import rdma.ts, which imports it for `createStream()`; a
 * stream's `connection` has its connection's own type (`RdmaStream<Rdma>`).
 */
export interface StreamConnection {
  readonly isClosed: boolean;
  readonly peer: PeerInfo;
  /** Registered memory a control message lives in. */
  allocLocalMr(size: number): LocalMr;
  /** Registers the receive ring in place. */
  registerMr(buffer: ArrayBuffer): LocalMr;
  /** Sends one control message. */
  send(data: LocalMr): Promise<void>;
  /** The next control message. */
  receive(opts: { signal: AbortSignal }): Promise<LocalMr>;
  /** Writes one chunk from the send ring into the peer's ring. */
  writeWithImm(data: LocalMr, rmr: RemoteMr, imm: number): Promise<void>;
  /** The length of the next chunk the peer wrote into this side's ring. */
  receiveWriteImm(opts: { signal: AbortSignal }): Promise<number>;
  /** Shares this side's ring with the peer. */
  share(name: string, lmr: LocalMr, opts?: ShareOptions): SharedMr;
  /** Opens the peer's ring. */
  openSharedMr(name: string, opts: { signal: AbortSignal }): Promise<RemoteMr>;
  /** Closes the connection when the stream ends (unless `closeConnection: false`); with `flush`, once the peer has what was sent. */
  close(opts?: { flush?: boolean; timeoutMs?: number }): Promise<void>;
  /** The connection keeps the process alive (stream.ref()). */
  ref(): unknown;
  /** The connection lets the process exit (stream.unref()). */
  unref(): unknown;
}

/** Options of {@link Rdma.createStream} and of `async-rdma/net` sockets. */
export interface StreamOptions {
  /** false (default, as `net.Socket`): the stream ends its writable side once the peer's has ended. */
  allowHalfOpen?: boolean;
  /** Whether destroying the stream, or its end in both directions, closes the connection (default true). */
  closeConnection?: boolean;
  /**
   * As `net.Socket`'s `onread`: incoming bytes are copied into one buffer of
   * yours (or one `buffer()` returns, asked before each delivery) and handed
   * to `callback(nread, buffer)` instead of 'data' events; returning false
   * pauses the stream (as `pause()`; `resume()` or `read()` goes on, and
   * 'end' waits for it). No buffer is allocated per chunk: bytes not yet
   * delivered wait in the receive ring.
   */
  onread?: OnRead | null;
}

/** The `onread` option (see {@link StreamOptions.onread}). */
export interface OnRead {
  /** The buffer each delivery fills from its start, or a function returning the one to fill next. */
  buffer: Uint8Array | (() => Uint8Array);
  /** Called with the bytes delivered (1..buffer.length) and the buffer; false pauses the stream. */
  callback: (nread: number, buffer: Uint8Array) => boolean | void;
}
