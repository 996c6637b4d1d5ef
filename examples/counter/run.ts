/**
 * The counter demo: one owner and N clients, each its own process, each
 * client adding K to the shared counter.
 * Run: npm run build && node dist/examples/counter/run.js [clients=3] [times=1000] [host]
 */
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { runOwnerAndClients } from "../spawn.js";

const here = dirname(fileURLToPath(import.meta.url));
const [clients = "3", times = "1000", host = "127.0.0.1"] = process.argv.slice(2);
runOwnerAndClients(
  { tag: "owner", argv: [join(here, "owner.js"), `${host}:0`, clients] },
  Array.from({ length: Number(clients) }, (_, i) => ({ tag: `client ${i + 1}`, argv: [join(here, "client.js"), `${host}:PORT`, times] })),
);
