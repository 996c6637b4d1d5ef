/**
 * Fuzz and churn test support: seeds and run counts (reproducible by
 * default, env knobs to explore), forced GC, RSS and file-descriptor counts,
 * resource tables of a device of either provider, and a watch for unhandled
 * rejections and uncaught exceptions.
 *
 *   ASYNC_RDMA_FUZZ_SEED=<int>     seed of every property (default: fixed per property); "random" picks one (printed)
 *   ASYNC_RDMA_FUZZ_RUNS=<factor>  multiplies every property's default run count (default 1; e.g. 10 to explore)
 */
import v8 from "node:v8";
import vm from "node:vm";
import { readdirSync } from "node:fs";
import { contextStats } from "../../src/api/context.js";
import { peerMemoryUsage } from "../../src/index.js";
import type { Device } from "../../src/transport/types.js";
import { PROVIDER } from "./seam.js";

v8.setFlagsFromString("--expose-gc");
/** The real gc(), whatever flags the test process was started with. */
export const gc = vm.runInNewContext("gc") as () => void;

const RANDOM_SEED = Math.floor(Math.random() * 0x7fffffff);

/** The seed of a property: ASYNC_RDMA_FUZZ_SEED if set, else the property's fixed default. */
export function fuzzSeed(fixed: number): number {
  const v = process.env.ASYNC_RDMA_FUZZ_SEED;
  if (v === undefined || v === "") return fixed;
  if (v === "random") return RANDOM_SEED;
  const n = Number(v);
  if (!Number.isInteger(n)) throw new Error(`ASYNC_RDMA_FUZZ_SEED must be an integer or "random", got ${JSON.stringify(v)}`);
  return n;
}

/** Run-count multiplier (ASYNC_RDMA_FUZZ_RUNS). */
export const RUNS_FACTOR = ((): number => {
  const v = process.env.ASYNC_RDMA_FUZZ_RUNS;
  if (v === undefined || v === "") return 1;
  const n = Number(v);
  if (!(n > 0)) throw new Error(`ASYNC_RDMA_FUZZ_RUNS must be a positive number (a factor), got ${JSON.stringify(v)}`);
  return n;
})();

/** `tcp` runs on tcp, `verbs` on verbs (the guest is 4–7× slower), both times the factor. */
export function runs(tcp: number, verbs: number): number {
  return Math.max(1, Math.round((PROVIDER === "verbs" ? verbs : tcp) * RUNS_FACTOR));
}

/** fast-check parameters for a property: its seed and run count, and how to reproduce a failure. */
export function fcParams(fixedSeed: number, numRuns: number): { seed: number; numRuns: number; endOnFailure: boolean; includeErrorInReport: boolean } {
  if (process.env.ASYNC_RDMA_FUZZ_SEED) console.log(`# fuzz seed ${fuzzSeed(fixedSeed)} (ASYNC_RDMA_FUZZ_SEED=${process.env.ASYNC_RDMA_FUZZ_SEED}), ${numRuns} runs`);
  // No shrinking by default: cases share connections and devices, so a shrunk case is not a replay (ASYNC_RDMA_FUZZ_SHRINK=1 tries anyway).
  return { seed: fuzzSeed(fixedSeed), numRuns, endOnFailure: process.env.ASYNC_RDMA_FUZZ_SHRINK !== "1", includeErrorInReport: true };
}

/** A short printable form of bytes for counterexamples: hex of the first `max` bytes and the length. */
export function hex(b: Uint8Array, max = 48): string {
  const h = Buffer.from(b.buffer, b.byteOffset, Math.min(b.length, max)).toString("hex");
  return `${b.length}B:${h}${b.length > max ? "…" : ""}`;
}

const tick = (): Promise<void> => new Promise((r) => setImmediate(r));

/** Forces full GCs (with turns in between, so finalizers and freed external memory settle); returns RSS in MiB. */
export async function settledRssMiB(): Promise<number> {
  for (let i = 0; i < 4; i++) {
    gc();
    await tick();
  }
  return process.memoryUsage().rss / 2 ** 20;
}

/** Open file descriptors of this process. */
export function fdCount(): number {
  return readdirSync("/proc/self/fd").length;
}

/**
 * What a device holds for connections, by provider: contexts (each a PD and
 * its pool), QPs, CQs (tcp: the device's table; verbs: not tracked in JS,
 * each one holds a completion-channel fd, counted by fdCount), keys/MRs, and
 * the process-wide peer memory budget in use.
 */
export interface Tables {
  contexts: number;
  qps: number;
  cqs: number;
  mrs: number;
  peerMemory: number;
}

export function tables(dev: Device | null): Tables {
  const t: Tables = { contexts: contextStats().live, qps: 0, cqs: -1, mrs: 0, peerMemory: peerMemoryUsage().used };
  if (!dev) return t;
  const d = dev as unknown as { qps?: Map<unknown, unknown>; keys?: Map<unknown, unknown>; mrs?: Map<unknown, unknown>; cqs?: Set<unknown> };
  t.qps = d.qps?.size ?? 0;
  t.mrs = (d.keys ?? d.mrs)?.size ?? 0;
  t.cqs = d.cqs?.size ?? -1;
  return t;
}

/**
 * Records unhandled rejections and uncaught exceptions while installed
 * (installing a listener keeps them from killing the test process, so the
 * test must call check()).
 */
export function watchUnhandled(): { check(): void; stop(): void } {
  const seen: string[] = [];
  const onRej = (e: unknown): void => void seen.push(`unhandled rejection: ${e instanceof Error ? (e.stack ?? e.message) : String(e)}`);
  const onExc = (e: unknown): void => void seen.push(`uncaught exception: ${e instanceof Error ? (e.stack ?? e.message) : String(e)}`);
  process.on("unhandledRejection", onRej);
  process.on("uncaughtExceptionMonitor", onExc);
  return {
    check() {
      if (seen.length > 0) throw new Error(`${seen.length} unhandled error(s):\n${seen.slice(0, 5).join("\n")}`);
    },
    stop() {
      process.off("unhandledRejection", onRej);
      process.off("uncaughtExceptionMonitor", onExc);
    },
  };
}

/** Rejects with `what` if `p` does not settle within `ms` (a hang is a failure, not a stuck suite). */
export function deadline<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let t: NodeJS.Timeout | undefined;
  return Promise.race([
    p.finally(() => clearTimeout(t)),
    new Promise<T>((_, reject) => {
      t = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
    }),
  ]);
}

/** Wakes waiters when something may have changed; each waiter re-checks its condition. */
export class Waiter {
  private pokes = new Set<() => void>();
  poke(): void {
    for (const p of [...this.pokes]) p();
  }
  /** Resolves once `cond()` holds; rejects after `ms` naming `what`. */
  until(cond: () => boolean, what: string, ms: number): Promise<void> {
    if (cond()) return Promise.resolve();
    return new Promise<void>((resolve, reject) => {
      const check = (): void => {
        if (!cond()) return;
        done();
        resolve();
      };
      const timer = setTimeout(() => {
        done();
        reject(new Error(`timed out after ${ms} ms waiting for ${what}`));
      }, ms);
      const done = (): void => {
        clearTimeout(timer);
        this.pokes.delete(check);
      };
      this.pokes.add(check);
    });
  }
}
