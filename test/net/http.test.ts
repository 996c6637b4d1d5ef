/**
 * issue 22 point 1: an unmodified http.Server over async-rdma/net, and
 * http.request reaching it (examples/http).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { createHash } from "node:crypto";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { get, rdmaAgent, serveHttp } from "../../examples/http/http.js";
import { CM, HOST, PROVIDER, builder, pattern } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const here = dirname(fileURLToPath(import.meta.url));
const DEADLINE = 60_000 * SLOW;

function request(agent: http.Agent, port: number, method: string, path: string, body?: Uint8Array): Promise<{ status: number; body: Buffer; socket: unknown }> {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: HOST, port, method, path, agent }, (res) => {
      const parts: Buffer[] = [];
      res.on("data", (d: Buffer) => parts.push(d));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, body: Buffer.concat(parts), socket: req.socket }));
    });
    req.on("error", reject);
    req.end(body);
  });
}

describe(`issue 22 point 1: HTTP over async-rdma/net [${PROVIDER}, ${CM}]`, { timeout: DEADLINE }, () => {
  it("issue 22 point 1: examples/http runs: http.request({ createConnection }) and keep-alive requests reach an unmodified http.Server", { skip: CM === "rdmacm" }, async () => {
    const child = spawn(process.execPath, [join(here, "..", "..", "examples", "http", "run.js"), HOST, PROVIDER], { stdio: ["ignore", "pipe", "inherit"] });
    let out = "";
    child.stdout!.on("data", (d: Buffer) => (out += d.toString()));
    const code = await new Promise<number | null>((r) => child.once("exit", r));
    assert.equal(code, 0, out);
    assert.match(out, /GET \/one -> 200 hello over RDMA: GET \/one/);
    assert.match(out, /GET \/keep-alive\/2 -> hello over RDMA: GET \/keep-alive\/2/);
    assert.match(out, /done/);
  });

  it("issue 22 point 1: 200 keep-alive requests over one stream, then a 10 MiB body each way (checksums)", async () => {
    let connections = 0;
    const httpServer = http.createServer((req, res) => {
      const h = createHash("sha256");
      let n = 0;
      req.on("data", (d: Buffer) => {
        n += d.length;
        h.update(d);
      });
      req.on("end", () => {
        if (req.url === "/big") {
          const body = Buffer.from(pattern(10 << 20, 7));
          res.setHeader("x-sha256", createHash("sha256").update(body).digest("hex"));
          res.end(body);
        } else res.end(JSON.stringify({ url: req.url, n, sha: h.digest("hex") }));
      });
    });
    httpServer.on("connection", () => connections++);
    const server = await serveHttp(httpServer, 0, HOST, { builder: builder("server") });
    const port = server.address()!.port;
    const agent = rdmaAgent(HOST, port, { builder: builder("client") }, { keepAlive: true, maxSockets: 1 });
    try {
      const sockets = new Set<unknown>();
      for (let i = 0; i < 200; i++) {
        const r = await request(agent, port, "GET", `/r/${i}`);
        assert.equal(r.status, 200);
        assert.equal(JSON.parse(r.body.toString()).url, `/r/${i}`);
        sockets.add(r.socket);
      }
      assert.equal(sockets.size, 1, "keep-alive: every request on one stream");
      assert.equal(connections, 1);
      const up = Buffer.from(pattern(10 << 20, 3));
      const r = await request(agent, port, "POST", "/upload", up);
      assert.deepEqual(JSON.parse(r.body.toString()), { url: "/upload", n: up.length, sha: createHash("sha256").update(up).digest("hex") });
      const down = await request(agent, port, "GET", "/big");
      assert.equal(down.body.length, 10 << 20);
      assert.equal(createHash("sha256").update(down.body).digest("hex"), createHash("sha256").update(pattern(10 << 20, 7)).digest("hex"));
      // and a one-off request with createConnection
      const one = await get(HOST, port, "/one", { builder: builder("client") });
      assert.equal(one.status, 200);
    } finally {
      agent.destroy();
      httpServer.closeAllConnections();
      await new Promise<void>((r) => server.close(() => r()));
    }
  });
});
