#!/usr/bin/env node
// Our tcp provider against UCX over TCP (ucx_perftest, UCX_TLS=tcp), both
// sides of each comparison in one go, medians over --runs runs:
//   ucp_put_bw  (64 B … 1 MiB)  vs  async-rdma perf write_bw
//   ucp_put_lat (8 B)           vs  async-rdma perf write_lat   (both: put into the peer's memory, poll own memory)
//   tag_lat     (8 B)           vs  async-rdma perf send_lat    (both: two-sided ping-pong)
// Run through bench/tcp-vs-ucx.sh (which installs ucx-utils when missing).
import net from "node:net";
import { CLI, NODE, flags, fmt, jsonLines, loadavg, machine, median, netnsUp, pair, requireBuild, sizeLabel, table, usageExit } from "./common.mjs";

const USAGE = "usage: sh bench/tcp-vs-ucx.sh [--runs N] [--netns] [--json] [--sizes 64,4096,65536,1048576] [--lat-iters N]";
let o;
try {
  o = flags(process.argv.slice(2), { runs: 3, netns: false, json: false, sizes: "64,4096,65536,1048576", "lat-iters": 10000 });
} catch (e) {
  usageExit(e.message, USAGE);
}
requireBuild();
const SIZES = o.sizes.split(",").map(Number);
const COUNT = (size) => (size <= 4096 ? 50_000 : size <= 65536 ? 10_000 : 1000);
const UCX_ENV = { ...process.env, UCX_TLS: "tcp" };

let ns = null;
if (o.netns) ns = netnsUp();
const srvHost = ns ? ns.IP_S : "127.0.0.1";
const where = ns ? `two network namespaces over veth (${ns.NS_S} ${ns.IP_S} ← ${ns.NS_C} ${ns.IP_C})` : "loopback (127.0.0.1)";
const side = { serverNetns: ns?.NS_S ?? null, clientNetns: ns?.NS_C ?? null };

/** A port that was free a moment ago (ucx_perftest has no "any port"). */
function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.listen(0, "127.0.0.1", () => {
      const p = s.address().port;
      s.close(() => resolve(p));
    });
  });
}

async function ours(test, clientArgs) {
  const r = await pair([NODE, CLI, "perf", test, "-p", "0", "--provider", "tcp", "--json"], (m) => [NODE, CLI, "perf", test, srvHost, "-p", m[1], "--provider", "tcp", "--json", ...clientArgs], { ready: /"type":"listening","port":(\d+)/, ...side });
  const row = jsonLines(r.client.stdout, "result")[0];
  if (r.client.code !== 0 || !row) return { error: `exit ${r.client.code}: ${(r.client.stderr || r.client.stdout).trim().split("\n").pop()}`, cmd: r.client.cmd, scmd: r.server.cmd };
  return { row, cmd: r.client.cmd, scmd: r.server.cmd };
}

/** ucx_perftest's final line: iterations, 50%ile, average, overall (µs), bandwidth avg/overall (MB/s, 2^20), msg rate avg/overall. */
function parseUcx(text) {
  const lines = text.split("\n").filter((l) => /^\s*(Final:)?\s+\d+\s+[\d.]+\s+[\d.]+/.test(l));
  const last = lines.pop();
  if (!last) return null;
  const v = last.replace("Final:", "").trim().split(/\s+/).map(Number);
  return { iterations: v[0], typical: v[1], avg: v[2], overall: v[3], bwAvg: v[4], bwOverall: v[5], msgRate: v[6] };
}

async function ucx(test, size, count, warm) {
  const port = String(await freePort());
  const args = ["-t", test, "-s", String(size), "-n", String(count), "-w", String(warm), "-p", port];
  const r = await pair(["stdbuf", "-oL", "ucx_perftest", ...args], () => ["ucx_perftest", srvHost, ...args], { ready: /Waiting for connection/, env: UCX_ENV, ...side });
  const row = parseUcx(r.client.stdout);
  if (r.client.code !== 0 || !row) return { error: `exit ${r.client.code}: ${(r.client.stderr || r.client.stdout).trim().split("\n").pop()}`, cmd: `UCX_TLS=tcp ${r.client.cmd}`, scmd: `UCX_TLS=tcp ${r.server.cmd}` };
  return { row, cmd: `UCX_TLS=tcp ${r.client.cmd}`, scmd: `UCX_TLS=tcp ${r.server.cmd}` };
}

async function compare(a, b, pickA, pickB) {
  const va = [];
  const vb = [];
  let ca = null;
  let cb = null;
  const errs = [];
  for (let i = 0; i < o.runs; i++) {
    for (const f of i % 2 === 0 ? [a, b] : [b, a]) {
      const r = await f();
      if (f === a) {
        ca = r;
        if (r.error) errs.push(`ours: ${r.error}`);
        else va.push(pickA(r.row));
      } else {
        cb = r;
        if (r.error) errs.push(`ucx: ${r.error}`);
        else vb.push(pickB(r.row));
      }
    }
  }
  return { ours: median(va), ref: median(vb), oursRuns: va, refRuns: vb, cmdOurs: ca, cmdRef: cb, errors: errs };
}

const results = [];
const t0 = performance.now();
console.error(`tcp-vs-ucx: ${where}; ${o.runs} runs each; load average ${loadavg()}`);
for (const size of SIZES) {
  const n = COUNT(size);
  const r = await compare(
    () => ours("write_bw", ["-s", String(size), "-n", String(n)]),
    () => ucx("ucp_put_bw", size, n, Math.min(n, 1000)),
    (row) => row.bwAvg,
    (row) => row.bwAvg,
  );
  results.push({ kind: "bw", what: `write_bw vs ucp_put_bw ${sizeLabel(size)}`, ...r });
  console.error(`  bw ${sizeLabel(size)}: ours ${fmt(r.ours)} MB/s, ucx ${fmt(r.ref)} MB/s`);
}
for (const [test, ref] of [
  ["write_lat", "ucp_put_lat"],
  ["send_lat", "tag_lat"],
]) {
  const n = o["lat-iters"];
  const r = await compare(
    () => ours(test, ["-s", "8", "-n", String(n)]),
    () => ucx(ref, 8, n, 1000),
    (row) => row.tTypical,
    (row) => row.typical,
  );
  results.push({ kind: "lat", what: `${test} vs ${ref} 8 B`, ...r });
  console.error(`  ${test} vs ${ref} 8 B: ours ${fmt(r.ours)} µs, ucx ${fmt(r.ref)} µs`);
}
const secs = (performance.now() - t0) / 1000;

if (o.json) {
  console.log(JSON.stringify({ where, machine: machine(), runs: o.runs, seconds: secs, results }, null, 2));
} else {
  console.log(`\n## tcp provider vs UCX over TCP (ucx_perftest, UCX_TLS=tcp) — ${where}\n`);
  console.log(`machine: ${machine()}; ${o.runs} runs each, medians; load average at end ${loadavg()}; ${secs.toFixed(0)} s\n`);
  const rows = results.map((r) => [r.what, r.kind === "bw" ? "MB/s (avg)" : "µs (typical, half RTT)", fmt(r.ours), fmt(r.ref), fmt(r.ours / r.ref, 3) + "×", r.oursRuns.map((x) => fmt(x)).join(" / "), r.refRuns.map((x) => fmt(x)).join(" / ")]);
  console.log(table(["test", "unit", "ours", "ucx", "ours / ucx", "ours runs", "ucx runs"], rows));
  const errs = results.flatMap((r) => r.errors.map((e) => `${r.what}: ${e}`));
  if (errs.length) console.log(`\nerrors:\n${errs.map((e) => "  " + e).join("\n")}`);
  console.log("\ncommands (one run of each; the client starts when the server prints its ready line):");
  for (const r of results) {
    if (r.cmdOurs) console.log(`  ours ${r.what}:\n    server: ${r.cmdOurs.scmd}\n    client: ${r.cmdOurs.cmd}`);
    if (r.cmdRef) console.log(`  ucx  ${r.what}:\n    server: ${r.cmdRef.scmd}\n    client: ${r.cmdRef.cmd}`);
  }
}
ns?.down();
