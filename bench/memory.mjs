#!/usr/bin/env node
// Memory per connection on the tcp provider, default settings.
//  1. idle: resident memory (RSS) per idle connection, client and server side,
//     from the RSS delta over N connections (after a GC; the first connection,
//     which loads code and opens the device, is in the baseline). Medians over --runs.
//  2. 1,000 concurrent connections from one process: how long it takes to
//     open them (--concurrency handshakes in flight), RSS on both sides, and
//     how long closing them takes.
// The server is a separate process (bench/lib/rdma-server.mjs), so each side's
// RSS is its own.
//   node --expose-gc bench/memory.mjs [--idle 200] [--many 1000] [--concurrency 50] [--runs 3] [--json]
// Note: before 7528e49 the tcp provider dropped QP streams beyond 64 awaiting
// HELLO, so with more handshakes in flight some connections died right after
// setup; the default concurrency (50) stays below that, and "open at the
// end" shows how many survived.
// A program that reports: it never fails on a number.
import { fork, spawnSync } from "node:child_process";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { ROOT, fmt, flags, loadavg, machine, median, requireBuild, table, usageExit } from "./lib/common.mjs";

if (!global.gc) {
  // re-run with --expose-gc so both sides can collect before measuring
  const r = spawnSync(process.execPath, ["--expose-gc", ...process.argv.slice(1)], { stdio: "inherit" });
  process.exit(r.status ?? 1);
}
const USAGE = "usage: node bench/memory.mjs [--idle N] [--many N] [--concurrency N (50)] [--runs N] [--json]";
let o;
try {
  o = flags(process.argv.slice(2), { idle: 200, many: 1000, concurrency: 50, runs: 3, json: false, child: "" });
} catch (e) {
  usageExit(e.message, USAGE);
}
requireBuild();
const { RdmaBuilder } = await import(join(ROOT, "dist", "src", "index.js"));
const KiB = 1024;
const MiB = 1024 * 1024;

function startServer() {
  const child = fork(join(ROOT, "bench", "lib", "rdma-server.mjs"), ["--provider", "tcp"], { execArgv: ["--expose-gc"], stdio: ["ignore", "inherit", "inherit", "ipc"] });
  const waiters = [];
  child.on("message", (m) => {
    const i = waiters.findIndex((w) => w.type === m.type);
    if (i >= 0) waiters.splice(i, 1)[0].resolve(m);
  });
  const next = (type) => new Promise((resolve) => waiters.push({ type, resolve }));
  const ask = (cmd, type) => {
    const p = next(type);
    child.send({ cmd });
    return p;
  };
  const exited = new Promise((resolve) => child.once("exit", resolve));
  const stop = () => {
    child.send({ cmd: "exit" });
    return exited;
  };
  return { child, next, ask, stop };
}

/** Waits (bounded) until the server holds `n` connections: its side of the last handshakes may lag the client's. */
async function serverHas(srv, n) {
  const deadline = performance.now() + 10_000;
  for (;;) {
    const m = await srv.ask("count", "count");
    if (m.conns >= n) return;
    if (performance.now() > deadline) {
      console.error(`memory: the server holds ${m.conns} of ${n} connections after 10 s (${m.rejected} handshakes rejected); measuring anyway`);
      return;
    }
    await new Promise((r) => setTimeout(r, 5)); // poll interval of a bounded wait for a remote count
  }
}

function myMem() {
  global.gc();
  global.gc();
  return process.memoryUsage();
}

async function openMany(port, n, concurrency) {
  const conns = [];
  let next = 0;
  const worker = async () => {
    while (next < n) {
      next++;
      conns.push(await new RdmaBuilder().setProvider("tcp").connect({ host: "127.0.0.1", port }));
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, n) }, worker));
  return conns;
}

/** RSS and JS-visible memory deltas per connection for N idle connections. */
async function idleRun(n) {
  const srv = startServer();
  const { port } = await srv.next("listening");
  const first = await new RdmaBuilder().setProvider("tcp").connect({ host: "127.0.0.1", port });
  const c0 = myMem();
  const s0 = (await srv.ask("mem", "mem")).mem;
  const conns = await openMany(port, n, 1);
  await serverHas(srv, n + 1);
  const s1 = (await srv.ask("mem", "mem")).mem;
  const c1 = myMem();
  await Promise.all([first, ...conns].map((c) => c.close()));
  await srv.stop();
  const per = (a, b, k) => (b[k] - a[k]) / n;
  return {
    client: { rss: per(c0, c1, "rss"), heap: per(c0, c1, "heapUsed"), arrayBuffers: per(c0, c1, "arrayBuffers"), external: per(c0, c1, "external") },
    server: { rss: per(s0, s1, "rss"), heap: per(s0, s1, "heapUsed"), arrayBuffers: per(s0, s1, "arrayBuffers"), external: per(s0, s1, "external") },
  };
}

async function manyRun(n, concurrency) {
  const srv = startServer();
  const { port } = await srv.next("listening");
  const c0 = myMem();
  const s0 = (await srv.ask("mem", "mem")).mem;
  const t0 = performance.now();
  const conns = await openMany(port, n, concurrency);
  const openMs = performance.now() - t0;
  await serverHas(srv, n);
  const s1 = (await srv.ask("mem", "mem")).mem;
  const c1 = myMem();
  // A connection the device dropped right after setup shows up as closed (see docs/performance.md: >64 concurrent handshakes)
  await new Promise((r) => setTimeout(r, 200)); // let such failures surface before counting: a bounded settle time, not a readiness wait
  const open = conns.filter((c) => !c.isClosed).length;
  const t1 = performance.now();
  await Promise.all(conns.map((c) => c.close()));
  const closeMs = performance.now() - t1;
  await srv.stop();
  return { n, concurrency, open, openMs, closeMs, client: { rss: c1.rss, rssDelta: c1.rss - c0.rss, heapDelta: c1.heapUsed - c0.heapUsed }, server: { rss: s1.rss, rssDelta: s1.rss - s0.rss, heapDelta: s1.heapUsed - s0.heapUsed } };
}

// Each run's client side is a fresh process (--child): RSS never shrinks after
// close, so a second run in the same process would reuse the first run's pages.
if (o.child === "idle" || o.child === "many") {
  process.send(o.child === "idle" ? await idleRun(o.idle) : await manyRun(o.many, o.concurrency));
  process.disconnect();
  process.exit(0);
}
function inChild(kind) {
  const args = ["--child", kind, "--idle", String(o.idle), "--many", String(o.many), "--concurrency", String(o.concurrency)];
  const c = fork(fileURLToPath(import.meta.url), args, { execArgv: ["--expose-gc"], stdio: ["ignore", "inherit", "inherit", "ipc"] });
  return new Promise((resolve, reject) => {
    let got = null;
    c.on("message", (m) => (got = m));
    c.on("exit", (code) => (got ? resolve(got) : reject(new Error(`memory: the ${kind} run exited with ${code} without a result`))));
  });
}

const t0 = performance.now();
const idle = [];
for (let i = 0; i < o.runs; i++) {
  idle.push(await inChild("idle"));
  console.error(`memory: idle run ${i + 1}: client ${fmt(idle[i].client.rss / KiB)} KiB, server ${fmt(idle[i].server.rss / KiB)} KiB RSS per connection`);
}
const many = [];
for (let i = 0; i < o.runs; i++) {
  many.push(await inChild("many"));
  console.error(`memory: ${o.many} connections run ${i + 1}: opened in ${fmt(many[i].openMs)} ms (${many[i].open} still open after setup), closed in ${fmt(many[i].closeMs)} ms`);
}
const secs = (performance.now() - t0) / 1000;
const med = (xs, f) => median(xs.map(f));

const summary = {
  machine: machine(),
  runs: o.runs,
  idleConnections: o.idle,
  idlePerConnection: {
    clientRssKiB: med(idle, (r) => r.client.rss) / KiB,
    serverRssKiB: med(idle, (r) => r.server.rss) / KiB,
    clientHeapKiB: med(idle, (r) => r.client.heap) / KiB,
    clientArrayBuffersKiB: med(idle, (r) => r.client.arrayBuffers) / KiB,
    serverHeapKiB: med(idle, (r) => r.server.heap) / KiB,
    serverArrayBuffersKiB: med(idle, (r) => r.server.arrayBuffers) / KiB,
  },
  many: {
    connections: o.many,
    concurrency: o.concurrency,
    openMs: med(many, (r) => r.openMs),
    closeMs: med(many, (r) => r.closeMs),
    open: med(many, (r) => r.open),
    clientRssMiB: med(many, (r) => r.client.rss) / MiB,
    clientRssDeltaMiB: med(many, (r) => r.client.rssDelta) / MiB,
    serverRssMiB: med(many, (r) => r.server.rss) / MiB,
    serverRssDeltaMiB: med(many, (r) => r.server.rssDelta) / MiB,
  },
  rawIdle: idle,
  rawMany: many,
  seconds: secs,
};

if (o.json) console.log(JSON.stringify(summary, null, 2));
else {
  const p = summary.idlePerConnection;
  const m = summary.many;
  console.log(`## Memory per connection — tcp provider, default settings\n`);
  console.log(`machine: ${machine()}; ${o.runs} runs, medians; load average at end ${loadavg()}; ${secs.toFixed(0)} s\n`);
  console.log(`Idle connections (${o.idle} opened one after another; RSS delta / connection after GC; target ≤ 256 KiB):\n`);
  console.log(
    table(
      ["side", "RSS / conn", "JS heap / conn", "ArrayBuffers / conn", "runs (RSS KiB)"],
      [
        ["client", `${fmt(p.clientRssKiB)} KiB`, `${fmt(p.clientHeapKiB)} KiB`, `${fmt(p.clientArrayBuffersKiB)} KiB`, idle.map((r) => fmt(r.client.rss / KiB)).join(" / ")],
        ["server", `${fmt(p.serverRssKiB)} KiB`, `${fmt(p.serverHeapKiB)} KiB`, `${fmt(p.serverArrayBuffersKiB)} KiB`, idle.map((r) => fmt(r.server.rss / KiB)).join(" / ")],
      ],
    ),
  );
  console.log(`\n${o.many} concurrent connections from one process (${o.concurrency} handshakes in flight):\n`);
  console.log(
    table(
      ["open all", "per connection", "close all", "open at the end", "client RSS (Δ)", "server RSS (Δ)", "runs (open ms)"],
      [[`${fmt(m.openMs)} ms`, `${fmt(m.openMs / o.many, 3)} ms`, `${fmt(m.closeMs)} ms`, `${m.open}/${o.many}`, `${fmt(m.clientRssMiB)} MiB (+${fmt(m.clientRssDeltaMiB)})`, `${fmt(m.serverRssMiB)} MiB (+${fmt(m.serverRssDeltaMiB)})`, many.map((r) => fmt(r.openMs)).join(" / ")]],
    ),
  );
  console.log(`\ncommand: node --expose-gc bench/memory.mjs --idle ${o.idle} --many ${o.many} --concurrency ${o.concurrency} --runs ${o.runs}`);
}
