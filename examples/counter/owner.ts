/**
 * The counter's owner: shares it, waits for every client's report, prints
 * the final value and checks it is the sum of the reports.
 * Run: node dist/examples/counter/owner.js [host:port] [clients]   (run.js starts it with its clients)
 */
import { RdmaBuilder } from "../../src/index.js";
import { collectReports, shareCounter, valueOf } from "./counter.js";

const [addr = "127.0.0.1:0", clients = "4"] = process.argv.slice(2);
const listener = await new RdmaBuilder().bind(addr);
const counter = shareCounter(listener);
console.log(`listening on ${listener.port}`);
const { reported, connections } = await collectReports(listener, Number(clients));
const value = valueOf(counter);
console.log(`counter = ${value} (the clients report ${reported} increments)`);
await Promise.all(connections.map((c) => c.close()));
await listener.close();
process.exitCode = value === reported ? 0 : 1;
