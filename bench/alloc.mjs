#!/usr/bin/env node
// Heap allocated per message on the send/receive path, both sides in this
// process (tcp provider), and where it is allocated:
//
//   node bench/alloc.mjs [--messages 20000] [--window 64|1] [--size 64] [--sites 25] [--cpu-runs 3] [--cpu-only] [--polling adaptive|event|busy]
//
// --window 64: the sender keeps 64 sends in flight (send-inprocess.mjs's
// loop); --window 1: a ping-pong (send, the peer receives and answers).
// Bytes per message come from v8.GCProfiler (heap used before each GC minus
// after the previous one, over the measured window); the sites from a
// sampling heap profile that keeps collected objects (inspector
// HeapProfiler.startSampling), summed by allocating function and by layer
// (dist/src/<layer>/). Before the profiled pass, --cpu-runs passes measure
// CPU µs per message (process.cpuUsage, both sides; steadier than a rate on
// a busy machine); --cpu-only prints that alone, as JSON. Sampled: a site's figure is an estimate (±10 %); the
// total from the GC profiler is exact up to the last GC's granularity.
// --polling: both sides' polling mode (default: the builder's, "adaptive").
//
// A program that reports: it never fails on a number.
import v8 from "node:v8";
import inspector from "node:inspector";
import { loadavg } from "node:os";

const args = Object.fromEntries(process.argv.slice(2).reduce((a, v, i, all) => (v.startsWith("--") ? [...a, [v.slice(2), all[i + 1]]] : a), []));
const N = Number(args.messages ?? 20000);
const W = Number(args.window ?? 64);
const SIZE = Number(args.size ?? 64);
const SITES = Number(args.sites ?? 25);
const { RdmaBuilder } = await import(new URL("../dist/src/index.js", import.meta.url));

const builder = () => (args.polling ? new RdmaBuilder().setProvider("tcp").setPolling(args.polling) : new RdmaBuilder().setProvider("tcp"));
const listener = await builder().bind("127.0.0.1:0");
const accepted = listener.accept();
const c = await builder().connect(`127.0.0.1:${listener.port}`);
const s = await accepted;
const cm = c.allocLocalMr(SIZE);
const sm = s.allocLocalMr(SIZE);

async function windowed(n) {
  const receiving = (async () => {
    for (let i = 0; i < n; i++) (await s.receive()).dispose();
  })();
  let posted = 0;
  let done = 0;
  await new Promise((resolve, reject) => {
    const fill = () => {
      while (posted < n && posted - done < W) {
        posted++;
        c.send(cm).then(() => (++done === n ? resolve() : fill()), reject);
      }
    };
    fill();
  });
  await receiving;
}

async function pingpong(n) {
  const echo = (async () => {
    for (let i = 0; i < n; i++) {
      (await s.receive()).dispose();
      await s.send(sm);
    }
  })();
  for (let i = 0; i < n; i++) {
    await c.send(cm);
    (await c.receive()).dispose();
  }
  await echo;
}

const run = W === 1 ? pingpong : windowed;
// A ping-pong moves two messages per round trip.
const perRun = W === 1 ? 2 : 1;
await run(N); // warm-up: V8 compiles, pools fill

// CPU per message (both sides, this process), without the profiler: --cpu-runs passes, median.
const cpuRuns = Number(args["cpu-runs"] ?? 3);
const cpu = [];
for (let i = 0; i < cpuRuns; i++) {
  const c0 = process.cpuUsage();
  await run(N);
  const d = process.cpuUsage(c0);
  cpu.push((d.user + d.system) / (N * (W === 1 ? 2 : 1)));
}
cpu.sort((a, b) => a - b);
if (process.argv.includes("--cpu-only")) {
  console.log(JSON.stringify({ window: W, size: SIZE, cpuUsPerMessage: cpu[cpu.length >> 1], min: cpu[0], max: cpu.at(-1), load: loadavg()[0] }));
  await Promise.all([c.close(), s.close()]);
  await listener.close();
  process.exit(0);
}

const session = new inspector.Session();
session.connect();
const post = (m, p) => new Promise((res, rej) => session.post(m, p ?? {}, (e, r) => (e ? rej(e) : res(r))));
await post("HeapProfiler.enable");
await post("HeapProfiler.startSampling", { samplingInterval: 128, includeObjectsCollectedByMajorGC: true, includeObjectsCollectedByMinorGC: true });
const gcp = new v8.GCProfiler();
const heap0 = v8.getHeapStatistics().used_heap_size;
gcp.start();
await run(N);
const heap1 = v8.getHeapStatistics().used_heap_size;
const g = gcp.stop();
const { profile } = await post("HeapProfiler.stopSampling");
session.disconnect();

let alloc = 0;
let prev = heap0;
for (const st of g.statistics) {
  alloc += st.beforeGC.heapStatistics.usedHeapSize - prev;
  prev = st.afterGC.heapStatistics.usedHeapSize;
}
alloc += heap1 - prev;
const msgs = N * perRun;

const layerOf = (url) => {
  const m = /\/dist\/src\/([^/]+)(?:\/([^/]+))?/.exec(url ?? "");
  if (!m) return /alloc\.mjs/.test(url ?? "") ? "benchmark" : "node/builtins";
  return m[1] === "transport" && m[2] && !m[2].endsWith(".js") ? `transport/${m[2]}` : m[1];
};
const sites = new Map();
const layers = new Map();
let sampled = 0;
const walk = (n, inherited) => {
  const f = n.callFrame;
  const own = layerOf(f.url);
  const layer = own === "node/builtins" && inherited ? inherited : own;
  const key = `${f.functionName || "(anonymous)"} ${(f.url ?? "").replace(/^.*\/dist\/src\//, "").replace(/^.*\/bench\//, "bench/")}:${f.lineNumber + 1}`;
  if (n.selfSize > 0) {
    // A builtin's allocation is charged to the library code that called it.
    const k = own === "node/builtins" && inherited ? `${key}  <- ${inherited}` : key;
    sites.set(k, (sites.get(k) ?? 0) + n.selfSize);
    layers.set(layer, (layers.get(layer) ?? 0) + n.selfSize);
    sampled += n.selfSize;
  }
  for (const ch of n.children ?? []) walk(ch, own === "node/builtins" ? inherited : own);
};
walk(profile.head, null);

const per = (b) => (b / msgs).toFixed(0).padStart(6);
console.log(`heap per message, ${W === 1 ? "ping-pong (2 messages per round trip)" : `window ${W}`}, ${SIZE} B, ${N * perRun} messages, both sides in one process (tcp); load ${loadavg().map((x) => x.toFixed(2)).join(" ")}`);
console.log(`  GC profiler: ${per(alloc)} B/message (${g.statistics.length} GCs); sampled: ${per(sampled)} B/message; CPU ${cpu[cpu.length >> 1].toFixed(2)} µs/message (median of ${cpuRuns}, ${cpu[0].toFixed(2)}-${cpu.at(-1).toFixed(2)})`);
console.log("by layer (sampled):");
for (const [k, v] of [...layers].sort((a, b) => b[1] - a[1])) if (v / msgs >= 8) console.log(`  ${per(v)} B  ${k}`);
console.log(`top ${SITES} sites (sampled):`);
for (const [k, v] of [...sites].sort((a, b) => b[1] - a[1]).slice(0, SITES)) console.log(`  ${per(v)} B  ${k}`);

cm.dispose();
sm.dispose();
await c.close();
await s.close();
await listener.close();
