/**
 * Observability of connections: `NODE_DEBUG=async-rdma` (util.debuglog) and
 * diagnostics_channel channels, as node:http and undici publish them.
 *
 * Invariant: nothing is built or published unless someone listens. The
 * debug logger is checked with `debug.enabled` before a line is formatted;
 * an operation is traced only when a subscriber exists at the moment it
 * starts (`hasSubscribers`, a property read), otherwise the operation's
 * promise is returned as it is, with no wrapper and no message object.
 *
 * Channels (their names are part of the public API):
 * - `async-rdma:connection:open`   `{ rdma }` once a connection is handed out (connect, accept)
 * - `async-rdma:connection:close`  `{ rdma, error }` when it ends, however it ends (`error` undefined for a clean close)
 * - `async-rdma:connection:error`  `{ rdma, error }` when it ends by a failure (after `close`'s message for it)
 * - `async-rdma:operation:start`   `{ rdma, operation, bytes, error }` as an operation starts
 * - `async-rdma:operation:end`     the same object when it settles (`error` set when it failed)
 */
import { channel } from "node:diagnostics_channel";
import { debuglog } from "node:util";
import type { RdmaError } from "../errors.js";
import type { PeerInfo } from "./establish/auth.js";

/** What is logged of a connection (an Rdma; structural, so this file does not import rdma.ts). */
interface Observed {
  readonly provider: string;
  readonly deviceName: string;
  readonly peer: PeerInfo;
}

/** `NODE_DEBUG=async-rdma`: connection setup, errors and teardown on stderr. */
export const debug = debuglog("async-rdma");

/** The names of the channels async-rdma publishes on. */
export const CHANNELS = {
  open: "async-rdma:connection:open",
  close: "async-rdma:connection:close",
  error: "async-rdma:connection:error",
  operationStart: "async-rdma:operation:start",
  operationEnd: "async-rdma:operation:end",
} as const;

/** The operations traced on the operation channels. */
export type OperationName = "send" | "sendWithImm" | "receive" | "receiveWithImm" | "write" | "writeWithImm" | "read" | "receiveWriteImm" | "compareAndSwap" | "fetchAndAdd";

const openCh = channel(CHANNELS.open);
const closeCh = channel(CHANNELS.close);
const errorCh = channel(CHANNELS.error);
const startCh = channel(CHANNELS.operationStart);
const endCh = channel(CHANNELS.operationEnd);

/** Someone listens to operations: only then is an operation wrapped (one property read each when nobody does). */
export function tracing(): boolean {
  return startCh.hasSubscribers || endCh.hasSubscribers;
}

/**
 * Runs `run` with start/end published around it. The caller checked
 * {@link tracing} first. The returned promise is the one the caller hands
 * out: its rejection stays the caller's to observe.
 */
export function traced<T>(rdma: Observed, operation: OperationName, bytes: number, run: () => Promise<T>): Promise<T> {
  const msg: { rdma: Observed; operation: OperationName; bytes: number; error: unknown } = { rdma, operation, bytes, error: undefined };
  startCh.publish(msg);
  let p: Promise<T>;
  try {
    p = run();
  } catch (e) {
    p = Promise.reject(e);
  }
  return p.then(
    (v) => {
      if (bytes === 0 && v !== null && typeof v === "object") msg.bytes = lengthOf(v);
      endCh.publish(msg);
      return v;
    },
    (e: unknown) => {
      msg.error = e;
      endCh.publish(msg);
      throw e;
    },
  );
}

function lengthOf(v: object): number {
  const m = "mr" in v ? (v as { mr: unknown }).mr : v;
  return m !== null && typeof m === "object" && "length" in m && typeof m.length === "number" ? m.length : 0;
}

/** A connection is handed out. */
export function opened(rdma: Observed): void {
  if (debug.enabled) debug("connection open: %s provider, device %s, peer %s:%d%s", rdma.provider, rdma.deviceName, rdma.peer.address, rdma.peer.port, rdma.peer.identity === null ? "" : ` (identity ${rdma.peer.identity})`);
  if (openCh.hasSubscribers) openCh.publish({ rdma });
}

/** A connection's resources are released; `error` is its failure, undefined for a clean close. */
export function ended(rdma: Observed, error: RdmaError | undefined): void {
  if (debug.enabled) {
    if (error === undefined) debug("connection closed: peer %s:%d", rdma.peer.address, rdma.peer.port);
    else debug("connection failed: peer %s:%d: %s: %s", rdma.peer.address, rdma.peer.port, error.code, error.message);
  }
  if (closeCh.hasSubscribers) closeCh.publish({ rdma, error });
  if (error !== undefined && errorCh.hasSubscribers) errorCh.publish({ rdma, error });
}
