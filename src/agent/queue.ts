import { RdmaError } from "../errors.js";
import { abortableWait, type Settle } from "../transport/wait.js";

/**
 * Abortable waits: every wait of the agent and the layers above it goes
 * through `abortableWait` (transport/wait.ts, the lowest layer that waits;
 * re-exported here) or the helpers built on it here.
 */
export { abortError, abortableWait, type Settle, type WaitOptions } from "../transport/wait.js";

/**
 * A FIFO of values with waiters; a failure rejects current and future waiters.
 */
export class AsyncQueue<T> {
  private items: T[] = [];
  private waiters: Settle<T>[] = [];
  private failure: RdmaError | null = null;

  constructor(private readonly what: string) {}

  get length(): number {
    return this.items.length;
  }

  push(v: T): void {
    const w = this.waiters.shift();
    if (w) w.resolve(v);
    else this.items.push(v);
  }

  /** Next value; rejects with ABORTED on the signal, TIMEOUT after timeoutMs, or the queue's failure. */
  take(opts: { signal?: AbortSignal | undefined; timeoutMs?: number | undefined } = {}): Promise<T> {
    if (this.items.length > 0) return Promise.resolve(this.items.shift()!);
    if (this.failure) return Promise.reject(this.failure);
    const { signal, timeoutMs } = opts;
    return abortableWait<T>((w) => this.waiters.push(w), {
      signal,
      timeoutMs,
      onTimeout: (w) => w.reject(new RdmaError("TIMEOUT", `${this.what}: nothing arrived within ${timeoutMs} ms`)),
      cleanup: (w) => {
        const i = this.waiters.indexOf(w);
        if (i >= 0) this.waiters.splice(i, 1);
      },
    });
  }

  /** Rejects every waiter now and later (values already queued are still delivered). */
  fail(e: RdmaError): void {
    if (!this.failure) this.failure = e;
    for (const w of this.waiters.splice(0)) w.reject(e);
  }

  drain(): T[] {
    return this.items.splice(0);
  }
}

/** Races a promise against an AbortSignal and an optional timeout. */
export function withDeadline<T>(p: Promise<T>, what: string, signal?: AbortSignal, timeoutMs?: number): Promise<T> {
  if (!signal && timeoutMs === undefined) return p;
  return abortableWait<T>((w) => p.then(w.resolve, w.reject), { signal, timeoutMs, what });
}

/**
 * One abort listener per signal, however many operations share it: a
 * thousand operations in flight with one AbortSignal add one listener, not a
 * thousand (Node warns past ten), and each operation's entry goes when the
 * operation ends.
 */
export class AbortWatch {
  private readonly watched = new Map<AbortSignal, { fns: Set<() => void>; listener: () => void }>();

  /** Calls `fn` when `signal` aborts, until the returned function is called. */
  add(signal: AbortSignal, fn: () => void): () => void {
    let w = this.watched.get(signal);
    if (!w) {
      const fns = new Set<() => void>();
      const entry = {
        fns,
        listener: () => {
          this.watched.delete(signal);
          for (const f of [...fns]) f();
          fns.clear();
        },
      };
      signal.addEventListener("abort", entry.listener, { once: true });
      this.watched.set(signal, entry);
      w = entry;
    }
    const entry = w;
    entry.fns.add(fn);
    return () => {
      if (!entry.fns.delete(fn) || entry.fns.size > 0) return;
      if (this.watched.get(signal) === entry) {
        this.watched.delete(signal);
        signal.removeEventListener("abort", entry.listener);
      }
    };
  }
}
