/**
 * What an operation of {@link Rdma} may be given, checked before anything
 * reaches the agent: options objects, immediates, atomics' operands, abort
 * signals, and the memory an operation names.
 *
 * Invariant: a call that is refused is refused synchronously, with
 * INVALID_ARGUMENT (or the connection's own state error), before any work
 * request exists; the public method turns the throw into its rejected
 * promise ({@link guard}). A LocalMr is usable only on the protection domain
 * it was registered in; a plain buffer is staged into the connection's
 * staging memory, released exactly once (reused once the operation settles).
 */
import type { Staging } from "./staging.js";
import { RdmaError, checkInt } from "../errors.js";
import type { Connection } from "../agent/connection.js";
import type { ProtectionDomain } from "../transport/types.js";
import { LocalMr, RemoteMr } from "../memory/mr.js";

/**
 * Bytes to send or write: a LocalMr (zero-copy: the device reads it where
 * it is), or any Uint8Array, Buffer or DataView (copied into registered
 * memory first, as UCX's eager path copies; pooled Buffers included).
 */
export type SendData = LocalMr | ArrayBufferView;

/** Options every operation takes. */
export interface OpOptions {
  /** Aborts the operation while it has not been posted (rejects with ABORTED). */
  signal?: AbortSignal;
}

/** @internal */
/** Options objects: absent or an object (null, numbers and strings are misuse). */
export function optsOf<T extends object>(o: T | undefined | null, what: string): Partial<T> {
  if (o === undefined) return {};
  if (o === null || typeof o !== "object") throw new RdmaError("INVALID_ARGUMENT", `${what}: options must be an object, got ${o === null ? "null" : typeof o}`);
  return o;
}

/** @internal */
export function checkImm(v: unknown): number {
  return checkInt("imm", v, 0, 0xffffffff);
}

/** @internal */
export function checkBig(v: unknown, name: string): bigint {
  if (typeof v !== "bigint") throw new RdmaError("INVALID_ARGUMENT", `${name} must be a bigint`);
  return BigInt.asUintN(64, v);
}

/** @internal */
export function signalOf(o: OpOptions | undefined | null, what = "operation"): AbortSignal | undefined {
  // No options (the common call): nothing to check, nothing allocated.
  if (o === undefined) return undefined;
  const s = optsOf(o, what).signal;
  if (s !== undefined && !(s instanceof AbortSignal)) throw new RdmaError("INVALID_ARGUMENT", "signal must be an AbortSignal");
  return s;
}

/** @internal */
/** Bytes an operation on `data` moves (tracing only). */
export function sizeOf(data: unknown): number {
  return data instanceof LocalMr ? data.length : ArrayBuffer.isView(data) ? data.byteLength : 0;
}

/** @internal */
/** Settles a promise that may throw synchronously into a rejected promise. */
export function guard<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return fn();
  } catch (e) {
    return Promise.reject(e);
  }
}

/** @internal */
/**
 * A LocalMr this connection may use: its memory must be registered in this
 * connection's protection domain (allocated or registered on it, on a
 * newConnection() sibling, or received on it). Memory of another
 * connection would fail on the device (a local protection error that kills
 * the connection): refused here, INVALID_ARGUMENT, nothing posted.
 */
export function localMrOf(conn: Connection, pd: ProtectionDomain, v: unknown, name: string, what: string): LocalMr {
  // A closed connection says so first, whatever memory the call names (its own is freed by now).
  conn.checkOpen(what);
  if (!(v instanceof LocalMr)) throw new RdmaError("INVALID_ARGUMENT", `${name} must be a LocalMr (from allocLocalMr, registerMr or receive)${what === "read" || what === "sendLocalMr" || what === "share" ? "" : ", or a Uint8Array, Buffer or DataView (copied)"}`);
  v.mem.check(name); // disposed, lent, or freed with its connection: INVALID_STATE
  if (v.mem.alloc.mr.pd !== pd) {
    throw new RdmaError("INVALID_ARGUMENT", `${name} belongs to another connection (another protection domain): use memory allocated, registered or received on this connection or a newConnection() sibling, or copy it`);
  }
  return v;
}

/** @internal */
/** A RemoteMr; whether this connection may use it (the one it came from) is the agent's check (OneSided.checkRemote, agent/one-sided.ts). */
export function remoteMrOf(v: unknown, name: string): RemoteMr {
  if (!(v instanceof RemoteMr)) throw new RdmaError("INVALID_ARGUMENT", `${name} must be a RemoteMr (from requestRemoteMr or receiveRemoteMr)`);
  return v;
}

/** @internal */
/**
 * A plain buffer copied into the connection's staging memory (staging.ts:
 * reused once the operation settles, never detached: no view of it escapes),
 * released by the caller once the operation is made.
 */
export function staged(conn: Connection, v: unknown, what: string, staging: Staging): LocalMr {
  conn.checkOpen(what);
  if (!ArrayBuffer.isView(v)) throw new RdmaError("INVALID_ARGUMENT", `${what}: the data must be a LocalMr, or a Uint8Array, Buffer or DataView (copied), got ${v === null ? "null" : typeof v}`);
  return staging.copy(v);
}

/** @internal */
/** Runs an operation on staged memory and frees it once the operation settles (or throws). */
export function released(lmr: LocalMr, op: () => Promise<void>): Promise<void> {
  let p: Promise<void>;
  try {
    p = op();
  } catch (e) {
    lmr.dispose();
    throw e;
  }
  return p.finally(() => lmr.dispose());
}
