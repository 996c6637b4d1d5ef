/**
 * A client process for the net tests: connects an async-rdma/net socket to
 * argv[2] (host) argv[3] (port), prints "connected", then writes without end
 * until killed.
 */
import { RdmaBuilder } from "../../src/index.js";
import { connect } from "../../src/net/index.js";

const b = new RdmaBuilder();
if (process.env.ASYNC_RDMA_CM === "rdmacm") b.setConnectionManager("rdmacm");
if (process.env.ASYNC_RDMA_PROVIDER === "verbs") {
  const devs = (process.env.RXE_DEVS ?? "").split(/\s+/).filter(Boolean);
  const d = devs[1] ?? devs[0];
  if (d) b.setDevice(d);
}
const s = connect(Number(process.argv[3]), process.argv[2]!, { builder: b });
s.on("error", () => process.exit(3));
s.once("connect", () => {
  console.log("connected");
  const chunk = Buffer.alloc(64 * 1024, 7);
  const more = (): void => {
    while (s.write(chunk));
    s.once("drain", more);
  };
  more();
});
