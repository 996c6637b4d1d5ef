/**
 * A client process for API peer-death tests: connects to argv[2], prints
 * "connected", then waits until killed.
 */
import { RdmaBuilder } from "../../src/index.js";

const b = new RdmaBuilder();
if (process.env.ASYNC_RDMA_CM === "rdmacm") b.setConnectionManager("rdmacm");
if (process.env.ASYNC_RDMA_PROVIDER === "verbs") {
  const devs = (process.env.RXE_DEVS ?? "").split(/\s+/).filter(Boolean);
  const d = devs[1] ?? devs[0];
  if (d) b.setDevice(d);
}
const rdma = await b.connect(process.argv[2]!);
console.log("connected");
await rdma.receive().catch(() => {});
