/**
 * The demo: starts the lab server and client as two processes and shows both
 * outputs. The client starts when the server prints its port (no sleeps).
 * Run: npm run demo   (ASYNC_RDMA_PROVIDER / RdmaBuilder default "auto": verbs if a device is up, else tcp)
 */
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";

const here = dirname(fileURLToPath(import.meta.url));
const host = process.argv[2] ?? "127.0.0.1";

function prefix(tag: string, chunk: Buffer): void {
  for (const line of chunk.toString().split("\n")) if (line) console.log(`${tag} ${line}`);
}

const server = spawn(process.execPath, [join(here, "server.js"), `${host}:0`], { stdio: ["ignore", "pipe", "pipe"] });
let client: ReturnType<typeof spawn> | null = null;
server.stderr.on("data", (c: Buffer) => prefix("[server]", c));
server.stdout.on("data", (c: Buffer) => {
  prefix("[server]", c);
  const m = /listening on (\d+)/.exec(c.toString());
  if (m && !client) {
    client = spawn(process.execPath, [join(here, "client.js"), `${host}:${m[1]}`], { stdio: ["ignore", "pipe", "pipe"] });
    client.stdout!.on("data", (d: Buffer) => prefix("[client]", d));
    client.stderr!.on("data", (d: Buffer) => prefix("[client]", d));
    client.on("exit", (code) => done("client", code));
  }
});
server.on("exit", (code) => done("server", code));

const codes: Record<string, number | null> = {};
const deadline = setTimeout(() => {
  console.error("demo: timed out after 60 s");
  server.kill();
  client?.kill();
  process.exit(1);
}, 60_000);
function done(who: string, code: number | null): void {
  codes[who] = code;
  if ("server" in codes && ("client" in codes || client === null)) {
    clearTimeout(deadline);
    const ok = codes.server === 0 && codes.client === 0;
    console.log(ok ? "demo: lab finished on both ends" : `demo: FAILED (server ${codes.server}, client ${codes.client})`);
    process.exit(ok ? 0 : 1);
  }
}
