/**
 * Child node processes for multi-process tests: wait on what they print and
 * on their exit, each wait bounded by a generous deadline (a failure bound,
 * never a sleep).
 */
import { spawn, type ChildProcess } from "node:child_process";

export interface Kid {
  readonly child: ChildProcess;
  /** Everything printed on stdout so far. */
  readonly out: () => string;
  /** Resolves with the first match of `re` in stdout; rejects if the process exits first or `ms` pass. */
  waitFor(re: RegExp, ms: number): Promise<RegExpExecArray>;
  /** Resolves with the exit code (signal: null); rejects after `ms`. */
  exited(ms: number): Promise<number | null>;
  /** Writes a line to the process's stdin. */
  tell(line: string): void;
}

export function spawnNode(script: string, args: string[], tag = script): Kid {
  const child = spawn(process.execPath, [script, ...args], { stdio: ["pipe", "pipe", "pipe"] });
  let out = "";
  let err = "";
  let code: number | null | undefined;
  const waiters = new Set<() => void>();
  const poke = (): void => waiters.forEach((w) => w());
  child.stdout!.on("data", (d: Buffer) => ((out += d), poke()));
  child.stderr!.on("data", (d: Buffer) => (err += d));
  child.on("exit", (c) => ((code = c), poke()));
  child.stdin!.on("error", () => {}); // the process may be gone
  const wait = <T>(check: () => T | undefined, ms: number, what: string): Promise<T> =>
    new Promise<T>((resolve, reject) => {
      const done = (): void => {
        waiters.delete(done);
        clearTimeout(timer);
      };
      const timer = setTimeout(() => (done(), reject(new Error(`${tag}: timed out after ${ms} ms waiting for ${what}\nstdout:\n${out}\nstderr:\n${err}`))), ms);
      const test = (): void => {
        const v = check();
        if (v !== undefined) return void (done(), resolve(v));
        if (code !== undefined) (done(), reject(new Error(`${tag}: exited (${code}) before ${what}\nstdout:\n${out}\nstderr:\n${err}`)));
      };
      waiters.add(test);
      test();
    });
  return {
    child,
    out: () => out,
    waitFor: (re, ms) => wait(() => re.exec(out) ?? undefined, ms, String(re)),
    exited: (ms) =>
      code !== undefined
        ? Promise.resolve(code)
        : new Promise((resolve, reject) => {
            const timer = setTimeout(() => reject(new Error(`${tag}: did not exit within ${ms} ms\nstdout:\n${out}\nstderr:\n${err}`)), ms);
            child.once("exit", (c) => (clearTimeout(timer), resolve(c)));
          }),
    tell: (line) => void child.stdin!.write(line + "\n"),
  };
}

/**
 * Resolves at the first line `stream` reads that matches `re`, or at its end
 * (the parent is gone: a child must not outlive it).
 */
export function lineFrom(stream: NodeJS.ReadableStream, re: RegExp): Promise<void> {
  return new Promise((resolve) => {
    let buf = "";
    const done = (): void => {
      stream.off("data", on);
      stream.off("end", done);
      resolve();
    };
    const on = (d: Buffer | string): void => {
      buf += d.toString();
      if (re.test(buf)) done();
    };
    stream.on("data", on);
    stream.on("end", done);
  });
}
