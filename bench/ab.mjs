#!/usr/bin/env node
// A/B: the working tree against another commit, on the same machine, runs
// alternating (base, head, base, head, ...), so load drift hits both. The
// other commit is checked out into a temporary worktree and built there
// (TypeScript only: the tcp provider); the SAME benchmark programs (this
// tree's bench/) run against both builds. This tree's build is copied first,
// so it may be rebuilt while the runs go on. Prints each metric's median, min
// and max per side and the ratio of medians (head / base), with the load.
//
//   node bench/ab.mjs <commit> [--pairs 4] [--bench rpc-cpu,send-inprocess,heap-pingpong] [--keep]
//
// Benchmarks (in-process ones hold up on a loaded machine):
//   rpc-cpu         CPU µs per 32 B echo call, client and server in one process (lower is better)
//   rpc-cpu-4k      the same with 4 KiB payloads (rendezvous through bounce memory)
//   send-inprocess  64 B messages/s, sender and receiver in one process (higher is better)
//   send-4k         4 KiB messages/s, in one process (higher is better)
//   heap-pingpong   heap bytes allocated per message in a 64 B ping-pong, both sides in one process
//                   (bench/alloc.mjs --window 1; lower is better; exact, not sampled)
//   heap-window     the same with 64 messages in flight (bench/alloc.mjs --window 64)
//   rpc-vs-node     calls/s at 32 B c=1 (two processes; noisy on a busy machine)
//   rpc-c64         calls/s at 32 B c=64 (two processes)
//   rpc-4k-c64      calls/s at 4 KiB c=64 (two processes)
//   sendrecv-c1, sendrecv-c64: calls/s of an echo written on send()/receive() (plain
//                   buffers), 32 B at c=1 and c=64 (two processes)
//   write-bw-64     tcp write_bw MB/s at 64 B (perf CLI, two processes; bench/tcp-vs-node.mjs, one run)
//   write-bw-4k     tcp write_bw MB/s at 4 KiB (perf CLI, two processes; bench/tcp-vs-node.mjs, one run)
//   write-bw-64k    the same at 64 KiB
//   write-bw-1m     the same at 1 MiB
//   write-bw-64-vs-node, -4k-vs-node, -64k-vs-node, -1m-vs-node: the same run's ratio to a plain Node TCP
//                   stream measured right beside it (less sensitive to load than MB/s)
//   sparse-call, sparse-cpu-client, sparse-cpu-server: one 32 B RPC call every ms in adaptive polling
//                   (bench/polling-cost.mjs --shape sparse, one run): µs per call, each side's CPU µs per call
//   rpc-64k-c1      calls/s of 64 KiB RPC calls back to back, one in flight (rendezvous), adaptive polling
//   rpc-async-c1    calls/s of 32 B RPC calls back to back, one in flight, the server answering after a
//                   turn of its loop (its ACK travels alone), adaptive polling
//   oneway-c1       sends/s of 32 B send() back to back, one in flight, to a receiver that only receives
//   write-lat, write-imm-lat, send-lat: tcp 8 B half round trip µs (perf CLI write_lat,
//                   write_lat --write_imm, send_lat; bench/tcp-vs-node.mjs, one run each),
//                   and -vs-node: the ratio to a Node ping-pong measured beside it
//
// A program that reports: it never fails on a number.
import { execFileSync, spawnSync } from "node:child_process";
import { cpSync, existsSync, mkdtempSync, rmSync, symlinkSync } from "node:fs";
import { loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const argv = process.argv.slice(2);
const commit = argv.find((a, i) => !a.startsWith("--") && !(argv[i - 1] ?? "").startsWith("--"));
const opt = (name, dflt) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : dflt;
};
if (!commit) {
  console.error("usage: node bench/ab.mjs <commit> [--pairs 4] [--bench rpc-cpu,send-inprocess] [--keep]");
  process.exit(2);
}
const PAIRS = Number(opt("pairs", 4));
const CALLS = Number(opt("calls", 10000));

const BENCHES = {
  "rpc-cpu": { args: ["bench/rpc-cpu.mjs", "--runs", "1", "--calls", String(CALLS)], re: /async-rdma\/rpc \(tcp\): min ([\d.]+) µs/, unit: "µs/call", better: "lower" },
  "rpc-cpu-4k": { args: ["bench/rpc-cpu.mjs", "--runs", "1", "--calls", String(Math.ceil(CALLS / 2)), "--size", "4096"], re: /async-rdma\/rpc \(tcp\): min ([\d.]+) µs/, unit: "µs/call", better: "lower" },
  "send-inprocess": { args: ["bench/send-inprocess.mjs", String(4 * CALLS), "128", "64"], re: /"messagesPerSec":(\d+)/, unit: "msg/s", better: "higher" },
  "send-4k": { args: ["bench/send-inprocess.mjs", String(2 * CALLS), "64", "4000"], re: /"messagesPerSec":(\d+)/, unit: "msg/s", better: "higher" },
  "heap-pingpong": { args: ["bench/alloc.mjs", "--window", "1", "--cpu-runs", "1"], re: /GC profiler:\s+(\d+) B\/message/, unit: "B/message", better: "lower" },
  "heap-window": { args: ["bench/alloc.mjs", "--window", "64", "--cpu-runs", "1"], re: /GC profiler:\s+(\d+) B\/message/, unit: "B/message", better: "lower" },
  "rpc-vs-node": { args: ["bench/rpc-vs-node.mjs", "--runs", "1", "--calls", String(CALLS), "--sizes", "32"], re: /\| 32 B \| 1 \| (\d+) \|/, unit: "calls/s", better: "higher" },
  "rpc-c64": { args: ["bench/rpc-vs-node.mjs", "--runs", "1", "--calls", String(CALLS), "--sizes", "32"], re: /\| 32 B \| 64 \| (\d+) \|/, unit: "calls/s", better: "higher" },
  "sendrecv-c64": { args: ["bench/rpc-vs-node.mjs", "--runs", "1", "--calls", String(CALLS), "--sizes", "32", "--layer", "sendrecv"], re: /\| 32 B \| 64 \| (\d+) \|/, unit: "calls/s", better: "higher" },
  "sendrecv-c1": { args: ["bench/rpc-vs-node.mjs", "--runs", "1", "--calls", String(CALLS), "--sizes", "32", "--layer", "sendrecv"], re: /\| 32 B \| 1 \| (\d+) \|/, unit: "calls/s", better: "higher" },
  "rpc-4k-c64": { args: ["bench/rpc-vs-node.mjs", "--runs", "1", "--calls", String(CALLS), "--sizes", "4096"], re: /\| 4096 B \| 64 \| (\d+) \|/, unit: "calls/s", better: "higher" },
};
for (const [name, size, label] of [
  ["64", 64, "64 B"],
  ["4k", 4096, "4 KiB"],
  ["64k", 65536, "64 KiB"],
  ["1m", 1048576, "1 MiB"],
]) {
  // bench/tcp-vs-node.mjs's row: | write_bw 4 KiB | MB/s (avg) | ours | node | ours / node× | ...
  const args = ["bench/tcp-vs-node.mjs", "--runs", "1", "--lat-iters", "0", "--sizes", String(size)];
  const row = `\\| write_bw ${label} +\\| MB/s \\(avg\\) +\\| `;
  BENCHES[`write-bw-${name}`] = { args, re: new RegExp(row + "([\\d.,]+) "), unit: "MB/s", better: "higher" };
  BENCHES[`write-bw-${name}-vs-node`] = { args, re: new RegExp(row + "[\\d.,]+ +\\| [\\d.,]+ +\\| ([\\d.]+)×"), unit: "× node", better: "higher" };
}
for (const [name, test] of [
  ["write-lat", "write_lat 8 B"],
  ["write-imm-lat", "write_lat --write_imm 8 B"],
  ["send-lat", "send_lat 8 B"],
]) {
  // bench/tcp-vs-node.mjs's row: | send_lat 8 B | µs (typical, half RTT) | ours | node | ours / node× | ...
  const args = ["bench/tcp-vs-node.mjs", "--runs", "1", "--sizes", "none", "--lat-iters", "10000"];
  const row = `\\| ${test.replace(/[-]/g, "\\-")} +\\| µs \\(typical, half RTT\\) +\\| `;
  BENCHES[name] = { args, re: new RegExp(row + "([\\d.,]+) "), unit: "µs", better: "lower" };
  BENCHES[`${name}-vs-node`] = { args, re: new RegExp(row + "[\\d.,]+ +\\| [\\d.,]+ +\\| ([\\d.]+)×"), unit: "× node", better: "lower" };
}
// bench/polling-cost.mjs's row: | adaptive | µs per call | client CPU µs/call | server CPU µs/call | runs |
{
  const args = ["bench/polling-cost.mjs", "--shape", "sparse", "--modes", "adaptive", "--runs", "1", "--calls", "2000"];
  const cells = (n) => new RegExp("\\| adaptive \\| " + "[\\d.]+ \\| ".repeat(n) + "([\\d.]+) \\|");
  BENCHES["sparse-call"] = { args, re: cells(0), unit: "µs/call", better: "lower" };
  BENCHES["sparse-cpu-client"] = { args, re: cells(1), unit: "µs/call", better: "lower" };
  BENCHES["sparse-cpu-server"] = { args, re: cells(2), unit: "µs/call", better: "lower" };
  // Calls back to back, one in flight, 64 KiB: each goes by rendezvous.
  const big = ["bench/polling-cost.mjs", "--shape", "tight", "--modes", "adaptive", "--runs", "1", "--calls", "3000", "--size", "65536"];
  BENCHES["rpc-64k-c1"] = { args: big, re: cells(0), unit: "calls/s", better: "higher" };
  // 32 B calls back to back, one in flight, answered after a turn of the server's loop.
  const later = ["bench/polling-cost.mjs", "--shape", "tight", "--modes", "adaptive", "--runs", "1", "--calls", "10000", "--handler", "async"];
  BENCHES["rpc-async-c1"] = { args: later, re: cells(0), unit: "calls/s", better: "higher" };
  // 32 B send() back to back, one in flight, to a receiver that only receives.
  const oneway = ["bench/polling-cost.mjs", "--shape", "oneway", "--modes", "adaptive", "--runs", "1", "--calls", "10000"];
  BENCHES["oneway-c1"] = { args: oneway, re: cells(0), unit: "sends/s", better: "higher" };
}
const chosen = String(opt("bench", "rpc-cpu,send-inprocess,heap-pingpong")).split(",");
for (const b of chosen) if (!BENCHES[b]) throw new Error(`unknown benchmark ${b} (known: ${Object.keys(BENCHES).join(", ")})`);

// The base build: a detached worktree of <commit>, this tree's node_modules and bench/.
const base = mkdtempSync(join(tmpdir(), "async-rdma-ab-"));
const rev = execFileSync("git", ["rev-parse", "--short", commit], { cwd: root, encoding: "utf8" }).trim();
const head = execFileSync("git", ["rev-parse", "--short", "HEAD"], { cwd: root, encoding: "utf8" }).trim();
const dirty = execFileSync("git", ["status", "--porcelain", "--untracked-files=no"], { cwd: root, encoding: "utf8" }).trim() !== "";
let cleaned = false;
function cleanup() {
  if (cleaned || argv.includes("--keep")) return;
  cleaned = true;
  spawnSync("git", ["worktree", "remove", "--force", base], { cwd: root });
  rmSync(base, { recursive: true, force: true });
}
process.on("exit", cleanup);
for (const sig of ["SIGINT", "SIGTERM"]) process.on(sig, () => process.exit(130));

execFileSync("git", ["worktree", "add", "--detach", "--force", base, rev], { cwd: root, stdio: "ignore" });
symlinkSync(join(root, "node_modules"), join(base, "node_modules"));
if (existsSync(join(root, "build"))) symlinkSync(join(root, "build"), join(base, "build"));
rmSync(join(base, "bench"), { recursive: true, force: true });
cpSync(join(root, "bench"), join(base, "bench"), { recursive: true });
console.error(`ab: building ${rev} in ${base} ...`);
execFileSync(process.execPath, [join(root, "node_modules/typescript/bin/tsc"), "-p", "tsconfig.json"], { cwd: base, stdio: "inherit" });
if (!existsSync(join(root, "dist/src/index.js"))) throw new Error("build this tree first: npm run build");
// The head side runs from a snapshot of this tree's build, so rebuilding here during the runs changes nothing.
const headDir = mkdtempSync(join(tmpdir(), "async-rdma-ab-head-"));
for (const f of ["dist", "bench"]) cpSync(join(root, f), join(headDir, f), { recursive: true });
cpSync(join(root, "package.json"), join(headDir, "package.json"));
symlinkSync(join(root, "node_modules"), join(headDir, "node_modules"));
if (existsSync(join(root, "build"))) symlinkSync(join(root, "build"), join(headDir, "build"));
process.on("exit", () => {
  if (!argv.includes("--keep")) rmSync(headDir, { recursive: true, force: true });
});

function runOnce(dir, b) {
  const r = spawnSync(process.execPath, b.args, { cwd: dir, encoding: "utf8", timeout: 600_000, env: { ...process.env, ASYNC_RDMA_PROVIDER: "tcp" } });
  const m = b.re.exec(r.stdout ?? "");
  if (!m) throw new Error(`${b.args.join(" ")} in ${dir}: no figure in its output (exit ${r.status}):\n${r.stdout}\n${r.stderr}`);
  return Number(m[1].replace(/,/g, ""));
}

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};
const load0 = loadavg()[0];
const rows = [];
for (const name of chosen) {
  const b = BENCHES[name];
  const res = { base: [], head: [] };
  for (let i = 0; i < PAIRS; i++) {
    // Alternate which side goes first, so a trend within a pair does not favour one.
    const order = i % 2 === 0 ? ["base", "head"] : ["head", "base"];
    for (const side of order) res[side].push(runOnce(side === "base" ? base : headDir, b));
    console.error(`ab: ${name} pair ${i + 1}/${PAIRS}: base ${res.base.at(-1)} head ${res.head.at(-1)} ${b.unit}`);
  }
  const mb = median(res.base);
  const mh = median(res.head);
  rows.push({ name, unit: b.unit, better: b.better, mb, mh, base: res.base, head: res.head, ratio: mh / mb });
}
console.log(`# A/B: head ${head}${dirty ? " + uncommitted changes" : ""} vs base ${rev}; ${PAIRS} alternating pairs; load ${load0.toFixed(2)} -> ${loadavg()[0].toFixed(2)}`);
console.log(`# command: node bench/ab.mjs ${argv.join(" ")}`);
console.log("| benchmark | unit | base median (min-max) | head median (min-max) | head/base | better |");
console.log("|---|---|---|---|---|---|");
// One decimal, or three significant digits for small figures (ratios to node are around 1).
const num = (x) => (Math.abs(x) < 10 ? +x.toPrecision(3) : +x.toFixed(1));
const fmt = (xs, m) => `${num(m)} (${num(Math.min(...xs))}-${num(Math.max(...xs))})`;
for (const r of rows) console.log(`| ${r.name} | ${r.unit} | ${fmt(r.base, r.mb)} | ${fmt(r.head, r.mh)} | ${r.ratio.toFixed(3)} | ${r.better} |`);
