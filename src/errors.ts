/**
 * One error family for the whole library. Every error thrown or rejected by
 * async-rdma is an {@link RdmaError} with a stable `code`; where a verbs
 * work-completion status caused it, `wcStatus` carries that status name.
 *
 * Where a system call or a verbs call failed, the error follows Node's
 * convention for system errors: `errno` is the number (negative, as
 * `util.getSystemErrorName(e.errno)` expects), `errnoName` the name
 * ("EINVAL") and `syscall` the call, when known.
 *
 * This module sits below every layer (transport included): it imports only
 * node:os, for the errno numbers.
 */
import { constants } from "node:os";

/** The stable codes of RdmaError (see the guide's table of what each means). */
export type RdmaErrorCode =
  | "REMOTE_ACCESS"
  | "REMOTE_INVALID_REQUEST"
  | "REMOTE_OPERATION"
  | "LOCAL_PROTECTION"
  | "LOCAL_LENGTH"
  | "RETRY_EXCEEDED"
  | "RNR_RETRY_EXCEEDED"
  | "FLUSHED"
  | "LEASE_EXPIRED"
  | "QUOTA_EXCEEDED"
  | "CONNECTION_CLOSED"
  | "CONNECTION_REFUSED"
  | "ADDRESS_IN_USE"
  | "AUTH_FAILED"
  | "NOT_FOUND"
  | "PROTOCOL"
  | "PROVIDER_UNAVAILABLE"
  | "INVALID_ARGUMENT"
  | "INVALID_STATE"
  | "OUT_OF_RANGE"
  | "RESOURCE_EXHAUSTED"
  | "TIMEOUT"
  | "ABORTED"
  | "DEVICE";

/** Where an RdmaError came from. */
export interface RdmaErrorOptions {
  /** Name of the verbs work-completion status, e.g. "REM_ACCESS_ERR". */
  wcStatus?: string;
  /** errno name for failures of a system call or a verbs call (e.g. "EINVAL"); sets `errnoName` and `errno`. */
  errnoName?: string;
  /** The system or verbs call that failed (e.g. "connect", "ibv_post_send"). */
  syscall?: string;
  cause?: unknown;
}

/**
 * @example
 * try { await rdma.read(lmr, rmr); }
 * catch (e) { if (e instanceof RdmaError && e.code === "REMOTE_ACCESS") renegotiate(); }
 */
export class RdmaError extends Error {
  readonly code: RdmaErrorCode;
  readonly wcStatus: string | undefined;
  /** The errno number, negative as in Node's system errors (-22 for EINVAL); undefined when no system or verbs call failed, or the name is not an errno. */
  readonly errno: number | undefined;
  /** The errno name ("EINVAL"), or "DESTROYED" for a released native object. */
  readonly errnoName: string | undefined;
  /** The system or verbs call that failed, when known. */
  readonly syscall: string | undefined;

  /** An error with a stable `code`, a message saying what went wrong, and optionally the completion status and errno that caused it. */
  constructor(code: RdmaErrorCode, message: string, options: RdmaErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = "RdmaError";
    this.code = code;
    this.wcStatus = options.wcStatus;
    this.errnoName = options.errnoName;
    const n = options.errnoName === undefined ? undefined : (constants.errno as Record<string, number | undefined>)[options.errnoName];
    this.errno = n === undefined ? undefined : -n;
    this.syscall = options.syscall;
  }
}

/**
 * Whether `e` is an RdmaError (with `code`, when given).
 *
 * @example
 * if (isRdmaError(e, "LEASE_EXPIRED")) rmr = await rdma.requestRemoteMr(8);
 */
export function isRdmaError(e: unknown, code?: RdmaErrorCode): e is RdmaError {
  return e instanceof RdmaError && (code === undefined || e.code === code);
}

/** Throws INVALID_ARGUMENT unless `v` is an integer in [min, max]. */
export function checkInt(name: string, v: unknown, min: number, max: number): number {
  if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > max) {
    throw new RdmaError("INVALID_ARGUMENT", `${name} must be an integer in [${min}, ${max}], got ${String(v)}`);
  }
  return v;
}
