/**
 * A client process for API peer-death tests: connects to argv[2], prints
 * "connected", then (argv[3] = "echo") sends back every message it receives,
 * or (default) waits until killed.
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
if (process.argv[3] === "echo") {
  for (;;) {
    const m = await rdma.receive().catch(() => null);
    if (!m) break;
    await rdma.send(m).catch(() => {});
    m.dispose();
  }
  await rdma.close();
} else await rdma.receive().catch(() => {});
