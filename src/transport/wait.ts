/**
 * The one abortable wait (signal + timeout) of the whole library: the agent,
 * the RDMA CM wrapper of the verbs provider and the RPC client all wait
 * through `abortableWait`. It sits in the transport seam, the lowest layer
 * that waits (verbs/cm.ts), so every layer above imports it downward;
 * agent/queue.ts re-exports it beside the helpers built on it.
 *
 * Invariant: a wait ends exactly once, by its event, an abort or its
 * timeout, whichever comes first; the abort listener, the timer and the
 * wait's cleanup go with it however it ends.
 */
import { RdmaError } from "../errors.js";

/** The ABORTED error of an aborted signal (its reason as the cause). */
export function abortError(signal: AbortSignal): RdmaError {
  const r: unknown = signal.reason;
  return new RdmaError("ABORTED", `operation aborted${r instanceof Error ? `: ${r.message}` : ""}`, { cause: r });
}

/** The two ends of a pending wait; the first call settles it, later ones do nothing. */
export interface Settle<T> {
  resolve(v: T): void;
  reject(e: unknown): void;
}

export interface WaitOptions<T> {
  signal?: AbortSignal | undefined;
  /**
   * When `signal` aborts (or is already aborted when the wait starts), this
   * runs instead of the default (reject with {@link abortError}): a wait
   * with a message of its own, or one that must tell someone first.
   */
  onAbort?: ((s: Settle<T>) => void) | undefined;
  /** After this long, `onTimeout` runs (default: reject with TIMEOUT naming `what`). */
  timeoutMs?: number | undefined;
  onTimeout?: ((s: Settle<T>) => void) | undefined;
  /** Names the wait in the default TIMEOUT message. */
  what?: string;
  /** Unregisters the wait from whatever would have ended it; runs once, however it ends. */
  cleanup?: ((s: Settle<T>) => void) | undefined;
}

/**
 * The one abortable wait. `start` registers the wait with whatever ends it
 * (a message, a completion, a queue) and gets its two ends. It also ends when
 * `signal` aborts (ABORTED) or after `timeoutMs`, whichever comes first, and
 * exactly once: the abort listener, the timer and `cleanup` go with it
 * however it ends. A signal already aborted rejects before `start` runs.
 */
export function abortableWait<T>(start: (s: Settle<T>) => void, opts: WaitOptions<T> = {}): Promise<T> {
  const { signal, timeoutMs, onTimeout, cleanup } = opts;
  return new Promise<T>((resolve, reject) => {
    let done = false;
    let timer: NodeJS.Timeout | null = null;
    const end = (): boolean => {
      if (done) return false;
      done = true;
      if (timer !== null) clearTimeout(timer);
      if (signal) signal.removeEventListener("abort", onAbort);
      cleanup?.(s);
      return true;
    };
    const s: Settle<T> = {
      resolve: (v) => {
        if (end()) resolve(v);
      },
      reject: (e) => {
        if (end()) reject(e);
      },
    };
    const onAbort = (): void => (opts.onAbort ? opts.onAbort(s) : s.reject(abortError(signal!)));
    if (signal) {
      if (signal.aborted) return onAbort();
      signal.addEventListener("abort", onAbort, { once: true });
    }
    if (timeoutMs !== undefined) {
      timer = setTimeout(() => (onTimeout ? onTimeout(s) : s.reject(new RdmaError("TIMEOUT", `${opts.what ?? "the wait"} did not finish within ${timeoutMs} ms`))), timeoutMs);
    }
    // A start that throws ends the wait like any other end: timer, listener and cleanup go with it.
    try {
      start(s);
    } catch (e) {
      s.reject(e);
    }
  });
}
