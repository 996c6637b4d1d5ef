/**
 * Native errors as RdmaError: the addon throws plain Errors with an `errno`
 * property (an errno name such as "EINVAL", or "DESTROYED" for a released
 * object), and post calls return an errno number; both map to one code table.
 */
import { RdmaError, type RdmaErrorCode } from "../../errors.js";
import type { NativeAddon } from "./native.js";

const ERRNO_CODE: Record<string, RdmaErrorCode> = {
  EINVAL: "INVALID_ARGUMENT",
  EOPNOTSUPP: "INVALID_ARGUMENT",
  ENOMEM: "RESOURCE_EXHAUSTED",
  EAGAIN: "RESOURCE_EXHAUSTED",
  ENOSPC: "RESOURCE_EXHAUSTED",
  EBUSY: "INVALID_STATE",
  DESTROYED: "INVALID_STATE",
  EPERM: "DEVICE",
  EACCES: "DEVICE",
  ENODEV: "DEVICE",
};

/** A native error (Error with an errno name) as an RdmaError. */
export function nativeError(e: unknown, what: string): RdmaError {
  if (e instanceof RdmaError) return e;
  const errno = typeof (e as { errno?: unknown })?.errno === "string" ? ((e as { errno: string }).errno as string) : undefined;
  const msg = e instanceof Error ? e.message : String(e);
  return new RdmaError(errno ? (ERRNO_CODE[errno] ?? "DEVICE") : "DEVICE", `${what}: ${msg}`, errno === undefined ? { cause: e } : { errnoName: errno, cause: e });
}

export function errnoError(addon: NativeAddon, rc: number, what: string): RdmaError {
  const name = addon.errnoName(rc);
  return new RdmaError(ERRNO_CODE[name] ?? "DEVICE", `${what} (${name})`, { errnoName: name });
}
