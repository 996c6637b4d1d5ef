#!/usr/bin/env node
// async-rdma/net (a stream.Duplex over RDMA) against node:net, same machine,
// same programs; the server is a child process, the client this one.
// Each workload runs --runs times, ours and node:net alternating (which goes
// first alternates too), medians reported with the load average:
//   pipeline: a 200 MiB file → socket → file with stream.pipeline(), until the server's ack
//   small:    100,000 writes of 100 bytes (respecting back-pressure), until the server's ack
//   download: the server writes --mib MiB from memory (64 KiB writes), the client reads it with 'data'
//   onread:   the same read with `onread` into one reused 64 KiB buffer (net.connect's option; no
//             buffer allocated per chunk on either side)
//   http c=1, http c=64: GET requests/s through an unmodified http.Server, keep-alive Agent
// Each run does its workload on a fresh server, first once ("cold": V8 still
// compiling, connections opening), then again until --warmup-ms (default
// 2000) have passed since the start, unmeasured, then once more, measured
// ("warm", the steady state, as bench/rpc-vs-node.mjs measures). Both are
// reported: the library has far more JavaScript than node:net, and V8 takes
// thousands of requests to optimise it.
//
//   node bench/net-vs-node.mjs [--runs 3] [--provider tcp] [--mib 200] [--warmup-ms 2000] [--json] [--only pipeline,small,download,onread,http1,http64]
// A program that reports: it never fails on a number.
import { spawn } from "node:child_process";
import { createReadStream, createWriteStream, writeFileSync, rmSync, mkdtempSync } from "node:fs";
import { pipeline } from "node:stream/promises";
import { once } from "node:events";
import { tmpdir } from "node:os";
import { join } from "node:path";
import http from "node:http";
import net from "node:net";
import { ROOT, flags, fmt, loadavg, machine, median, requireBuild, table, usageExit } from "./lib/common.mjs";

const USAGE = "usage: node bench/net-vs-node.mjs [--runs N] [--provider tcp|verbs] [--mib 200] [--warmup-ms 2000] [--json] [--only pipeline,small,download,onread,http1,http64]";
const role = process.argv[2] === "--server" ? "server" : "client";

async function lib(impl, provider) {
  if (impl === "node") return { createServer: (l, o = {}) => net.createServer(o, l), connect: (p, h, x = {}) => net.connect({ port: p, host: h, ...x }) };
  const m = await import(join(ROOT, "dist", "src", "net", "index.js"));
  return { createServer: (l, o = {}) => m.createServer({ provider, ...o }, l), connect: (p, h, x = {}) => m.connect(p, h, { provider, ...x }) };
}

if (role === "server") {
  // node bench/net-vs-node.mjs --server <impl> <provider> <workload> <dir> <mib>
  const [, , , impl, provider, workload, dir, mib] = process.argv;
  const L = await lib(impl, provider);
  let server;
  if (workload.startsWith("http")) {
    const hs = http.createServer({ keepAliveTimeout: 60_000 }, (_req, res) => res.end("ok"));
    server = L.createServer((s) => hs.emit("connection", s));
  } else if (workload === "download" || workload === "onread") {
    const chunk = Buffer.alloc(1 << 20);
    for (let i = 0; i < chunk.length; i++) chunk[i] = (i * 31) % 251;
    server = L.createServer((s) => {
      s.on("error", () => {});
      void (async () => {
        for (let i = 0; i < Number(mib) * 16; i++) if (!s.write(chunk.subarray((i % 16) << 16, ((i % 16) + 1) << 16))) await once(s, "drain");
        s.end();
      })();
    });
  } else {
    let n = 0;
    // half-open: the server answers ("k") after the client's end, which would otherwise end it too
    server = L.createServer((s) => {
      const done = () => s.end("k");
      if (workload === "pipeline") {
        const out = join(dir, `out-${n++}`);
        pipeline(s, createWriteStream(out)).then(() => (rmSync(out, { force: true }), done()), (e) => console.error(e));
      }
      else {
        s.on("data", () => {});
        s.on("end", done);
      }
    }, { allowHalfOpen: true });
  }
  server.listen(0, "127.0.0.1", () => console.log(JSON.stringify({ type: "listening", port: server.address().port })));
} else {
  let o;
  try {
    o = flags(process.argv.slice(2), { runs: 3, provider: "tcp", mib: 200, "warmup-ms": 2000, json: false, only: "pipeline,small,download,onread,http1,http64" });
  } catch (e) {
    usageExit(e.message, USAGE);
  }
  requireBuild();
  const dir = mkdtempSync(join(tmpdir(), "net-bench-"));
  const file = join(dir, "in");
  const chunk = Buffer.alloc(1 << 20);
  for (let i = 0; i < chunk.length; i++) chunk[i] = (i * 31) % 251;
  writeFileSync(file, Buffer.alloc(0));
  {
    const w = createWriteStream(file);
    for (let i = 0; i < o.mib; i++) if (!w.write(chunk)) await once(w, "drain");
    w.end();
    await once(w, "finish");
  }

  async function startServer(impl, workload) {
    const child = spawn(process.execPath, [new URL(import.meta.url).pathname, "--server", impl, o.provider, workload, dir, String(o.mib)], { stdio: ["ignore", "pipe", "inherit"] });
    let buf = "";
    const port = await new Promise((res, rej) => {
      child.stdout.on("data", (d) => {
        buf += d;
        const m = /"port":(\d+)/.exec(buf);
        if (m) res(Number(m[1]));
      });
      child.once("exit", (c) => rej(new Error(`server exited ${c}`)));
    });
    return { child, port };
  }

  function ack(s) {
    return new Promise((res, rej) => {
      s.on("data", () => {});
      s.once("end", res);
      s.once("error", rej);
    });
  }

  const workloads = {
    async pipeline(L, port) {
      const s = L.connect(port, "127.0.0.1");
      const t0 = performance.now();
      const a = ack(s);
      await pipeline(createReadStream(file, { highWaterMark: 64 * 1024 }), s);
      await a;
      const sec = (performance.now() - t0) / 1000;
      return { value: (o.mib * 1.048576) / sec, unit: "MB/s" };
    },
    async small(L, port) {
      const s = L.connect(port, "127.0.0.1");
      await once(s, "connect");
      const b = Buffer.alloc(100, 1);
      const t0 = performance.now();
      const a = ack(s);
      for (let i = 0; i < 100_000; i++) if (!s.write(b)) await once(s, "drain");
      s.end();
      await a;
      const sec = (performance.now() - t0) / 1000;
      return { value: 100_000 / sec / 1000, unit: "k writes/s" };
    },
    async download(L, port) {
      const t0 = performance.now();
      const s = L.connect(port, "127.0.0.1");
      let n = 0;
      s.on("data", (d) => void (n += d.length));
      await once(s, "end");
      s.destroy();
      return { value: (n / 1e6) / ((performance.now() - t0) / 1000), unit: "MB/s" };
    },
    async onread(L, port) {
      const t0 = performance.now();
      let n = 0;
      const s = L.connect(port, "127.0.0.1", { onread: { buffer: Buffer.allocUnsafe(64 * 1024), callback: (k) => void (n += k) } });
      await once(s, "end");
      s.destroy();
      return { value: (n / 1e6) / ((performance.now() - t0) / 1000), unit: "MB/s" };
    },
    http1: (L, port) => httpLoad(L, port, 1, 2_000),
    http64: (L, port) => httpLoad(L, port, 64, 10_000),
  };

  async function httpLoad(L, port, c, total) {
    const agent = new http.Agent({ keepAlive: true, maxSockets: c });
    agent.createConnection = () => L.connect(port, "127.0.0.1");
    const get = () =>
      new Promise((res, rej) => {
        http.get({ host: "127.0.0.1", port, path: "/", agent }, (r) => {
          r.resume();
          r.on("end", res);
        }).on("error", rej);
      });
    // warm: open the c connections
    await Promise.all(Array.from({ length: c }, get));
    let left = total;
    const t0 = performance.now();
    await Promise.all(
      Array.from({ length: c }, async () => {
        while (left-- > 0) await get();
      }),
    );
    const sec = (performance.now() - t0) / 1000;
    agent.destroy();
    return { value: total / sec, unit: "req/s" };
  }

  async function once1(impl, w) {
    const { child, port } = await startServer(impl, w);
    try {
      const L = await lib(impl, o.provider);
      const t0 = performance.now();
      const cold = await workloads[w](L, port);
      while (performance.now() - t0 < o["warmup-ms"]) await workloads[w](L, port);
      const warm = await workloads[w](L, port);
      return { unit: warm.unit, value: warm.value, cold: cold.value };
    } finally {
      child.kill();
      await once(child, "exit").catch(() => {});
    }
  }

  const rows = [];
  const out = [];
  const load0 = loadavg();
  for (const w of o.only.split(",")) {
    const ours = [];
    const ref = [];
    const oursCold = [];
    const refCold = [];
    let unit = "";
    for (let i = 0; i < o.runs; i++) {
      const order = i % 2 === 0 ? ["rdma", "node"] : ["node", "rdma"];
      for (const impl of order) {
        const r = await once1(impl, w);
        unit = r.unit;
        (impl === "rdma" ? ours : ref).push(r.value);
        (impl === "rdma" ? oursCold : refCold).push(r.cold);
      }
    }
    const a = median(ours);
    const b = median(ref);
    const ac = median(oursCold);
    const bc = median(refCold);
    rows.push([w, `${fmt(a)} ${unit}`, `${fmt(b)} ${unit}`, `${fmt(a / b)}×`, `${fmt(ac)} ${unit}`, `${fmt(bc)} ${unit}`, `${fmt(ac / bc)}×`]);
    out.push({ type: "result", workload: w, unit, rdma: ours, node: ref, ratio: a / b, rdmaCold: oursCold, nodeCold: refCold, coldRatio: ac / bc });
  }
  rmSync(dir, { recursive: true, force: true });
  if (o.json) for (const r of out) console.log(JSON.stringify(r));
  console.log(`async-rdma/net (provider ${o.provider}) vs node:net, loopback, medians of ${o.runs}; warm: after ${o["warmup-ms"]} ms of the same workload; cold: its first pass; ${machine()}; load ${load0} → ${loadavg()}`);
  console.log(table(["workload", "async-rdma/net", "node:net", "ratio", "cold: async-rdma/net", "node:net", "ratio"], rows));
}
