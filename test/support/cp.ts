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
import { RpcClient, RpcServer, type RpcHandler } from "../../src/rpc/index.js";
import { RdmaBuilder, type LocalMr, type Rdma, type RdmaListener } from "../../src/index.js";

const here = dirname(fileURLToPath(import.meta.url));
export const MAIN = join(here, "..", "..", "src", "cli", "main.js");
export const DEADLINE = 30_000 * SLOW;
export { HOST, PROVIDER };

export function env(side: 0 | 1, extra: Record<string, string> = {}): NodeJS.ProcessEnv {
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

export function run(args: string[], opts: { side?: 0 | 1; env?: Record<string, string>; spawn?: SpawnOptions; main?: string } = {}): Proc {
  const child = spawn(process.execPath, [opts.main ?? MAIN, ...args], { stdio: ["ignore", "pipe", "pipe"], env: env(opts.side ?? 1, opts.env), ...opts.spawn });
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
  // writable unless the test says --read-only (serve's default is read-only)
  const p = run(["serve", dir, "-p", "0", "--bind", HOST, ...(args.includes("--read-only") ? [] : ["--writable"]), ...args], { side: 0, spawn: spawnOpts });
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
  const proc = run([String(bytes), "--json", ...args], { main: join(here, "cp-stop.js") });
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

/** A connection to a server speaking the cp protocol by hand: JSON calls, each with a deadline. */
export interface RawClient {
  rdma: Rdma;
  rpc: RpcClient;
  /** Calls `method` with the JSON `o`; resolves to the JSON answer (rejects with the server's error). */
  call(method: string, o: unknown, timeoutMs?: number): Promise<Record<string, unknown>>;
  close(): Promise<void>;
}

/**
 * A builder as the cp and serve commands make one (the provider and device
 * of the side under test, the default connection manager), for peers in the
 * test's own process that talk to them.
 */
function cliBuilder(side: 0 | 1): RdmaBuilder {
  const b = new RdmaBuilder().setProvider(PROVIDER);
  const dev = deviceNames()[side];
  if (PROVIDER === "verbs" && dev) b.setDevice(dev);
  return b;
}

export async function rawClient(port: number): Promise<RawClient> {
  const rdma = await cliBuilder(1).connect({ host: HOST, port });
  const rpc = new RpcClient(rdma);
  return {
    rdma,
    rpc,
    call: async (method, o, timeoutMs = DEADLINE) => JSON.parse(new TextDecoder().decode(await rpc.call(method, new TextEncoder().encode(JSON.stringify(o)), { timeoutMs }))) as Record<string, unknown>,
    close: async () => void (await rdma.close().catch(() => {})),
  };
}

/** What a fake server's handler sees: the call's JSON and the connection's ring (shared as "cp-ring"). */
export type FakeHandler = (o: Record<string, unknown>, ring: LocalMr) => unknown;

export interface FakeServer {
  port: number;
  at(path?: string): string;
  close(): Promise<void>;
}

/**
 * An in-process server that speaks the cp protocol with handlers the test
 * writes (a hostile server): `hello` is answered as serve does (a ring of
 * chunk × depth shared as "cp-ring") unless the test gives its own.
 */
export async function fakeServer(handlers: Record<string, FakeHandler>): Promise<FakeServer> {
  const listener: RdmaListener = await cliBuilder(0).bind(`${HOST}:0`);
  const conns = new Set<Rdma>();
  void (async () => {
    for await (const rdma of listener) {
      conns.add(rdma);
      let ring: LocalMr | null = null;
      const json =
        (fn: (o: Record<string, unknown>) => unknown): RpcHandler =>
        async (p) => new TextEncoder().encode(JSON.stringify(await fn(JSON.parse(new TextDecoder().decode(p)) as Record<string, unknown>)));
      const table: Record<string, RpcHandler> = {
        hello: json((o) => {
          const chunk = Number(o.chunk);
          const depth = Number(o.depth);
          ring = rdma.allocLocalMr(chunk * depth);
          rdma.share("cp-ring", ring, { access: "read" });
          return { version: 1, chunk, depth, ring: "cp-ring", readOnly: false };
        }),
      };
      for (const [name, fn] of Object.entries(handlers)) table[name] = json((o) => fn(o, ring!));
      void new RpcServer(table)
        .serve(rdma)
        .catch(() => {})
        .finally(() => conns.delete(rdma));
    }
  })().catch(() => {});
  return {
    port: listener.port,
    at: (path = "") => `${HOST}:${listener.port}:${path}`,
    async close() {
      await Promise.allSettled([...conns].map((c) => c.close()));
      await listener.close().catch(() => {});
    },
  };
}
