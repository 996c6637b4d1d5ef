/**
 * `async-rdma serve` and `async-rdma cp` as real child processes, for the
 * cp tests: the provider under test goes through the environment
 * (ASYNC_RDMA_PROVIDER, ASYNC_RDMA_DEVICE: server on side A's device, cp on
 * side B's), every wait bounded by a deadline.
 */
import { spawn, type SpawnOptions } from "node:child_process";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { PROVIDER, deviceNames, SLOW } from "./seam.js";
import { HOST } from "./api.js";

const here = dirname(fileURLToPath(import.meta.url));
export const MAIN = join(here, "..", "..", "src", "cli", "main.js");
export const DEADLINE = 30_000 * SLOW;
export { HOST, PROVIDER };

function env(side: 0 | 1, extra: Record<string, string> = {}): NodeJS.ProcessEnv {
  const dev = deviceNames()[side];
  return { ...process.env, ASYNC_RDMA_PROVIDER: PROVIDER, ...(PROVIDER === "verbs" && dev ? { ASYNC_RDMA_DEVICE: dev } : {}), ...extra };
}

export interface Proc {
  readonly pid: number;
  out(): string;
  err(): string;
  /** Resolves with the first match of `re` on stdout; rejects if the process exits first or the deadline passes. */
  waitFor(re: RegExp, ms?: number): Promise<RegExpExecArray>;
  /** Resolves with the exit code (a signal: its name); rejects after `ms`. */
  exited(ms?: number): Promise<number | string>;
  kill(sig?: NodeJS.Signals): void;
}

export function run(args: string[], opts: { side?: 0 | 1; env?: Record<string, string>; spawn?: SpawnOptions } = {}): Proc {
  const child = spawn(process.execPath, [MAIN, ...args], { stdio: ["ignore", "pipe", "pipe"], env: env(opts.side ?? 1, opts.env), ...opts.spawn });
  let out = "";
  let err = "";
  let status: number | string | undefined;
  const waiters = new Set<() => void>();
  const poke = (): void => waiters.forEach((w) => w());
  child.stdout!.on("data", (d: Buffer) => ((out += d), poke()));
  child.stderr!.on("data", (d: Buffer) => ((err += d), poke()));
  child.on("exit", (c, sig) => ((status = c ?? sig ?? "?"), poke()));
  const wait = <T>(check: () => T | undefined, ms: number, what: string): Promise<T> =>
    new Promise<T>((resolve, reject) => {
      const done = (): void => {
        waiters.delete(test);
        clearTimeout(timer);
      };
      const timer = setTimeout(() => (done(), reject(new Error(`${args[0]}: timed out after ${ms} ms waiting for ${what}\nstdout:\n${out}\nstderr:\n${err}`))), ms);
      const test = (): void => {
        const v = check();
        if (v !== undefined) return void (done(), resolve(v));
        if (status !== undefined) (done(), reject(new Error(`${args[0]}: exited (${status}) before ${what}\nstdout:\n${out}\nstderr:\n${err}`)));
      };
      waiters.add(test);
      test();
    });
  return {
    pid: child.pid!,
    out: () => out,
    err: () => err,
    waitFor: (re, ms = DEADLINE) => wait(() => re.exec(out) ?? undefined, ms, String(re)),
    // the exit event comes before the pipes are drained: wait for both
    exited: (ms = DEADLINE) => wait(() => (status !== undefined && child.stdout!.readableEnded && child.stderr!.readableEnded ? status : undefined), ms, "exit").catch((e: Error) => {
      if (status !== undefined) return status;
      throw e;
    }),
    kill: (sig = "SIGKILL") => void child.kill(sig),
  };
}

export interface Server extends Proc {
  port: number;
  /** "HOST:port:" followed by a path: a remote path for cp. */
  at(path?: string): string;
}

export async function serve(dir: string, args: string[] = [], spawnOpts: SpawnOptions = {}): Promise<Server> {
  const p = run(["serve", dir, "-p", "0", "--bind", HOST, ...args], { side: 0, spawn: spawnOpts });
  const m = await p.waitFor(/ on .*:(\d+)/);
  const port = Number(m[1]);
  return { ...p, port, at: (path = "") => `${HOST}:${port}:${path}` };
}

export interface CpResult {
  code: number | string;
  out: string;
  err: string;
  /** The --json result line (when --json was given). */
  result: Record<string, unknown> | null;
  errors: Record<string, unknown>[];
}

function parse(code: number | string, out: string, err: string): CpResult {
  const lines = out
    .split("\n")
    .filter((l) => l.startsWith("{"))
    .map((l) => JSON.parse(l) as Record<string, unknown>);
  return { code, out, err, result: lines.find((l) => l.type === "result") ?? null, errors: lines.filter((l) => l.type === "error") };
}

/** Runs `async-rdma cp --json …` to the end. */
export async function cp(args: string[], env: Record<string, string> = {}): Promise<CpResult> {
  const p = run(["cp", "--json", ...args], { env });
  const code = await p.exited();
  return parse(code, p.out(), p.err());
}

/**
 * Resolves once the process is in the stopped state (it printed "stopped"
 * just before raising SIGSTOP on itself; a SIGCONT sent earlier would be
 * lost). Linux: the state letter of /proc/<pid>/stat; checked on a short
 * timer, bounded by the deadline.
 */
export function stopped(pid: number, ms = DEADLINE): Promise<void> {
  const t0 = performance.now();
  return new Promise((resolve, reject) => {
    const check = (): void => {
      let state = "";
      try {
        state = /^\d+ \(.*\) (\w)/s.exec(readFileSync(`/proc/${pid}/stat`, "utf8"))?.[1] ?? "";
      } catch {
        return reject(new Error(`process ${pid} is gone`));
      }
      if (state === "T") return resolve();
      if (performance.now() - t0 > ms) return reject(new Error(`process ${pid} did not stop within ${ms} ms (state ${state})`));
      setTimeout(check, 2);
    };
    check();
  });
}

/** A cp that stops itself (SIGSTOP) after `bytes` were copied; the caller decides what happens next. */
export async function cpStopped(args: string[], bytes: number): Promise<{ proc: Proc; finish(): Promise<CpResult> }> {
  const proc = run(["cp", "--json", ...args], { env: { ASYNC_RDMA_CP_STOP_AFTER: String(bytes) } });
  await proc.waitFor(/"type":"stopped"/);
  await stopped(proc.pid);
  return {
    proc,
    async finish() {
      const code = await proc.exited();
      return parse(code, proc.out(), proc.err());
    },
  };
}
