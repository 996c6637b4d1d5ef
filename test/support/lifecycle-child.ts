/**
 * A client process for test/api/lifecycle and test/api/observe: connects to
 * argv[2] on the provider and connection manager under test, then by argv[3]:
 *
 * - "unref": unref()s the connection, leaves a receive pending, prints
 *   "ready" and ends its script; the process must exit by itself;
 * - "unref-busy": the same with busy polling;
 * - "talk": sends one message, closes, prints "done" (run with NODE_DEBUG).
 */
import { builder } from "./api.js";
import { DEADLINE_MS } from "./seam.js";

const [addr, mode] = [process.argv[2]!, process.argv[3]!];
// A generous handshake bound: a freshly started process in the slow verbs guest.
const b = builder("client").setConnectTimeout(6 * DEADLINE_MS);
if (mode === "unref-busy") b.setPolling("busy");
const rdma = await b.connect(addr);
if (mode === "unref" || mode === "unref-busy") {
  rdma.unref();
  // A receive in flight does not hold the process either (as a read on an unref'd socket).
  rdma.receive().catch(() => {});
  console.log("ready");
} else {
  await rdma.send(Buffer.from("hello"));
  await rdma.close();
  console.log("done");
}
