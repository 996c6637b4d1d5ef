/**
 * A counter client: `times` fetch-and-adds on the owner's shared counter.
 * Run: node dist/examples/counter/client.js host:port [times]
 */
import { RdmaBuilder } from "../../src/index.js";
import { countUp, openCounter, report } from "./counter.js";

const [addr = "127.0.0.1:5555", times = "1000"] = process.argv.slice(2);
const rdma = await new RdmaBuilder().connect(addr);
const counter = await openCounter(rdma);
await countUp(rdma, counter, Number(times));
console.log(`added ${times} (provider ${rdma.provider})`);
await report(rdma, Number(times));
