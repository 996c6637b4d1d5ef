/**
 * Work-completion statuses as typed errors: the code each status maps to,
 * and the advice a user needs for the fatal ones.
 */
import { RdmaError, type RdmaErrorCode } from "../errors.js";
import { WcStatus, wcStatusName } from "../transport/types.js";

export function codeOfStatus(s: number): RdmaErrorCode {
  switch (s) {
    case WcStatus.REM_ACCESS_ERR:
      return "REMOTE_ACCESS";
    case WcStatus.REM_INV_REQ_ERR:
      return "REMOTE_INVALID_REQUEST";
    case WcStatus.REM_OP_ERR:
      return "REMOTE_OPERATION";
    case WcStatus.RETRY_EXC_ERR:
      return "RETRY_EXCEEDED";
    case WcStatus.RNR_RETRY_EXC_ERR:
      return "RNR_RETRY_EXCEEDED";
    case WcStatus.WR_FLUSH_ERR:
      return "FLUSHED";
    case WcStatus.LOC_PROT_ERR:
      return "LOCAL_PROTECTION";
    case WcStatus.LOC_LEN_ERR:
      return "LOCAL_LENGTH";
    default:
      return "DEVICE";
  }
}

const ADVICE: Partial<Record<RdmaErrorCode, string>> = {
  REMOTE_ACCESS: "the peer refused the access (bad rkey, out of bounds, missing access, or a revoked lease); the connection is no longer usable",
  RETRY_EXCEEDED: "the peer did not answer (dead, unreachable or its QP was destroyed); reconnect",
  RNR_RETRY_EXCEEDED: "the peer had no receive posted for too long",
  FLUSHED: "the connection had already failed",
};

/** The error of an operation `what` that completed with `status` (not a flush of an already failed connection). */
export function statusError(status: number, what: string): RdmaError {
  const code = codeOfStatus(status);
  return new RdmaError(code, `${what} failed with ${wcStatusName(status)}${ADVICE[code] ? `: ${ADVICE[code]}` : ""}`, { wcStatus: wcStatusName(status) });
}
