#!/usr/bin/env node
// CPU time per RPC call, client and server in one process: async-rdma/rpc
// (tcp provider, loopback) against the same echo RPC over a plain Node socket
// (bench/lib/node-rpc.mjs: framed, request ids matched through a Map, as
// bench/rpc-vs-node.mjs measures it), and against a bare Node ping-pong of
// one fixed 44-byte buffer (no framing, no ids: the floor of any RPC on a
// socket).
// CPU seconds (user + sys) per call hold up better than calls/s on a loaded
// machine: they count what each call costs, not how long it waited for a core.
// Runs alternate (ours, node, ours, ...); prints min and median per side.
// Each run first calls for --warmup-ms (default 2000), unmeasured: the CPU
// counted is the steady state's, not V8 compiling the library's code.
//
//   node bench/rpc-cpu.mjs [--runs 4] [--calls 15000] [--size 32] [--warmup-ms 2000]
//
// A program that reports: it never fails on a number.
import net from "node:net";
import { nodeRpcPair } from "./lib/node-rpc.mjs";

const args = Object.fromEntries(process.argv.slice(2).reduce((a, v, i, all) => (v.startsWith("--") ? [...a, [v.slice(2), all[i + 1]]] : a), []));
const RUNS = Number(args.runs ?? 4);
const N = Number(args.calls ?? 15000);
const SIZE = Number(args.size ?? 32);
const WARMUP_MS = Number(args["warmup-ms"] ?? 2000);
const dist = new URL("../dist/src/", import.meta.url);
const { RdmaBuilder } = await import(new URL("index.js", dist));
const { RpcServer, RpcClient } = await import(new URL("rpc/index.js", dist));

async function measure(call) {
  const w0 = performance.now();
  while (performance.now() - w0 < WARMUP_MS) await call();
  const cpu0 = process.cpuUsage();
  for (let i = 0; i < N; i++) await call();
  const cpu = process.cpuUsage(cpu0);
  return (cpu.user + cpu.system) / N;
}

async function ours() {
  const l = await new RdmaBuilder().setProvider("tcp").bind("127.0.0.1:0");
  void new RpcServer({ echo: (b) => b }).listen(l);
  const c = new RpcClient(await new RdmaBuilder().setProvider("tcp").connect(`127.0.0.1:${l.port}`));
  const payload = new Uint8Array(SIZE).fill(7);
  const us = await measure(() => c.call("echo", payload));
  await c.close();
  await l.close();
  return us;
}

async function nodeRpc() {
  const rpc = await nodeRpcPair();
  const payload = Buffer.alloc(SIZE, 7);
  const us = await measure(() => rpc.call(payload));
  rpc.close();
  return us;
}

async function node() {
  const srv = net.createServer({ noDelay: true }, (s) => {
    s.on("data", (d) => s.write(d));
    s.on("error", () => {});
  });
  await new Promise((r) => srv.listen(0, "127.0.0.1", r));
  const s = net.connect({ port: srv.address().port, host: "127.0.0.1", noDelay: true });
  await new Promise((r) => s.once("connect", r));
  let done = null;
  s.on("data", () => done());
  // one fixed buffer the size of a framed call, never parsed: the floor of any RPC on a socket
  const frame = Buffer.alloc(12 + SIZE);
  const us = await measure(() => new Promise((r) => ((done = r), s.write(frame))));
  s.destroy();
  srv.close();
  return us;
}

const a = [];
const r = [];
const b = [];
for (let i = 0; i < RUNS; i++) {
  a.push(await ours());
  r.push(await nodeRpc());
  b.push(await node());
}
const med = (xs) => xs.slice().sort((x, y) => x - y)[Math.floor(xs.length / 2)];
const stat = (xs) => `min ${Math.min(...xs).toFixed(1)} µs, median ${med(xs).toFixed(1)} µs`;
console.log(`# CPU per echo call (client + server, one process), ${SIZE} B, ${N} calls × ${RUNS} runs; load ${(await import("node:os")).loadavg()[0].toFixed(2)}`);
console.log(`async-rdma/rpc (tcp): ${stat(a)}`);
console.log(`node socket RPC:      ${stat(r)}`);
console.log(`node ping-pong:       ${stat(b)}`);
console.log(`ratio of medians: ${(med(a) / med(r)).toFixed(2)} against the node socket RPC, ${(med(a) / med(b)).toFixed(2)} against the bare ping-pong`);
process.exit(0);
