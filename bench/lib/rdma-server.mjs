#!/usr/bin/env node
// A passive async-rdma server for the memory and setup benchmarks: accepts any
// number of connections with default settings and holds them open. Run with
// child_process.fork (IPC):
//   → {cmd:"count"}  ← {type:"count", conns, rejected}
//   → {cmd:"mem"}    ← {type:"mem", conns, mem: process.memoryUsage()} (after a GC when --expose-gc)
//   → {cmd:"close"}  ← {type:"closed", conns, ms}    closes every held connection
//   → {cmd:"exit"}
// First message: {type:"listening", port}.
//   node --expose-gc bench/lib/rdma-server.mjs [--provider tcp|verbs|auto] [--host 127.0.0.1]
import { RdmaBuilder } from "../../dist/src/index.js";

let provider = "tcp";
let host = "127.0.0.1";
const args = process.argv.slice(2);
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--provider") provider = args[++i];
  else if (args[i] === "--host") host = args[++i];
  else {
    console.error("usage: rdma-server.mjs [--provider P] [--host H]");
    process.exit(2);
  }
}

const send = (m) => (process.send ? process.send(m) : console.log(JSON.stringify(m)));
const listener = await new RdmaBuilder().setProvider(provider).bind({ host, port: 0 });
const conns = new Set();
(async () => {
  for await (const rdma of listener) {
    conns.add(rdma);
    // Watch for the peer closing (a pending receive rejects), so closed connections are dropped.
    rdma.receive().then(
      (m) => m.dispose(),
      () => {
        conns.delete(rdma);
        rdma.close().catch(() => {});
      },
    );
  }
})();
send({ type: "listening", port: listener.port });

process.on("message", async (m) => {
  if (m.cmd === "count") send({ type: "count", conns: conns.size, rejected: listener.rejected.length });
  else if (m.cmd === "mem") {
    if (global.gc) {
      global.gc();
      global.gc();
    }
    send({ type: "mem", conns: conns.size, mem: process.memoryUsage() });
  } else if (m.cmd === "close") {
    const t = performance.now();
    const n = conns.size;
    await Promise.all([...conns].map((c) => c.close().catch(() => {})));
    conns.clear();
    send({ type: "closed", conns: n, ms: performance.now() - t });
  } else if (m.cmd === "exit") {
    await listener.close();
    process.exit(0);
  }
});
process.on("disconnect", () => process.exit(0));
