#!/usr/bin/env node
// 1. Connection setup time on loopback: `connect()` to a server in another
//    process (bench/lib/rdma-server.mjs), one at a time, --conns times; each
//    connection is closed (untimed) before the next. Median, p99, min, max;
//    the first connection (device open, JIT) is reported apart. Target ≤ 10 ms.
// 2. allocLocalMr throughput from the pool against registering per allocation
//    (`rdma.registerMr(new ArrayBuffer(n))` + dispose), at 64 B … 1 MiB,
//    alloc + dispose pairs per second, medians over --runs rounds.
//   node bench/setup-and-alloc.mjs [--conns 200] [--runs 3] [--provider tcp] [--json]
// A program that reports: it never fails on a number.
import { fork } from "node:child_process";
import { join } from "node:path";
import { ROOT, flags, fmt, loadavg, machine, median, requireBuild, sizeLabel, table, usageExit } from "./lib/common.mjs";

const USAGE = "usage: node bench/setup-and-alloc.mjs [--conns N] [--runs N] [--provider tcp|verbs|auto] [--host 127.0.0.1] [--ms 300] [--json]";
let o;
try {
  o = flags(process.argv.slice(2), { conns: 200, runs: 3, provider: "tcp", host: "127.0.0.1", ms: 300, json: false });
} catch (e) {
  usageExit(e.message, USAGE);
}
requireBuild();
const { RdmaBuilder } = await import(join(ROOT, "dist", "src", "index.js"));
const SIZES = [64, 4096, 65536, 1 << 20];

const child = fork(join(ROOT, "bench", "lib", "rdma-server.mjs"), ["--provider", o.provider, "--host", o.host], { stdio: ["ignore", "inherit", "inherit", "ipc"] });
const { port } = await new Promise((resolve) => child.once("message", resolve));
const exited = new Promise((resolve) => child.once("exit", resolve));
const builder = () => new RdmaBuilder().setProvider(o.provider);

// ------------------------------------------------------------ setup time
const times = [];
let first = NaN;
for (let i = 0; i <= o.conns; i++) {
  const t = performance.now();
  const rdma = await builder().connect({ host: o.host, port });
  const dt = performance.now() - t;
  if (i === 0) first = dt;
  else times.push(dt);
  // Keep one connection (and so the device) open for the allocation part; close the rest untimed.
  if (i === 0) globalThis.keep = rdma;
  else await rdma.close();
}
times.sort((a, b) => a - b);
const pct = (p) => times[Math.min(times.length - 1, Math.ceil(p * times.length) - 1)];
const setup = { conns: o.conns, first, median: median(times), p99: pct(0.99), min: times[0], max: times[times.length - 1], mean: times.reduce((a, b) => a + b, 0) / times.length };

// ------------------------------------------------------ allocation rate
const rdma = globalThis.keep;
function rate(fn) {
  // warm up, then count pairs for o.ms milliseconds
  for (let i = 0; i < 200; i++) fn();
  let n = 0;
  const t0 = performance.now();
  let t = t0;
  while (t - t0 < o.ms) {
    for (let i = 0; i < 50; i++) fn();
    n += 50;
    t = performance.now();
  }
  return n / ((t - t0) / 1000);
}
const alloc = [];
for (const size of SIZES) {
  const pool = [];
  const reg = [];
  for (let r = 0; r < o.runs; r++) {
    pool.push(rate(() => rdma.allocLocalMr(size).dispose()));
    reg.push(rate(() => rdma.registerMr(new ArrayBuffer(size)).dispose()));
  }
  alloc.push({ size, pool: median(pool), register: median(reg), poolRuns: pool, registerRuns: reg });
}
const stats = rdma.stats().pool;
await rdma.close();
child.send({ cmd: "exit" });
await exited;

const out = { machine: machine(), provider: o.provider, setup, alloc, poolStats: stats };
if (o.json) console.log(JSON.stringify(out, null, 2));
else {
  console.log(`## Connection setup and allocation — ${o.provider} provider\n`);
  console.log(`machine: ${machine()}; load average at end ${loadavg()}\n`);
  console.log(`Connection setup on ${o.host} (${o.conns} connections, one at a time, server in another process; target ≤ 10 ms):\n`);
  console.log(table(["median", "p99", "min", "max", "mean", "first (device open, cold JIT)"], [[`${fmt(setup.median, 3)} ms`, `${fmt(setup.p99, 3)} ms`, `${fmt(setup.min, 3)} ms`, `${fmt(setup.max, 3)} ms`, `${fmt(setup.mean, 3)} ms`, `${fmt(setup.first, 3)} ms`]]));
  console.log(`\nallocLocalMr (pool) vs registerMr(new ArrayBuffer(n)) per allocation, alloc+dispose pairs per second (medians of ${o.runs}):\n`);
  console.log(table(["size", "pool (allocLocalMr)", "register per allocation", "pool / register", "pool runs", "register runs"], alloc.map((a) => [sizeLabel(a.size), `${fmt(a.pool / 1e3)} k/s`, `${fmt(a.register / 1e3)} k/s`, `${fmt(a.pool / a.register, 3)}×`, a.poolRuns.map((x) => fmt(x / 1e3)).join(" / "), a.registerRuns.map((x) => fmt(x / 1e3)).join(" / ")])));
  console.log(`\npool after the run: ${JSON.stringify(stats)}`);
  console.log(`\ncommand: node bench/setup-and-alloc.mjs --conns ${o.conns} --runs ${o.runs} --provider ${o.provider}`);
}
