#!/usr/bin/env node
// CPU per side of the tcp provider's `perf write_bw`, several builds and the
// plain Node TCP stream (bench/lib/node-tcp.mjs) alternating in one run:
// MB/s, and each process's user+sys CPU (and the sys part), minor page
// faults (GNU time), medians (min-max) over --pairs rounds. CPU
// holds up on a loaded machine better than MB/s: a regression in the
// receiver's or the sender's cost per byte shows here even when the machine
// is busy. Each process's figures include its start-up (about 0.2 s of CPU
// for ours, 0.08 s for the Node reference; run with -n 10 to see it).
//
//   node bench/write-bw-cpu.mjs [--builds .,node,/tmp/other-build] [--pairs 4] [-s 4096] [-n 50000] [--node-args "--cpu-prof"]
//
// A build is a directory holding dist/ (this tree: "."; another commit: the
// worktree `node bench/ab.mjs <commit> --keep` leaves, once built). Needs
// /usr/bin/time (GNU time). A program that reports: it never fails on a number.
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { loadavg } from "node:os";
import { join, resolve } from "node:path";
import { ROOT, NODE, median } from "./lib/common.mjs";

const argv = process.argv.slice(2);
const opt = (names, d) => {
  for (const n of names) {
    const i = argv.indexOf(n);
    if (i >= 0) return argv[i + 1];
  }
  return d;
};
const builds = String(opt(["--builds"], ".,node")).split(",");
const pairs = Number(opt(["--pairs"], 4));
const size = String(opt(["-s", "--size"], "4096"));
const n = String(opt(["-n", "--iters"], "50000"));
const nodeArgs = String(opt(["--node-args"], "")).split(" ").filter(Boolean);
const TIME = "/usr/bin/time";
if (!existsSync(TIME)) {
  console.error(`${TIME} (GNU time) is missing`);
  process.exit(1);
}
const REF = join(ROOT, "bench", "lib", "node-tcp.mjs");

function run(args, onOut) {
  return new Promise((res) => {
    const p = spawn(TIME, ["-f", "TIME %U %S %R %w", NODE, ...args], { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    p.stdout.on("data", (d) => {
      out += d;
      onOut?.(out);
    });
    p.stderr.on("data", (d) => (err += d));
    p.on("close", () => {
      const m = /TIME ([\d.]+) ([\d.]+) (\d+) (\d+)/.exec(err);
      res({ out, err, cpu: m ? Number(m[1]) + Number(m[2]) : NaN, sys: m ? Number(m[2]) : NaN, minflt: m ? Number(m[3]) : NaN, vcs: m ? Number(m[4]) : NaN });
    });
  });
}

async function once(build) {
  const ref = build === "node";
  const cli = ref ? null : join(resolve(ROOT, build), "dist", "src", "cli", "main.js");
  const serverArgs = ref ? [REF, "server"] : [...nodeArgs, cli, "perf", "write_bw", "-p", "0", "--provider", "tcp", "--json"];
  let client = null;
  const server = run(serverArgs, (out) => {
    const m = /"type":"listening","port":(\d+)/.exec(out);
    if (m && client === null) {
      client = run(ref ? [REF, "client", "127.0.0.1", m[1], "bw", size, n] : [...nodeArgs, cli, "perf", "write_bw", "127.0.0.1", "-p", m[1], "--provider", "tcp", "--json", "-s", size, "-n", n]);
    }
  });
  const s = await server;
  const c = client ? await client : { out: "", err: "no client", cpu: NaN, sys: NaN, minflt: NaN, vcs: NaN };
  const bw = /"bwAvg":([\d.]+)/.exec(c.out);
  return { bw: bw ? Number(bw[1]) : NaN, s, c };
}

const res = new Map(builds.map((b) => [b, []]));
const load0 = loadavg()[0];
for (let i = 0; i < pairs; i++) {
  for (const b of i % 2 === 0 ? builds : [...builds].reverse()) {
    const r = await once(b);
    res.get(b).push(r);
    console.error(`${b}: ${r.bw.toFixed(1)} MB/s; server ${r.s.cpu.toFixed(2)} s, client ${r.c.cpu.toFixed(2)} s`);
  }
}
const mm = (xs, d = 2) => `${median(xs).toFixed(d)} (${Math.min(...xs).toFixed(d)}-${Math.max(...xs).toFixed(d)})`;
console.log(`# write_bw ${size} B x ${n}, ${pairs} rounds alternating; load ${load0.toFixed(2)} -> ${loadavg()[0].toFixed(2)}`);
console.log("| build | MB/s | server CPU s | client CPU s | server µs/op | client µs/op | server sys s | client sys s | server minflt | client minflt |");
console.log("|---|---|---|---|---|---|---|---|---|---|");
for (const b of builds) {
  const rs = res.get(b);
  const per = (xs) => ((median(xs) * 1e6) / Number(n)).toFixed(1);
  const sc = rs.map((r) => r.s.cpu);
  const cc = rs.map((r) => r.c.cpu);
  console.log(`| ${b} | ${mm(rs.map((r) => r.bw), 1)} | ${mm(sc)} | ${mm(cc)} | ${per(sc)} | ${per(cc)} | ${median(rs.map((r) => r.s.sys)).toFixed(2)} | ${median(rs.map((r) => r.c.sys)).toFixed(2)} | ${median(rs.map((r) => r.s.minflt))} | ${median(rs.map((r) => r.c.minflt))} |`);
}
