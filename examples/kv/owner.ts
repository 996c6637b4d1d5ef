/**
 * The KV owner: shares the table as "kv", serves the clients' PUTs and
 * DELETEs, and exits once `clients` clients have come and gone.
 * Run: node dist/examples/kv/owner.js [host:port] [clients]   (run.js starts it with its clients)
 */
import { RdmaBuilder } from "../../src/index.js";
import { createTable, serveConnection } from "./kv.js";

const [addr = "127.0.0.1:0", clients = "2"] = process.argv.slice(2);
const listener = await new RdmaBuilder().bind(addr);
const { table } = createTable(listener, { buckets: 1024, ways: 4, keyMax: 32, valueMax: 96 });
console.log(`listening on ${listener.port}`);
const served: Promise<void>[] = [];
for (let i = 0; i < Number(clients); i++) served.push(serveConnection(await listener.accept(), table));
await Promise.all(served);
console.log(`${table.size} entries left in the table`);
await listener.close();
