/**
 * A counter client process for test/api/counter-processes: connects to
 * argv[2] on the provider and connection manager under test, opens the
 * shared counter, prints "ready", waits for "go" on stdin (so all clients
 * count at once), makes argv[3] increments (examples/counter), reports them
 * to the owner and waits for it to close.
 */
import { builder } from "./api.js";
import { lineFrom } from "./procs.js";
import { countUp, openCounter, report } from "../../examples/counter/counter.js";

const [addr, times] = [process.argv[2]!, Number(process.argv[3])];
const rdma = await builder("client").connect(addr);
const counter = await openCounter(rdma);
const go = lineFrom(process.stdin, /^go$/m);
console.log("ready");
await go;
process.stdin.pause();
await countUp(rdma, counter, times);
console.log("counted");
await report(rdma, times);
