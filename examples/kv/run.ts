/**
 * The KV demo: the owner and two clients, three processes.
 * Run: npm run build && node dist/examples/kv/run.js [host]
 */
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { runOwnerAndClients } from "../spawn.js";

const here = dirname(fileURLToPath(import.meta.url));
const host = process.argv[2] ?? "127.0.0.1";
const names = ["alice", "bob"];
runOwnerAndClients(
  { tag: "owner", argv: [join(here, "owner.js"), `${host}:0`, String(names.length)] },
  names.map((n) => ({ tag: n, argv: [join(here, "client.js"), `${host}:PORT`, n] })),
);
