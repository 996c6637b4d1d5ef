#!/usr/bin/env node
// Polling modes under CPU contention, on real verbs (the Soft-RoCE guest):
// `async-rdma perf send_lat` (8 B ping-pong, both sides poll) and `send_bw`
// (4 KiB) with --polling event | busy | adaptive, with 1 pair of processes
// and with 2 pairs running at once (2 and 4 busy processes on the guest's 2
// vCPUs). The question (issue: "polling that cannot starve") is whether busy
// and adaptive ever do worse than event when there are more pollers than
// cores. Modes alternate and the order rotates every run; medians of RUNS.
//
//   node bench/polling-contention.mjs            on the host: runs itself in the guest
//   scripts/softroce/run.sh -t 3600 'node bench/polling-contention.mjs'
//
// Env: RUNS (3), LAT_ITERS (2000), BW_ITERS (5000), PAIRS ("1 2"), MODES ("event busy adaptive"),
//      TESTS ("send_lat send_bw"), BASE (another checkout's root, built: adds its busy and
//      adaptive as "busy@base" / "adaptive@base", for a before/after in one run).
// A program that reports: it never fails on a number.
import { spawn, spawnSync } from "node:child_process";
import { createInterface } from "node:readline";
import { join } from "node:path";

const root = new URL("..", import.meta.url).pathname;
const MAIN = join(root, "dist", "src", "cli", "main.js");

if (!process.env.RXE_DEVS) {
  const r = spawnSync(join(root, "scripts/softroce/run.sh"), ["-t", process.env.GUEST_TIMEOUT ?? "3600", "node bench/polling-contention.mjs"], {
    stdio: "inherit",
    cwd: root,
  });
  process.exit(r.status ?? 1);
}

const RUNS = Number(process.env.RUNS ?? 3);
const LAT_ITERS = Number(process.env.LAT_ITERS ?? 2000);
const BW_ITERS = Number(process.env.BW_ITERS ?? 5000);
const PAIRS = (process.env.PAIRS ?? "1 2").split(/\s+/).filter(Boolean).map(Number);
const BASE = process.env.BASE ? join(process.env.BASE, "dist", "src", "cli", "main.js") : null;
const MODES = (process.env.MODES ?? `event busy adaptive${BASE ? " busy@base adaptive@base" : ""}`).split(/\s+/).filter(Boolean);
const TESTS = (process.env.TESTS ?? "send_lat send_bw").split(/\s+/).filter(Boolean);
const DEV = (process.env.RXE_DEVS ?? "rxe0").split(" ")[0];
const IP = (process.env.RXE_IPS ?? "10.77.0.1").split(" ")[0];
const GID = process.env.RXE_GID_INDEX ?? "1";

/** Start a process; resolve with the first JSON line matching `type`, and a promise of its exit. */
function start(args, main = MAIN) {
  const p = spawn(process.execPath, [main, ...args], { stdio: ["ignore", "pipe", "pipe"] });
  const lines = [];
  let err = "";
  p.stderr.on("data", (d) => (err += d));
  const waiters = [];
  createInterface({ input: p.stdout }).on("line", (l) => {
    lines.push(l);
    for (const w of waiters.splice(0)) w();
  });
  const exit = new Promise((res) => p.on("exit", (code) => res({ code, err })));
  const wait = (type) =>
    new Promise((res, rej) => {
      const look = () => {
        const hit = lines.find((l) => l.includes(`"type":"${type}"`));
        if (hit) return res(JSON.parse(hit));
        waiters.push(look);
      };
      exit.then(({ code, err }) => rej(new Error(`exited ${code} before ${type}: ${err.slice(-800)}`)));
      look();
    });
  return { p, wait, exit };
}

async function pairRun(test, modeName, pairs) {
  const [mode, base] = modeName.split("@");
  const main = base ? BASE : MAIN;
  const common = ["--provider", "verbs", "-d", DEV, "-x", GID, "--json", "--polling", mode];
  const size = test === "send_lat" ? "8" : "4096";
  const iters = String(test === "send_lat" ? LAT_ITERS : BW_ITERS);
  const servers = [];
  for (let i = 0; i < pairs; i++) servers.push(start(["perf", test, "-p", "0", ...common], main));
  const ports = [];
  for (const s of servers) ports.push((await s.wait("listening")).port);
  const clients = ports.map((port) => start(["perf", test, IP, "-p", String(port), ...common, "-s", size, "-n", iters], main));
  const vals = [];
  for (const c of clients) {
    try {
      const r = await c.wait("result");
      vals.push(test === "send_lat" ? r.tTypical : r.bwAvg);
    } catch (e) {
      console.error(`  ${test} ${mode} x${pairs}: ${e.message}`);
    }
  }
  await Promise.all([...clients, ...servers].map((x) => x.exit));
  // With two pairs, report the mean of the pairs (each pair's own figure is in the log).
  return vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : NaN;
}

const median = (a) => {
  const s = a.filter((x) => Number.isFinite(x)).sort((x, y) => x - y);
  if (!s.length) return NaN;
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};
const fmt = (x) => (Number.isFinite(x) ? x.toPrecision(4) : "n/a");

console.error(`polling-contention: ${DEV} (${IP}), ${RUNS} runs, pairs ${PAIRS.join(",")}, modes ${MODES.join(",")}, cpus ${(await import("node:os")).availableParallelism()}`);
const rows = [];
for (const test of TESTS) {
  for (const pairs of PAIRS) {
    const got = Object.fromEntries(MODES.map((m) => [m, []]));
    for (let r = 0; r < RUNS; r++) {
      const order = MODES.map((_, i) => MODES[(i + r) % MODES.length]);
      for (const mode of order) {
        const v = await pairRun(test, mode, pairs);
        got[mode].push(v);
        console.error(`  ${test} x${pairs} ${mode} run ${r + 1}: ${fmt(v)}`);
      }
    }
    const ev = median(got.event ?? []);
    for (const mode of MODES) {
      const m = median(got[mode]);
      rows.push({ test, pairs, mode, median: m, vsEvent: Number.isFinite(ev) ? m / ev : NaN, runs: got[mode] });
    }
  }
}
console.log("| test | processes | mode | median | vs event | runs |");
console.log("|---|---|---|---|---|---|");
for (const r of rows) {
  const unit = r.test === "send_lat" ? "µs (typical)" : "MB/s";
  console.log(`| ${r.test} | ${r.pairs * 2} | ${r.mode} | ${fmt(r.median)} ${unit} | ${fmt(r.vsEvent)} | ${r.runs.map(fmt).join(" / ")} |`);
}
