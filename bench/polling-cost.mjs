#!/usr/bin/env node
// What polling costs and gains on the tcp provider: an async-rdma/rpc echo
// (32 bytes by default) between two processes, both sides in one polling
// mode, the modes alternating run by run. Two traffic shapes:
//   tight   calls back to back, --conc in flight (default 1)
//   sparse  one call every --gap-ms milliseconds (a timer between calls)
//   oneway  send() back to back, --conc in flight, to a server that only
//           receives (it sends nothing but CREDIT messages back)
// For each mode: calls/s (tight) or the mean time per call (sparse), and
// each side's CPU per call (client from process.cpuUsage(), server from
// /proc/<pid>/stat: Linux only). Busy and adaptive polling spin after
// activity; on sparse traffic that spin is paid for and not used.
//
// --handler async: the server answers after a turn of its event loop (it
// awaits a setImmediate, as a handler that awaits I/O would), so its
// acknowledgement of the call travels alone, before the answer.
//
//   node bench/polling-cost.mjs [--shape tight|sparse|oneway] [--modes event,adaptive] [--runs 3]
//                               [--calls N] [--conc 1] [--gap-ms 1] [--size 32] [--handler sync|async]
//
// A program that reports: it never fails on a number.
import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { loadavg } from "node:os";
import { fileURLToPath } from "node:url";

const args = Object.fromEntries(process.argv.slice(2).reduce((a, v, i, all) => (v.startsWith("--") ? [...a, [v.slice(2), all[i + 1]]] : a), []));
const SHAPE = args.shape ?? "tight";
if (SHAPE !== "tight" && SHAPE !== "sparse" && SHAPE !== "oneway") throw new Error("--shape tight|sparse|oneway");
const MODES = String(args.modes ?? "event,adaptive").split(",");
const RUNS = Number(args.runs ?? 3);
const CONC = Number(args.conc ?? 1);
const GAP_MS = Number(args["gap-ms"] ?? 1);
const SIZE = Number(args.size ?? 32);
const HANDLER = args.handler ?? "sync";
if (HANDLER !== "sync" && HANDLER !== "async") throw new Error("--handler sync|async");
const CALLS = Number(args.calls ?? (SHAPE === "sparse" ? 2000 : 20000));
const self = fileURLToPath(import.meta.url);
const dist = new URL("../dist/src/", import.meta.url);
const { RdmaBuilder } = await import(new URL("index.js", dist));
const { RpcServer, RpcClient } = await import(new URL("rpc/index.js", dist));

if (process.argv[2] === "--serve") {
  const l = await new RdmaBuilder().setProvider("tcp").setPolling(process.argv[3]).bind("127.0.0.1:0");
  console.log(`port ${l.port}`);
  if (process.argv[5] === "oneway") {
    // Receives and drops each message: this side only sends CREDIT messages back.
    for (;;) {
      const rdma = await l.accept();
      void (async () => {
        for (;;) {
          try {
            (await rdma.receive())[Symbol.dispose]();
          } catch {
            return; // the client closed
          }
        }
      })();
    }
  }
  const echo = process.argv[4] === "async" ? (b) => new Promise((r) => setImmediate(() => r(b))) : (b) => b;
  await new RpcServer({ echo }).listen(l);
} else {
  /** One run in `mode`: { rate, perCallUs, clientUs, serverUs }. */
  async function run(mode) {
    const p = spawn(process.execPath, [self, "--serve", mode, HANDLER, SHAPE], { stdio: ["ignore", "pipe", "inherit"] });
    const port = await new Promise((res, rej) => {
      p.stdout.on("data", (d) => {
        const m = /port (\d+)/.exec(d.toString());
        if (m) res(Number(m[1]));
      });
      p.on("exit", (c) => rej(new Error(`server exited ${c}`)));
    });
    /** The server's CPU time so far, µs (utime + stime, clock ticks of 10 ms). */
    const serverCpu = () => {
      const f = readFileSync(`/proc/${p.pid}/stat`, "utf8").split(") ")[1].split(" ");
      return (Number(f[11]) + Number(f[12])) * 10_000;
    };
    const rdma = await new RdmaBuilder().setProvider("tcp").setPolling(mode).connect(`127.0.0.1:${port}`);
    const c = SHAPE === "oneway" ? { call: (_m, b) => rdma.send(b), close: () => rdma.close() } : new RpcClient(rdma);
    const payload = new Uint8Array(SIZE).fill(7);
    try {
      // Warm-up: the same traffic, unmeasured (a tenth of the calls, at least 2 s when tight).
      const w0 = performance.now();
      if (SHAPE !== "sparse") await Promise.all(Array.from({ length: CONC }, async () => { while (performance.now() - w0 < 2000) await c.call("echo", payload); }));
      else for (let i = 0; i < Math.max(100, CALLS / 10); i++) await c.call("echo", payload);
      const c0 = process.cpuUsage();
      const s0 = serverCpu();
      const t0 = performance.now();
      let inCalls = 0;
      if (SHAPE !== "sparse") {
        let next = 0;
        await Promise.all(Array.from({ length: CONC }, async () => { while (next++ < CALLS) await c.call("echo", payload); }));
      } else {
        for (let i = 0; i < CALLS; i++) {
          await new Promise((r) => setTimeout(r, GAP_MS));
          const s = performance.now();
          await c.call("echo", payload);
          inCalls += performance.now() - s;
        }
      }
      const secs = (performance.now() - t0) / 1000;
      const cu = process.cpuUsage(c0);
      const su = serverCpu() - s0;
      return { rate: CALLS / secs, perCallUs: (inCalls * 1000) / CALLS, clientUs: (cu.user + cu.system) / CALLS, serverUs: su / CALLS };
    } finally {
      await c.close();
      p.kill();
    }
  }
  const med = (xs) => xs.slice().sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  const res = Object.fromEntries(MODES.map((m) => [m, []]));
  for (let r = 0; r < RUNS; r++) for (const m of r % 2 ? [...MODES].reverse() : MODES) res[m].push(await run(m));
  const what = SHAPE === "tight" ? `${CONC} in flight, back to back` : SHAPE === "oneway" ? `one-way send() to a receiver that only receives, ${CONC} in flight (each "call" is a send)` : `one call every ${GAP_MS} ms`;
  console.log(`# rpc echo ${SIZE} B${HANDLER === "async" ? " (answered after a turn of the server's loop)" : ""}, ${what}, ${CALLS} calls, tcp provider, both sides in the mode; ${RUNS} runs (medians, modes alternating); load ${loadavg()[0].toFixed(2)}`);
  console.log(`| polling | ${SHAPE !== "sparse" ? "calls/s" : "µs per call"} | client CPU µs/call | server CPU µs/call | runs (${SHAPE !== "sparse" ? "calls/s" : "µs per call"}) |`);
  console.log("|---|---|---|---|---|");
  for (const m of MODES) {
    const key = SHAPE !== "sparse" ? "rate" : "perCallUs";
    const xs = res[m];
    console.log(`| ${m} | ${med(xs.map((x) => x[key])).toFixed(SHAPE !== "sparse" ? 0 : 1)} | ${med(xs.map((x) => x.clientUs)).toFixed(1)} | ${med(xs.map((x) => x.serverUs)).toFixed(1)} | ${xs.map((x) => x[key].toFixed(SHAPE !== "sparse" ? 0 : 1)).join(" / ")} |`);
  }
}
