/**
 * The HTTP demo: Node's own http.Server over RDMA, a request with
 * `http.request({ createConnection })`, then keep-alive requests through an Agent.
 * Run: npm run build && node dist/examples/http/run.js [host] [provider]
 */
import http from "node:http";
import { get, rdmaAgent, serveHttp } from "./http.js";
import type { ProviderChoice } from "../../src/index.js";

const host = process.argv[2] ?? "127.0.0.1";
const provider = (process.argv[3] ?? process.env.ASYNC_RDMA_PROVIDER ?? "auto") as ProviderChoice;
const opts = { provider, ...(process.env.ASYNC_RDMA_DEVICE ? { device: process.env.ASYNC_RDMA_DEVICE } : {}) };

// An ordinary HTTP server: it never learns its sockets are RDMA streams.
const httpServer = http.createServer((req, res) => {
  res.setHeader("content-type", "text/plain");
  res.end(`hello over RDMA: ${req.method} ${req.url}\n`);
});
const server = await serveHttp(httpServer, 0, host, opts);
const port = server.address()!.port;
console.log(`http over async-rdma/net listening on ${host}:${port} (${provider})`);

const one = await get(host, port, "/one", opts);
process.stdout.write(`GET /one -> ${one.status} ${one.body.toString()}`);

const agent = rdmaAgent(host, port, opts);
for (let i = 0; i < 3; i++) {
  const body = await new Promise<string>((resolve, reject) => {
    http
      .get({ host, port, path: `/keep-alive/${i}`, agent }, (res) => {
        let b = "";
        res.setEncoding("utf8");
        res.on("data", (d: string) => (b += d));
        res.on("end", () => resolve(b));
      })
      .on("error", reject);
  });
  process.stdout.write(`GET /keep-alive/${i} -> ${body}`);
}
agent.destroy();
httpServer.closeAllConnections();
await new Promise<void>((r) => server.close(() => r()));
console.log("done");
