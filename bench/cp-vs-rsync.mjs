#!/usr/bin/env node
// async-rdma cp vs rsync --whole-file (rsync daemon, rsync://) vs a plain Node
// stream pipe. Run through bench/cp-vs-rsync.sh (installs rsync when missing).
//
//   node bench/cp-vs-rsync.mjs [--runs 3] [--size 2g] [--files 10000] [--provider tcp]
//                              [--dir /var/tmp] [--only big|tree] [--cp-args "--chunk 1m --depth 8"]
//                              [--netns] [--tools ours,rsync,...]
//
// --netns: every server runs in one network namespace and every client in
// another, joined by a veth pair (bench/netns.sh; needs root); the
// namespaces are removed on exit, also after an error or ^C. Without it:
// loopback (127.0.0.1). --tools: only these rows (default all).
//
// Each run copies into an emptied destination; the tools alternate (the
// order rotates every run); the table shows medians. CPU is user + sys
// seconds of the client process plus the server's increase over the run
// (rsync's daemon forks one child per connection: its reaped children count).
// The source stays in the page cache for every tool alike; every tool's
// destination is on the same file system. Ours fsyncs each file before its
// rename; rsync and the Node pipe do not flush. "ours" uploads (the client
// RDMA WRITEs into the server's ring), "ours-down" downloads the same data
// from a read-only server (the client RDMA READs the server's ring);
// "ours-pull" uploads with the server READing the client's ring
// (ASYNC_RDMA_CP_UPLOAD=read, a measurement switch).
import { spawn, spawnSync } from "node:child_process";
import { mkdtempSync, mkdirSync, rmdirSync, readFileSync, readdirSync, rmSync, writeFileSync, openSync, writeSync, closeSync } from "node:fs";
import { randomBytes } from "node:crypto";
import { join } from "node:path";
import { loadavg, netnsUp } from "./lib/common.mjs";

const root = new URL("..", import.meta.url).pathname;
const MAIN = join(root, "dist", "src", "cli", "main.js");
const opt = { runs: 3, size: "2g", files: 10000, provider: "tcp", dir: "/var/tmp", only: null, cpArgs: "", netns: false, tools: null };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const k = argv[i];
  if (k === "--netns") {
    opt.netns = true;
    continue;
  }
  const v = argv[++i];
  if (k === "--tools") opt.tools = v.split(",");
  else if (k === "--runs") opt.runs = Number(v);
  else if (k === "--size") opt.size = v;
  else if (k === "--files") opt.files = Number(v);
  else if (k === "--provider") opt.provider = v;
  else if (k === "--dir") opt.dir = v;
  else if (k === "--only") opt.only = v;
  else if (k === "--cp-args") opt.cpArgs = v;
  else {
    console.error(`unknown option ${k}`);
    process.exit(2);
  }
}
// rsync's rows need rsync: say so before anything is created or started (a spawn of a missing
// program fails asynchronously, after the servers are up)
const wantRsync = !opt.tools || opt.tools.some((t) => t === "rsync" || t === "rsync-fsync");
if (wantRsync && spawnSync("rsync", ["--version"]).error) {
  console.error("rsync is not installed: bench/cp-vs-rsync.sh installs it, or leave its rows out (--tools ours,ours-down,ours-pull,node)");
  process.exit(2);
}
const bytesOf = (s) => Number(/^(\d+)/.exec(s)[1]) * { "": 1, k: 1024, m: 1024 ** 2, g: 1024 ** 3 }[(/[kmg]?$/i.exec(s)[0] || "").toLowerCase()];
const SIZE = bytesOf(opt.size);
const TICK = Number(spawnSync("getconf", ["CLK_TCK"], { encoding: "utf8" }).stdout.trim() || 100);

/**
 * A server's CPU seconds so far, its children included: from a cpuacct
 * cgroup made for it when the machine has one (exited children count:
 * rsync's daemon forks per connection and its receiver forks again, and
 * their time never reaches the daemon's cutime), else /proc/<pid>/stat.
 */
const CGROOT = "/sys/fs/cgroup/cpuacct";
const groups = new Map();
function track(pid, name) {
  try {
    const g = join(CGROOT, `ardma-cpbench-${process.pid}-${name}`);
    mkdirSync(g);
    writeFileSync(join(g, "cgroup.procs"), String(pid));
    groups.set(pid, g);
  } catch (e) {
    console.error(`# no cpuacct cgroup for ${name} (${e.message}): its exited children's CPU is counted only once reaped`);
  }
}
function cpuOf(pid) {
  const g = groups.get(pid);
  if (g) return Number(readFileSync(join(g, "cpuacct.usage"), "utf8")) / 1e9;
  return cpuOfProc(pid);
}
function cpuOfProc(pid) {
  const f = readFileSync(`/proc/${pid}/stat`, "utf8").replace(/^.*\) /s, "").split(" ");
  // fields 14..17 of stat (utime stime cutime cstime), here offset by the 2 removed
  return (Number(f[11]) + Number(f[12]) + Number(f[13]) + Number(f[14])) / TICK;
}

function waitLine(child, re) {
  return new Promise((resolve, reject) => {
    let buf = "";
    const t = setTimeout(() => reject(new Error(`no ${re} from the server: ${buf}`)), 30_000);
    child.stdout.on("data", (d) => {
      buf += d;
      const m = re.exec(buf);
      if (m) (clearTimeout(t), resolve(m));
    });
    child.on("exit", (c) => reject(new Error(`server exited (${c}): ${buf}`)));
  });
}

/** Runs a client under /usr/bin/time; { wall, cpu } (its user + sys). Not spawnSync: a signal must reach the handlers meanwhile. */
async function timed(cmd0, args0, env = {}) {
  const out = join(work, "time.txt");
  const [cmd, args] = inClient(cmd0, args0);
  const child = spawn("/usr/bin/time", ["-f", "%e %U %S", "-o", out, cmd, ...args], { stdio: ["ignore", "pipe", "pipe"], env: { ...process.env, ...env }, detached: true });
  child.group = true; // its own process group: killed with the client under it
  kids.push(child);
  let text = "";
  child.stdout.on("data", (d) => (text += d));
  child.stderr.on("data", (d) => (text += d));
  const status = await new Promise((r) => child.on("close", (code) => r(code)));
  kids.splice(kids.indexOf(child), 1);
  if (status !== 0) throw new Error(`${cmd} ${args.join(" ")} failed (${status}):\n${text}`);
  const [e, u, s] = readFileSync(out, "utf8").trim().split("\n").pop().split(" ").map(Number);
  return { wall: e, cpu: u + s };
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
}

// servers in one namespace, clients in the other (or both on loopback)
const ns = opt.netns ? netnsUp() : null;
const HOST = ns ? ns.IP_S : "127.0.0.1";
const inServer = (cmd, args) => (ns ? ["ip", ["netns", "exec", ns.NS_S, cmd, ...args]] : [cmd, args]);
const inClient = (cmd, args) => (ns ? ["ip", ["netns", "exec", ns.NS_C, cmd, ...args]] : [cmd, args]);
const where = ns ? `two network namespaces over veth (server ${ns.NS_S} ${ns.IP_S}, client ${ns.NS_C} ${ns.IP_C})` : "loopback (127.0.0.1)";
console.error(`# ${where}; load average at start ${loadavg()}`);

const work = mkdtempSync(join(opt.dir, "ardma-cpbench-"));
const src = join(work, "src");
const dst = { "rsync-fsync": join(work, "dst-rsync-fsync"), ours: join(work, "dst-ours"), "ours-pull": join(work, "dst-ours-pull"), "ours-down": join(work, "dst-ours-down"), rsync: join(work, "dst-rsync"), node: join(work, "dst-node") };
for (const d of [src, ...Object.values(dst)]) mkdirSync(d, { recursive: true });
const kids = [];
/** Kills the servers, waits for them to exit, removes their cgroups and the work dir. */
let cleaning = null;
function cleanup() {
  return (cleaning ??= cleanupOnce());
}
async function cleanupOnce() {
  await Promise.all(
    kids.map((k) =>
      k.exitCode !== null || k.signalCode !== null
        ? null
        : new Promise((r) => {
            k.once("exit", r);
            if (k.group) process.kill(-k.pid, "SIGKILL");
            else k.kill("SIGKILL");
          }),
    ),
  );
  // a server's children (ours keeps a shell for syncfs) leave its group a moment after it:
  // retry on the next turns of the event loop, for at most 10 s
  const t0 = performance.now();
  for (const g of groups.values()) {
    for (;;) {
      try {
        rmdirSync(g);
        break;
      } catch (e) {
        if (e.code !== "EBUSY" || performance.now() - t0 > 10_000) {
          console.error(`# could not remove ${g}: ${e.message}`);
          break;
        }
        await new Promise((r) => setImmediate(r));
      }
    }
  }
  rmSync(work, { recursive: true, force: true });
}
// ^C or kill: servers and clients killed, cgroups and work dir removed, then exit (the namespaces go on exit, netnsUp)
process.removeAllListeners("SIGINT");
process.removeAllListeners("SIGTERM");
for (const sig of ["SIGINT", "SIGTERM"]) process.on(sig, () => void cleanup().finally(() => process.exit(130)));
try {

console.error(`# work dir ${work}; creating a ${opt.size} file and ${opt.files} files of 4 KiB`);
{
  const fd = openSync(join(src, "big"), "w");
  const block = randomBytes(16 << 20);
  for (let o = 0; o < SIZE; o += block.length) {
    randomBytes(Math.min(64, block.length)).copy(block, 0); // blocks differ: nothing dedups or compresses
    writeSync(fd, block, 0, Math.min(block.length, SIZE - o));
  }
  closeSync(fd);
  for (let i = 0; i < opt.files; i++) {
    const d = join(src, "tree", `d${String(Math.floor(i / 100)).padStart(3, "0")}`);
    if (i % 100 === 0) mkdirSync(d, { recursive: true });
    writeFileSync(join(d, `f${i}`), randomBytes(4096));
  }
  spawnSync("sync");
}

// servers
const ours = spawn(...inServer(process.execPath, [MAIN, "serve", dst.ours, "--writable", "-p", "0", "--bind", HOST, "--provider", opt.provider]), { stdio: ["ignore", "pipe", "inherit"] });
kids.push(ours);
track(ours.pid, "ours");
const oursPort = Number((await waitLine(ours, / on .*:(\d+)/))[1]);
// downloads (RDMA READ by the receiver) come from a second server, read-only over the source
const oursDown = spawn(...inServer(process.execPath, [MAIN, "serve", src, "--read-only", "-p", "0", "--bind", HOST, "--provider", opt.provider]), { stdio: ["ignore", "pipe", "inherit"] });
kids.push(oursDown);
track(oursDown.pid, "ours-down");
const oursDownPort = Number((await waitLine(oursDown, / on .*:(\d+)/))[1]);
const rsyncPort = 20000 + (process.pid % 20000);
if (wantRsync) {
  writeFileSync(join(work, "rsyncd.conf"), `port = ${rsyncPort}\nuse chroot = no\n[d]\npath = ${dst.rsync}\nread only = false\nuid = root\ngid = root\n[f]\npath = ${dst["rsync-fsync"]}\nread only = false\nuid = root\ngid = root\n`);
  const rsyncd = spawn(...inServer("rsync", ["--daemon", "--no-detach", `--config=${join(work, "rsyncd.conf")}`, `--address=${HOST}`]), { stdio: ["ignore", "pipe", "inherit"] });
  kids.push(rsyncd);
  track(rsyncd.pid, "rsync");
}
const nodeSrv = spawn(...inServer(process.execPath, [join(root, "bench", "lib", "node-pipe.mjs"), "server", dst.node]), { stdio: ["ignore", "pipe", "inherit"] });
kids.push(nodeSrv);
track(nodeSrv.pid, "node");
const nodePort = Number((await waitLine(nodeSrv, /port (\d+)/))[1]);
// the rsync daemon is up once it answers a module listing
for (let i = 0; wantRsync && spawnSync(...inClient("rsync", [`rsync://${HOST}:${rsyncPort}/`])).status !== 0; i++) {
  if (i > 100) throw new Error("rsync daemon did not start");
  await new Promise((r) => setTimeout(r, 100));
}

const cpArgs = opt.cpArgs.split(/\s+/).filter(Boolean);
const tools = {
  ours: {
    server: ours,
    big: () => [process.execPath, [MAIN, "cp", "-q", "--provider", opt.provider, ...cpArgs, join(src, "big"), `${HOST}:${oursPort}:`]],
    tree: () => [process.execPath, [MAIN, "cp", "-q", "-r", "--provider", opt.provider, ...cpArgs, join(src, "tree"), `${HOST}:${oursPort}:`]],
  },
  // uploads pulled by the server with RDMA READ (the measured alternative to WRITE); same server as "ours", own subdirectory
  "ours-pull": {
    server: ours,
    env: { ASYNC_RDMA_CP_UPLOAD: "read" },
    big: () => [process.execPath, [MAIN, "cp", "-q", "--provider", opt.provider, ...cpArgs, join(src, "big"), `${HOST}:${oursPort}:pull/`]],
    tree: () => [process.execPath, [MAIN, "cp", "-q", "-r", "--provider", opt.provider, ...cpArgs, join(src, "tree"), `${HOST}:${oursPort}:pull/`]],
  },
  "ours-down": {
    server: oursDown,
    big: () => [process.execPath, [MAIN, "cp", "-q", "--provider", opt.provider, ...cpArgs, `${HOST}:${oursDownPort}:big`, dst["ours-down"]]],
    tree: () => [process.execPath, [MAIN, "cp", "-q", "-r", "--provider", opt.provider, ...cpArgs, `${HOST}:${oursDownPort}:tree`, dst["ours-down"]]],
  },
  rsync: {
    server: rsyncd,
    big: () => ["rsync", ["-pt", "--whole-file", join(src, "big"), `rsync://${HOST}:${rsyncPort}/d/`]],
    tree: () => ["rsync", ["-rlpt", "--whole-file", join(src, "tree"), `rsync://${HOST}:${rsyncPort}/d/`]],
  },
  // rsync flushing every file it writes (--fsync, rsync ≥ 3.2.4): the durability ours gives
  "rsync-fsync": {
    server: rsyncd,
    big: () => ["rsync", ["-pt", "--whole-file", "--fsync", join(src, "big"), `rsync://${HOST}:${rsyncPort}/f/`]],
    tree: () => ["rsync", ["-rlpt", "--whole-file", "--fsync", join(src, "tree"), `rsync://${HOST}:${rsyncPort}/f/`]],
  },
  node: {
    server: nodeSrv,
    big: () => [process.execPath, [join(root, "bench", "lib", "node-pipe.mjs"), "client", HOST, String(nodePort), join(src, "big")]],
    tree: null, // one stream per file would be its own protocol: not a reference
  },
};

const results = [];
const cases = [
  ["big", SIZE, 1],
  ["tree", opt.files * 4096, opt.files],
].filter(([c]) => !opt.only || opt.only === c);
const names = Object.keys(tools).filter((n) => !opt.tools || opt.tools.includes(n));
for (const [what, bytes] of cases) {
  for (let run = 0; run < opt.runs; run++) {
    const order = names.map((_, i) => names[(i + run) % names.length]);
    for (const name of order) {
      const t = tools[name];
      if (!t[what]) continue;
      rmSync(dst[name], { recursive: true, force: true });
      mkdirSync(dst[name]);
      if (name === "ours-pull") {
        rmSync(join(dst.ours, "pull"), { recursive: true, force: true });
        mkdirSync(join(dst.ours, "pull"));
      }
      spawnSync("sync"); // the previous run's write-back does not land in this one
      const before = cpuOf(t.server.pid);
      const [cmd, args] = t[what]();
      const c = await timed(cmd, args, t.env);
      const server = cpuOf(t.server.pid) - before;
      const r = { what, tool: name, run, seconds: c.wall, mbps: bytes / c.wall / 1e6, cpuClient: c.cpu, cpuServer: server, cpu: c.cpu + server };
      results.push(r);
      console.error(JSON.stringify(r));
      if (run === 0) {
        // an honest bench copies for real: compare once
        const into = name === "ours-pull" ? join(dst.ours, "pull") : dst[name];
        const got = name === "node" ? join(dst.node, readdirSync(dst.node)[0]) : join(into, what === "big" ? "big" : "tree");
        const cmp = spawnSync(what === "big" ? "cmp" : "diff", what === "big" ? [join(src, "big"), got] : ["-r", join(src, "tree"), got]);
        if (cmp.status !== 0) throw new Error(`${name} ${what}: the copy differs from the source`);
      }
    }
  }
}

const rows = [];
for (const [what, bytes] of cases) {
  for (const name of names) {
    const rs = results.filter((r) => r.what === what && r.tool === name);
    if (rs.length === 0) continue;
    rows.push({ what, tool: name, mbps: median(rs.map((r) => r.mbps)), cpu: median(rs.map((r) => r.cpu)), cpuClient: median(rs.map((r) => r.cpuClient)), cpuServer: median(rs.map((r) => r.cpuServer)), runs: rs.map((r) => r.mbps.toFixed(1)).join(" / "), cpuPerGB: median(rs.map((r) => r.cpu)) / (bytes / 1e9) });
  }
}
console.log(`${where}; ${opt.runs} runs, medians; load average at end ${loadavg()}\n`);
console.log(`| case | tool | MB/s (median) | CPU s, both ends (client + server) | CPU s per GB | runs MB/s |`);
console.log(`|---|---|---|---|---|---|`);
for (const r of rows) console.log(`| ${r.what === "big" ? `${opt.size} file` : `${opt.files} × 4 KiB`} | ${r.tool} | ${r.mbps.toFixed(1)} | ${r.cpu.toFixed(2)} (${r.cpuClient.toFixed(2)} + ${r.cpuServer.toFixed(2)}) | ${r.cpuPerGB.toFixed(2)} | ${r.runs} |`);
for (const [what] of cases) {
  const o = rows.find((r) => r.what === what && r.tool === "ours");
  const s = rows.find((r) => r.what === what && r.tool === "rsync");
  if (o && s) console.log(`\n${what}: ours / rsync throughput ${(o.mbps / s.mbps).toFixed(2)}×, CPU ${(o.cpu / s.cpu).toFixed(2)}×`);
}
} finally {
  await cleanup();
}
process.exit(0);
