/**
 * How a connection's life looks from Node: an async iterator of its
 * messages, a promise of its end, and the options of close().
 *
 * Invariant: a connection ends cleanly when either side's close() ended it
 * (the CLOSE message sent or received before any failure; the agent marks
 * it `endedCleanly`); any other end is a failure with its typed error.
 * `messages()` ends without an error exactly on a clean end, after every
 * message that arrived before it; `closed` resolves on a clean end and
 * rejects with the failure otherwise, and never counts as an unhandled
 * rejection when nobody looks at it.
 */
import { RdmaError, checkInt } from "../errors.js";
import type { Connection } from "../agent/connection.js";
import type { LocalMr } from "../memory/mr.js";

/** Options of {@link Rdma.messages}. */
export interface MessagesOptions {
  /** Stops the iteration: the pending step rejects with ABORTED (as `events.on` does with its signal). */
  signal?: AbortSignal;
}

/** Options of {@link Rdma.close}. */
export interface CloseOptions {
  /**
   * Resolve only once the peer has received everything this side sent
   * (queued sends and writes go first, rendezvous messages are taken by the
   * peer), however slowly it reads. Default false: queued operations are
   * dropped (they reject with CONNECTION_CLOSED).
   */
  flush?: boolean;
  /**
   * How long close() waits: for the peer to take everything (flush), or for
   * the CLOSE message to leave. Default: the builder's close timeout (2 s),
   * or 30 s with `flush`. Past it the connection closes anyway; a flushing
   * close then rejects with TIMEOUT.
   */
  timeoutMs?: number;
}

/** Default of `close({ flush: true })`'s timeoutMs (docs/limits.md). */
export const FLUSH_TIMEOUT_MS = 30_000;

/** @internal */
/** The validated options of close(). */
export function closeOptions(o: unknown, defaultTimeoutMs: number): { flush: boolean; timeoutMs: number } {
  if (o === undefined) return { flush: false, timeoutMs: defaultTimeoutMs };
  if (o === null || typeof o !== "object") throw new RdmaError("INVALID_ARGUMENT", `close: options must be an object, got ${o === null ? "null" : typeof o}`);
  const { flush, timeoutMs } = o as CloseOptions;
  if (flush !== undefined && typeof flush !== "boolean") throw new RdmaError("INVALID_ARGUMENT", "close: flush must be a boolean");
  const f = flush === true;
  const t = timeoutMs === undefined ? (f ? FLUSH_TIMEOUT_MS : defaultTimeoutMs) : checkInt("timeoutMs", timeoutMs, 1, 2 ** 31 - 1);
  return { flush: f, timeoutMs: t };
}

/** @internal */
/** Whether `e`, a receive's rejection, is the connection's clean end (not a failure, not an abort). */
export function isCleanEnd(conn: Connection, e: unknown): boolean {
  return conn.endedCleanly && e instanceof RdmaError && (e === conn.failure || e.cause === conn.failure);
}

/** @internal */
/**
 * The messages of `conn` in arrival order, ending after the last one when
 * the connection ends cleanly; a failure (or an abort) is thrown.
 */
export async function* messagesOf(conn: Connection, signal: AbortSignal | undefined): AsyncGenerator<LocalMr, void, undefined> {
  for (;;) {
    let mr: LocalMr;
    try {
      mr = (await conn.receive(signal)).mr;
    } catch (e) {
      if (isCleanEnd(conn, e)) return;
      throw e;
    }
    yield mr;
  }
}

/** @internal */
/**
 * A promise of the connection's end, and how to settle it once. It resolves
 * (undefined) on a clean end and rejects with the typed failure otherwise;
 * a handler is attached at once, so an unobserved failure is never an
 * unhandled rejection (whoever awaits `closed` still sees it).
 */
export function endPromise(): { promise: Promise<void>; settle: (failure: RdmaError | undefined) => void } {
  let resolve!: () => void;
  let reject!: (e: unknown) => void;
  const promise = new Promise<void>((res, rej) => ((resolve = res), (reject = rej)));
  promise.catch(() => {});
  return { promise, settle: (failure) => (failure === undefined ? resolve() : reject(failure)) };
}
