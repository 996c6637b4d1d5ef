#!/usr/bin/env node
// Our tcp provider against plain Node TCP, both sides of each comparison in
// one go, medians over --runs runs (ours and the reference alternate, so
// drift in machine load hits both):
//   bandwidth: `async-rdma perf write_bw` vs a Node socket writing Buffers of
//              the size in a loop with backpressure (bench/lib/node-tcp.mjs bw)
//   latency:   `async-rdma perf write_lat` (and send_lat, write_lat --write_imm)
//              vs a Node TCP ping-pong (bench/lib/node-tcp.mjs pp), half RTT
//
//   node bench/tcp-vs-node.mjs [--runs 3] [--netns] [--json] [--sizes 64,4096,65536,1048576|none] [--lat-iters N] [--node-spin]
//
// --node-spin: the Node reference keeps its event loop turning instead of
// sleeping in epoll between socket events (bench/lib/spin.mjs), as the
// library's default adaptive polling does after activity; without it the
// reference is a plain Node program, which sleeps.
//
// --lat-iters 0 skips the latency tests (bandwidth only; bench/ab.mjs's write-bw entries);
// --sizes none skips the bandwidth tests (latency only; its *-lat entries).
//
// --netns runs each server in one network namespace and each client in
// another, joined by veth (bench/netns.sh; needs root). Without it: loopback.
// A program that reports: it never fails on a number.
import { CLI, NODE, ROOT, flags, fmt, jsonLines, loadavg, machine, median, netnsUp, pair, requireBuild, sizeLabel, table, usageExit } from "./lib/common.mjs";
import { join } from "node:path";

const USAGE = "usage: node bench/tcp-vs-node.mjs [--runs N] [--netns] [--json] [--sizes 64,4096,...] [--lat-iters N] [--node-spin]";
let o;
try {
  o = flags(process.argv.slice(2), { runs: 3, netns: false, json: false, sizes: "64,4096,65536,1048576", "lat-iters": 10000, "node-spin": false });
} catch (e) {
  usageExit(e.message, USAGE);
}
if (!(o.runs >= 1)) usageExit("--runs must be ≥ 1", USAGE);
if (!(o["lat-iters"] >= 0)) usageExit("--lat-iters must be ≥ 0", USAGE);
requireBuild();
const SIZES = o.sizes === "none" ? [] : o.sizes.split(",").map(Number);
/** Same operation count on both sides, sized for ~0.2–2 s per run here. */
const COUNT = (size) => (size <= 4096 ? 50_000 : size <= 65536 ? 10_000 : 1000);
const REF = join(ROOT, "bench", "lib", "node-tcp.mjs");
// The reference's children read it (bench/lib/node-tcp.mjs); ours ignore it.
if (o["node-spin"]) process.env.NODE_REF_SPIN = "1";

let ns = null;
if (o.netns) ns = netnsUp();
const srvHost = ns ? ns.IP_S : "127.0.0.1";
const where = ns ? `two network namespaces over veth (${ns.NS_S} ${ns.IP_S} ← ${ns.NS_C} ${ns.IP_C})` : "loopback (127.0.0.1)";
const side = { serverNetns: ns?.NS_S ?? null, clientNetns: ns?.NS_C ?? null };
const READY = /"type":"listening","port":(\d+)/;

async function ours(test, clientArgs) {
  const r = await pair([NODE, CLI, "perf", test, "-p", "0", "--provider", "tcp", "--json"], (m) => [NODE, CLI, "perf", test, srvHost, "-p", m[1], "--provider", "tcp", "--json", ...clientArgs], { ready: READY, ...side });
  const row = jsonLines(r.client.stdout, "result")[0];
  if (r.client.code !== 0 || !row) return { error: `exit ${r.client.code}: ${(r.client.stderr || r.client.stdout).trim().split("\n").pop()}`, cmd: r.client.cmd, scmd: r.server.cmd };
  return { row, cmd: r.client.cmd, scmd: r.server.cmd };
}

async function ref(mode, size, count) {
  const r = await pair([NODE, REF, "server"], (m) => [NODE, REF, "client", srvHost, m[1], mode, String(size), String(count)], { ready: READY, ...side });
  const row = jsonLines(r.client.stdout, "result")[0];
  if (r.client.code !== 0 || !row) return { error: `exit ${r.client.code}: ${r.client.stderr.trim().split("\n").pop()}`, cmd: r.client.cmd, scmd: r.server.cmd };
  return { row, cmd: r.client.cmd, scmd: r.server.cmd };
}

/** Runs both `runs` times, alternating which goes first; returns medians of `pick`. */
async function compare(a, b, pickA, pickB) {
  const va = [];
  const vb = [];
  let ca = null;
  let cb = null;
  const errs = [];
  for (let i = 0; i < o.runs; i++) {
    const order = i % 2 === 0 ? [a, b] : [b, a];
    for (const f of order) {
      const r = await f();
      if (f === a) {
        ca = r;
        if (r.error) errs.push(`ours: ${r.error}`);
        else va.push(pickA(r.row));
      } else {
        cb = r;
        if (r.error) errs.push(`reference: ${r.error}`);
        else vb.push(pickB(r.row));
      }
    }
  }
  return { ours: median(va), ref: median(vb), oursRuns: va, refRuns: vb, cmdOurs: ca, cmdRef: cb, errors: errs };
}

const results = [];
const t0 = performance.now();
console.error(`tcp-vs-node: ${where}; ${o.runs} runs each; load average ${loadavg()}${o["node-spin"] ? "; the Node reference keeps its loop turning (--node-spin)" : ""}`);
for (const size of SIZES) {
  const n = COUNT(size);
  const r = await compare(
    () => ours("write_bw", ["-s", String(size), "-n", String(n)]),
    () => ref("bw", size, n),
    (row) => row.bwAvg,
    (row) => row.bwAvg,
  );
  results.push({ kind: "bw", what: `write_bw ${sizeLabel(size)}`, size, unit: "MB/s", higherIsBetter: true, ...r });
  console.error(`  bw ${sizeLabel(size)}: ours ${fmt(r.ours)} MB/s, node ${fmt(r.ref)} MB/s`);
}
for (const [test, extra] of o["lat-iters"] === 0 ? [] : [
  ["write_lat", []],
  ["write_lat", ["--write_imm"]],
  ["send_lat", []],
]) {
  const n = o["lat-iters"];
  const r = await compare(
    () => ours(test, ["-s", "8", "-n", String(n), ...extra]),
    () => ref("pp", 8, n),
    (row) => row.tTypical,
    (row) => row.tTypical,
  );
  results.push({ kind: "lat", what: `${test}${extra.length ? " " + extra.join(" ") : ""} 8 B`, size: 8, unit: "µs", higherIsBetter: false, ...r });
  console.error(`  ${test}${extra.length ? " " + extra.join(" ") : ""} 8 B: ours ${fmt(r.ours)} µs, node ping-pong ${fmt(r.ref)} µs`);
}
const secs = (performance.now() - t0) / 1000;

if (o.json) {
  console.log(JSON.stringify({ where, machine: machine(), runs: o.runs, seconds: secs, results }, null, 2));
} else {
  console.log(`\n## tcp provider vs plain Node TCP — ${where}\n`);
  console.log(`machine: ${machine()}; ${o.runs} runs each, medians; load average at end ${loadavg()}; ${secs.toFixed(0)} s${o["node-spin"] ? "; node: its event loop kept turning (--node-spin)" : ""}\n`);
  const rows = results.map((r) => [
    r.what,
    r.kind === "bw" ? "MB/s (avg)" : "µs (typical, half RTT)",
    fmt(r.ours),
    fmt(r.ref),
    fmt(r.ours / r.ref, 3) + "×",
    r.oursRuns.map((x) => fmt(x)).join(" / "),
    r.refRuns.map((x) => fmt(x)).join(" / "),
  ]);
  console.log(table(["test", "unit", "ours", "node", "ours / node", "ours runs", "node runs"], rows));
  const errs = results.flatMap((r) => r.errors.map((e) => `${r.what}: ${e}`));
  if (errs.length) console.log(`\nerrors:\n${errs.map((e) => "  " + e).join("\n")}`);
  console.log("\ncommands (one run of each; the client starts when the server prints its listening line):");
  for (const r of results) {
    if (r.cmdOurs) console.log(`  ours ${r.what}:\n    server: ${r.cmdOurs.scmd}\n    client: ${r.cmdOurs.cmd}`);
    if (r.cmdRef) console.log(`  node ${r.what}:\n    server: ${r.cmdRef.scmd}\n    client: ${r.cmdRef.cmd}`);
  }
}
ns?.down();
