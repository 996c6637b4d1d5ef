/**
 * The launcher the counter and kv demos share: starts the owner, and once it
 * prints "listening on PORT" (no sleeps), the clients, each as its own
 * process; prefixes every line with its process's tag; exits 0 when every
 * process did.
 */
import { spawn, type ChildProcess } from "node:child_process";

export interface Proc {
  tag: string;
  /** The compiled script and its arguments; "PORT" in an argument becomes the owner's port. */
  argv: string[];
}

export function runOwnerAndClients(owner: Proc, clients: Proc[], timeoutMs = 120_000): void {
  const children: ChildProcess[] = [];
  const codes = new Map<string, number | null>();
  const start = (p: Proc, port: string | null, onLine: (line: string) => void = () => {}): void => {
    const child = spawn(process.execPath, p.argv.map((a) => (port === null ? a : a.replace("PORT", port))), { stdio: ["ignore", "pipe", "pipe"] });
    children.push(child);
    let rest = "";
    child.stdout.on("data", (d: Buffer) => {
      const lines = (rest + d.toString()).split("\n");
      rest = lines.pop()!;
      for (const line of lines) {
        console.log(`[${p.tag}] ${line}`);
        onLine(line);
      }
    });
    child.stderr.on("data", (d: Buffer) => process.stderr.write(d.toString().replace(/^(?=.)/gm, `[${p.tag}] `)));
    child.on("exit", (code) => {
      if (rest) console.log(`[${p.tag}] ${rest}`);
      codes.set(p.tag, code);
      if (code !== 0) for (const c of children) c.kill(); // one failed: stop the rest
      if (codes.size === 1 + clients.length || (p === owner && children.length === 1)) finish();
    });
  };
  const deadline = setTimeout(() => {
    console.error(`timed out after ${timeoutMs / 1000} s`);
    for (const c of children) c.kill();
  }, timeoutMs);
  const finish = (): void => {
    clearTimeout(deadline);
    const failed = [...codes].filter(([, c]) => c !== 0);
    console.log(failed.length === 0 ? "all processes finished" : `FAILED: ${failed.map(([t, c]) => `${t} exited ${c}`).join(", ")}`);
    process.exit(failed.length === 0 && codes.size === 1 + clients.length ? 0 : 1);
  };
  let started = false;
  start(owner, null, (line) => {
    const m = /listening on (\d+)/.exec(line);
    if (m && !started) {
      started = true;
      for (const c of clients) start(c, m[1]!);
    }
  });
}
