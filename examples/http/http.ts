/**
 * An unmodified `http.Server` served over RDMA, and `http.request` reaching
 * it, through async-rdma/net. The HTTP code is Node's own: only where the
 * sockets come from changes.
 */
import http from "node:http";
import { once } from "node:events";
import { createServer, connect, type RdmaNetOptions, type Server } from "../../src/net/index.js";

/**
 * Serves `httpServer` on an async-rdma/net server listening at host:port (0: any free port).
 * Every RDMA stream accepted is handed to the HTTP server as a connection.
 */
export async function serveHttp(httpServer: http.Server, port: number, host: string, opts: RdmaNetOptions = {}): Promise<Server> {
  const server = createServer(opts, (socket) => httpServer.emit("connection", socket));
  server.listen(port, host);
  await once(server, "listening");
  return server;
}

/** An http.Agent whose connections are RDMA streams (keep-alive reuses them). */
export function rdmaAgent(host: string, port: number, opts: RdmaNetOptions = {}, agentOptions: http.AgentOptions = { keepAlive: true }): http.Agent {
  const agent = new http.Agent(agentOptions);
  // Agent#createConnection is how an Agent makes its sockets: an async-rdma/net socket instead of a TCP one.
  (agent as unknown as { createConnection: () => unknown }).createConnection = () => connect(port, host, opts);
  return agent;
}

/** One request with `http.request({ createConnection })`: the response's status and body. */
export function get(host: string, port: number, path: string, opts: RdmaNetOptions = {}): Promise<{ status: number; body: Buffer }> {
  return new Promise((resolve, reject) => {
    const req = http.request({ host, port, path, createConnection: () => connect(port, host, opts) as never }, (res) => {
      const parts: Buffer[] = [];
      res.on("data", (d: Buffer) => parts.push(d));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, body: Buffer.concat(parts) }));
      res.on("error", reject);
    });
    req.on("error", reject);
    req.end();
  });
}
