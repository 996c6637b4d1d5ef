#!/usr/bin/env node
// async-rdma/rpc against the same echo RPC over a plain Node socket (length-
// prefixed frames with request ids, replies written as they are ready), the
// server in a child process, the client here. Calls/s and p99 latency at
// concurrency 1 and 64, 32-byte payloads, medians over --runs (ours and the
// reference alternate so machine-load drift hits both). Payloads of 32 B and
// 4 KiB (--sizes), concurrency 1 and 64. Each run first calls for --warmup-ms
// (default 2000) at the same size and concurrency, unmeasured, so both
// sides are measured with their code optimised: a run of a few thousand
// calls without it measures mostly V8 compiling the library's code (the
// library has more of it than the ~30 lines of the reference).
//
// --eager BYTES sets our eager threshold on both sides (default: the
// library's, 4 KiB + 64): RPC calls travel batched up to it. --layer sendrecv
// measures, instead of async-rdma/rpc, the same echo written on rdma.send()
// and rdma.receive() (the server sends each message it receives back; the
// client keeps the concurrency's worth of send-then-receive in flight).
//
//
// --node-spin: the Node socket reference (server and client) keeps its event
// loop turning instead of sleeping in epoll between socket events
// (bench/lib/spin.mjs), as the library's default adaptive polling does after
// activity; without it the reference is a plain Node program, which sleeps.
//
//   node bench/rpc-vs-node.mjs [--runs 3] [--calls 20000] [--warmup-ms 2000] [--sizes 32,4096] [--provider tcp|verbs] [--eager BYTES] [--layer rpc|sendrecv] [--node-spin]
//
// A program that reports: it never fails on a number.
import { spawn } from "node:child_process";
import net from "node:net";
import { fileURLToPath } from "node:url";
import { nodeRpcClient, serveNodeEcho } from "./lib/node-rpc.mjs";
import { keepTurning, spinIfAsked } from "./lib/spin.mjs";

const args = Object.fromEntries(process.argv.slice(2).reduce((a, v, i, all) => (v.startsWith("--") ? [...a, [v.slice(2), all[i + 1]]] : a), []));
const RUNS = Number(args.runs ?? 3);
const CALLS = Number(args.calls ?? 20000);
const WARMUP_MS = Number(args["warmup-ms"] ?? 2000);
const SIZES = String(args.sizes ?? "32,4096").split(",").map(Number);
const PROVIDER = args.provider ?? process.env.ASYNC_RDMA_PROVIDER ?? "tcp";
const EAGER = args.eager ?? process.env.RPC_BENCH_EAGER;
const LAYER = args.layer ?? process.env.RPC_BENCH_LAYER ?? "rpc";
if (LAYER !== "rpc" && LAYER !== "sendrecv") throw new Error("--layer rpc|sendrecv");
const RECV_DEPTH = process.env.RPC_BENCH_RECV_DEPTH;
const NODE_SPIN = process.argv.includes("--node-spin") || process.env.NODE_REF_SPIN === "1";
if (NODE_SPIN) process.env.NODE_REF_SPIN = "1"; // the node server child reads it
const builder = (B) => {
  const b = new B().setProvider(PROVIDER);
  if (EAGER !== undefined) b.setEagerThreshold(Number(EAGER));
  if (RECV_DEPTH !== undefined) b.setRecvDepth(Number(RECV_DEPTH));
  return b;
};
const self = fileURLToPath(import.meta.url);
const dist = new URL("../dist/src/", import.meta.url);

if (process.argv[2] === "--serve") {
  const kind = process.argv[3];
  if (kind === "rdma") {
    const { RdmaBuilder } = await import(new URL("index.js", dist));
    const { RpcServer } = await import(new URL("rpc/index.js", dist));
    const l = await builder(RdmaBuilder).bind("127.0.0.1:0");
    console.log(`port ${l.port}`);
    if (LAYER === "rpc") await new RpcServer({ echo: (b) => b }).listen(l);
    else {
      for (;;) {
        const rdma = await l.accept();
        void (async () => {
          for (;;) {
            let m;
            try {
              m = await rdma.receive();
            } catch {
              return; // the client closed
            }
            rdma.send(m).then(() => m[Symbol.dispose](), () => m[Symbol.dispose]());
          }
        })();
      }
    }
  } else {
    spinIfAsked();
    const srv = net.createServer({ noDelay: true }, serveNodeEcho);
    srv.listen(0, "127.0.0.1", () => console.log(`port ${srv.address().port}`));
  }
} else {
  const server = async (kind) => {
    const p = spawn(process.execPath, [self, "--serve", kind], { stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, ASYNC_RDMA_PROVIDER: PROVIDER, RPC_BENCH_LAYER: LAYER, ...(EAGER === undefined ? {} : { RPC_BENCH_EAGER: String(EAGER) }) } });
    const port = await new Promise((res, rej) => {
      p.stdout.on("data", (d) => {
        const m = /port (\d+)/.exec(d.toString());
        if (m) res(Number(m[1]));
      });
      p.on("exit", (c) => rej(new Error(`server exited ${c}`)));
    });
    return { port, stop: () => p.kill() };
  };
  async function rdmaClient(port) {
    const { RdmaBuilder } = await import(new URL("index.js", dist));
    const { RpcClient } = await import(new URL("rpc/index.js", dist));
    const rdma = await builder(RdmaBuilder).connect(`127.0.0.1:${port}`);
    if (LAYER === "sendrecv") {
      return {
        call: async (b) => {
          await rdma.send(b);
          (await rdma.receive())[Symbol.dispose]();
        },
        close: () => rdma.close(),
      };
    }
    const c = new RpcClient(rdma);
    return { call: (b) => c.call("echo", b), close: () => c.close() };
  }
  async function nodeClient(port) {
    const s = net.connect({ port, host: "127.0.0.1", noDelay: true });
    await new Promise((r) => s.once("connect", r));
    const stopSpin = NODE_SPIN ? keepTurning() : () => {};
    const call = nodeRpcClient(s);
    return {
      call,
      close: async () => {
        stopSpin();
        s.destroy();
      },
    };
  }
  async function run(kind, conc, size) {
    const srv = await server(kind);
    const c = kind === "rdma" ? await rdmaClient(srv.port) : await nodeClient(srv.port);
    const payload = new Uint8Array(size).fill(7);
    // warm-up: the same load for WARMUP_MS, unmeasured
    const w0 = performance.now();
    await Promise.all(Array.from({ length: conc }, async () => {
      while (performance.now() - w0 < WARMUP_MS) await c.call(payload);
    }));
    const lat = [];
    let next = 0;
    const t0 = performance.now();
    await Promise.all(Array.from({ length: conc }, async () => {
      while (next++ < CALLS) {
        const s = performance.now();
        await c.call(payload);
        lat.push(performance.now() - s);
      }
    }));
    const secs = (performance.now() - t0) / 1000;
    await c.close();
    srv.stop();
    lat.sort((a, b) => a - b);
    return { rate: CALLS / secs, p50: lat[Math.floor(lat.length * 0.5)], p99: lat[Math.floor(lat.length * 0.99)] };
  }
  const med = (xs) => xs.slice().sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  console.log(`# ${LAYER === "rpc" ? "rpc" : "send/receive"} echo, ${CALLS} calls after ${WARMUP_MS} ms of warm-up, ${RUNS} runs (medians), provider ${PROVIDER}${EAGER === undefined ? "" : `, eager threshold ${EAGER} B both sides`}${NODE_SPIN ? ", the node reference's event loops kept turning (--node-spin)" : ""}; load ${(await import("node:os")).loadavg()[0].toFixed(2)}`);
  console.log(`| payload | concurrency | ${LAYER === "rpc" ? "async-rdma/rpc" : "send/receive"} calls/s | p50 ms | p99 ms | node socket calls/s | p50 ms | p99 ms | ratio |`);
  console.log("|---|---|---|---|---|---|---|---|---|");
  for (const size of SIZES) {
    for (const conc of [1, 64]) {
      const ours = [];
      const ref = [];
      for (let r = 0; r < RUNS; r++) {
        ours.push(await run("rdma", conc, size));
        ref.push(await run("node", conc, size));
      }
      const o = med(ours.map((x) => x.rate));
      const n = med(ref.map((x) => x.rate));
      const f = (xs, k) => med(xs.map((x) => x[k])).toFixed(3);
      console.log(`| ${size} B | ${conc} | ${o.toFixed(0)} | ${f(ours, "p50")} | ${f(ours, "p99")} | ${n.toFixed(0)} | ${f(ref, "p50")} | ${f(ref, "p99")} | ${(o / n).toFixed(2)} |`);
    }
  }
}
