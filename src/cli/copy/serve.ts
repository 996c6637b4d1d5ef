/**
 * async-rdma serve [dir] [-p port] [--bind addr] [--writable] [--keep-setid] [--auth-key-file f] [--provider p]
 *
 * Serves one directory tree to `async-rdma cp`. Every path a client names is
 * confined to the tree (copy/paths.ts); each connection gets its own ring of
 * registered chunk buffers, shared with that connection only, and whatever it
 * holds (open files, the ring) is released when it ends, however it ends.
 * Uploads land under temporary names until complete and verified.
 */
import { lstat, realpath } from "node:fs/promises";
import { RpcServer } from "../../rpc/index.js";
import { builderFor, DEFAULT_BIND, DEFAULT_PORT, parseIntArg } from "./common.js";
import { CopyError } from "./paths.js";
import { MAX_DEPTH, sessions } from "./serve-rings.js";
import { Session } from "./serve-session.js";
import { handlers } from "./serve-handlers.js";

// The server's parts (each opens with what it owns): serve-rings.ts (the ring budget, fair
// shares, idle eviction), serve-session.ts (one connection's ring, slots, open files, end),
// serve-handlers.ts (the calls). SourceShares is re-exported for the tests.
export { SourceShares } from "./serve-rings.js";

/** Connections one client address may hold at once (--max-per-source). */
const DEFAULT_PER_SOURCE = 32;

export const USAGE = `usage: async-rdma serve [dir] [options]
Serves the directory tree \`dir\` (default: the current directory) to \`async-rdma cp\`.
Nothing outside it is readable or writable. By default the tree is served
read-only, on this machine only (127.0.0.1): --bind and --writable say otherwise.

  -p, --port <n>          port to listen on (default ${DEFAULT_PORT}; 0 picks a free one)
      --bind <addr>       address to listen on (default ${DEFAULT_BIND}; 0.0.0.0: every interface)
      --writable          accept uploads, new directories and links
      --read-only         refuse uploads and every change to the tree (the default)
      --keep-setid        keep the setuid/setgid bits of uploaded files and directories
                          (by default they are dropped)
      --auth-key-file <f> accept only clients that have this key (16 bytes or more)
      --max-per-source <n> connections one client address may hold at once (default ${DEFAULT_PER_SOURCE})
      --provider <p>      tcp, verbs or auto (default auto)
  -h, --help              this help
`;

function loopback(addr: string): boolean {
  return addr === "localhost" || addr === "::1" || /^127\./.test(addr) || /^::ffff:127\./i.test(addr);
}

export async function serve(args: string[]): Promise<void> {
  let dir: string | undefined;
  let port = DEFAULT_PORT;
  let bind = DEFAULT_BIND;
  let writable: boolean | undefined;
  let keepSetid = false;
  let keyFile: string | undefined;
  let provider: string | undefined;
  let perSource = DEFAULT_PER_SOURCE;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === "-h" || a === "--help") {
      process.stdout.write(USAGE);
      return;
    } else if (a === "-p" || a === "--port") port = parseIntArg(args[++i], a, 0, 65535);
    else if (a === "--bind") bind = args[++i] ?? "";
    else if (a === "--read-only" || a === "--writable") {
      if (writable !== undefined && writable !== (a === "--writable")) throw new CopyError("USAGE", "--read-only and --writable contradict each other");
      writable = a === "--writable";
    }
    else if (a === "--keep-setid") keepSetid = true;
    else if (a === "--auth-key-file") keyFile = args[++i];
    else if (a === "--provider") provider = args[++i];
    else if (a === "--max-per-source") perSource = parseIntArg(args[++i], a, 1, 65535);
    else if (a.startsWith("-")) throw new CopyError("USAGE", `unknown option ${a} (async-rdma serve --help)`);
    else if (dir === undefined) dir = a;
    else throw new CopyError("USAGE", `one directory only (got ${JSON.stringify(dir)} and ${JSON.stringify(a)})`);
  }
  let root: string;
  try {
    root = await realpath(dir ?? ".");
    if (!(await lstat(root)).isDirectory()) throw new CopyError("ENOTDIR", `${dir}: not a directory`);
  } catch (e) {
    throw e instanceof CopyError ? e : new CopyError((e as { code?: string }).code ?? "ERROR", `${dir ?? "."}: ${(e as Error).message}`);
  }
  const readOnly = writable !== true;
  const listener = await builderFor(provider, keyFile).bind(`${bind}:${port}`);
  // what is exposed, said once at start
  console.log(`async-rdma serve: serving ${root} on ${bind}:${listener.port}`);
  console.log(`  ${readOnly ? "read-only (--writable accepts uploads)" : "writable: clients may upload files and create directories and links"}; authentication ${keyFile !== undefined ? "on" : "off (--auth-key-file)"}; ${loopback(bind) ? "this machine only" : "reachable from the network"}`);
  if (!readOnly && keyFile === undefined && !loopback(bind)) console.error(`async-rdma serve: warning: anyone who can reach ${bind}:${listener.port} can write into ${root} (no --auth-key-file)`);
  const stop = (): void => void listener.close().finally(() => process.exit(0));
  process.once("SIGINT", stop);
  process.once("SIGTERM", stop);
  const perAddress = new Map<string, number>();
  for await (const rdma of listener) {
    // One client address holds at most --max-per-source connections: past it, a new one is closed at once.
    const from = rdma.peer.address;
    const n = perAddress.get(from) ?? 0;
    if (n >= perSource) {
      console.error(`async-rdma serve: refused a connection from ${from}: it holds ${n} already (--max-per-source ${perSource})`);
      void rdma.close();
      continue;
    }
    perAddress.set(from, n + 1);
    const session = new Session(rdma, { root, readOnly, keepSetid });
    sessions.add(session);
    // A copy keeps at most its depth (≤ MAX_DEPTH) of chunk calls and a few file calls in flight;
    // more calls wait (back-pressure). The bound also caps what queued replies (a large `list`)
    // can pin per connection: maxQueuedBytes + maxInFlight replies.
    void new RpcServer(handlers(session), { maxInFlight: MAX_DEPTH + 32 })
      .serve(rdma)
      .catch((e: unknown) => console.error(`async-rdma serve: a connection from ${rdma.peer.address} failed: ${(e as Error).message}`))
      .finally(() => {
        const left = (perAddress.get(from) ?? 1) - 1;
        if (left > 0) perAddress.set(from, left);
        else perAddress.delete(from);
        return session.end();
      });
  }
}
