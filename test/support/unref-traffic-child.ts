/**
 * A client process for test/api/unref-spin: connects to argv[2]
 * with polling argv[3] (spinUs argv[4]), takes the first message, then
 * unref()s the connection, keeps a receive loop running (the parent keeps
 * sending), prints "ready" and ends its script. As with an unref'd socket, nothing but the connection is left:
 * the process must exit by itself while messages keep arriving. Prints how
 * many messages it took when it exits.
 */
import { builder } from "./api.js";
import { DEADLINE_MS } from "./seam.js";
import type { PollingMode } from "../../src/index.js";
import { contention } from "../../src/agent/poller.js";

// This process has a core to itself (as on any machine with cores to spare): its contention
// detector never says "contended", so whether the process exits does not depend on the load
// of the machine running the test (2 cores, two suites at once).
contention.reset({ name: "calm", read: () => 0, exceeded: () => false });

const [addr, mode, spinUs] = [process.argv[2]!, process.argv[3]! as PollingMode, Number(process.argv[4] ?? 50)];
const rdma = await builder("client").setConnectTimeout(6 * DEADLINE_MS).setPolling(mode, spinUs).connect(addr);
{
  using first = await rdma.receive();
  void first;
}
rdma.unref();
let received = 1;
void (async () => {
  try {
    for (;;) {
      using m = await rdma.receive();
      void m;
      received++;
    }
  } catch (e) {
    process.stdout.write(`receive loop ended: ${String(e)}\n`);
  }
})();
process.on("exit", () => process.stdout.write(`exit after ${received} messages\n`));
console.log("ready");
