#!/usr/bin/env node
// examples/kv: GET by one-sided READ of the owner's shared table vs the same
// GET as a send/receive RPC to the owner, with 1 and 4 client processes, and
// the owner's CPU time (process.cpuUsage) in each case.
//
//   node bench/kv.mjs [--quick] [--seconds S] [--runs R] [--provider tcp|verbs|auto] [--polling event|busy|adaptive]
//
// One owner process and 4 client processes (child_process.fork, IPC for
// control only). Each measurement: the chosen clients GET random present keys
// in a closed loop (one GET outstanding per client) for S seconds; ops/s is
// the sum over the clients; the owner's CPU is read before and after. An
// "idle" row measures the owner while no client runs (timers, keepalive). The
// first round is a warm-up and is not reported; figures are medians over R
// rounds. Reports; never fails on a number.
//
// On the tcp provider the owner's own process serves every READ in its event
// loop (the READ is one-sided for the client's program, not for the owner's
// CPU). On verbs the NIC — here the rxe driver in the guest's kernel — serves
// it, and that kernel time is not counted in the owner's process.cpuUsage().
import { fork } from "node:child_process";
import { fileURLToPath } from "node:url";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { ROOT, median, fmt } from "./lib/common.mjs";

const SELF = fileURLToPath(import.meta.url);
const KV = join(ROOT, "dist", "examples", "kv", "kv.js");
const GEOMETRY = { buckets: 1024, ways: 4, keyMax: 16, valueMax: 64 };
const KEYS = 256;

const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : dflt;
};
const role = opt("--role", "main");
const provider = opt("--provider", process.env.ASYNC_RDMA_PROVIDER ?? "tcp");
const polling = opt("--polling", null); // default: the library's (adaptive)
const newBuilder = () => {
  const b = new RdmaBuilder().setProvider(provider);
  return polling ? b.setPolling(polling) : b;
};

if (!existsSync(KV)) {
  console.error(`${KV} is missing: run npm run build first`);
  process.exit(1);
}
const { RdmaBuilder } = await import(join(ROOT, "dist", "src", "index.js"));
const { KvClient, createTable, serveConnection } = await import(KV);

const send = (m) => process.send(m);
const keyName = (i) => `key-${i}`;

if (role === "owner") {
  const listener = await newBuilder().bind("127.0.0.1:0");
  const { table } = createTable(listener, GEOMETRY);
  const present = [];
  for (let i = 0; i < KEYS; i++) {
    const value = new Uint8Array(GEOMETRY.valueMax).fill(i & 0xff);
    if (table.put(new TextEncoder().encode(keyName(i)), value)) present.push(i);
  }
  (async () => {
    for await (const rdma of listener) serveConnection(rdma, table).catch(() => {});
  })();
  process.on("message", (m) => {
    if (m.cmd === "cpu") send({ type: "cpu", cpu: process.cpuUsage(), at: performance.now() });
    else if (m.cmd === "exit") process.exit(0);
  });
  send({ type: "listening", port: listener.port, present });
} else if (role === "client") {
  const rdma = await newBuilder().connect(`127.0.0.1:${opt("--port")}`);
  const kv = await KvClient.open(rdma);
  let present = [];
  process.on("message", async (m) => {
    if (m.cmd === "keys") {
      present = m.present;
      send({ type: "ready", provider: rdma.provider });
    } else if (m.cmd === "run") {
      const get = m.mode === "read" ? (k) => kv.get(k) : (k) => kv.getRpc(k);
      const cpu0 = process.cpuUsage();
      const t0 = performance.now();
      const end = t0 + m.ms;
      let ops = 0;
      let x = (process.pid * 2654435761) >>> 0 || 1;
      while (performance.now() < end) {
        x ^= x << 13;
        x ^= x >>> 17;
        x ^= x << 5;
        const v = await get(keyName(present[(x >>> 0) % present.length]));
        if (v === null || v.length !== GEOMETRY.valueMax) throw new Error("bad GET");
        ops++;
      }
      const c = process.cpuUsage(cpu0);
      send({ type: "done", ops, ms: performance.now() - t0, cpuUs: c.user + c.system, retries: kv.retries });
    } else if (m.cmd === "exit") {
      kv.close();
      await rdma.close();
      process.exit(0);
    }
  });
  send({ type: "connected" });
} else {
  const quick = args.includes("--quick");
  const seconds = Number(opt("--seconds", quick ? "1" : "3"));
  const runs = Number(opt("--runs", quick ? "1" : "3"));
  const CLIENTS = 4;

  const next = (child, type) =>
    new Promise((resolve, reject) => {
      const on = (m) => {
        if (m.type === type) {
          child.off("message", on);
          child.off("exit", onExit);
          resolve(m);
        }
      };
      const onExit = (code) => reject(new Error(`a ${type} was awaited but the process exited (${code})`));
      child.on("message", on);
      child.once("exit", onExit);
    });
  const spawn = (r, extra = []) => fork(SELF, ["--role", r, "--provider", provider, ...(polling ? ["--polling", polling] : []), ...extra], { stdio: ["ignore", "inherit", "inherit", "ipc"] });

  const owner = spawn("owner");
  const { port, present } = await next(owner, "listening");
  const clients = [];
  for (let i = 0; i < CLIENTS; i++) {
    const c = spawn("client", ["--port", String(port)]);
    await next(c, "connected");
    clients.push(c);
  }
  const readies = await Promise.all(clients.map((c) => (c.send({ cmd: "keys", present }), next(c, "ready"))));
  const ownerCpu = async () => {
    owner.send({ cmd: "cpu" });
    const m = await next(owner, "cpu");
    return { us: m.cpu.user + m.cpu.system, at: m.at };
  };

  /** One measurement: `n` clients GET by `mode` for `seconds` (mode "idle": nobody does). */
  const measure = async (mode, n) => {
    const a = await ownerCpu();
    let done;
    if (mode === "idle") {
      await new Promise((r) => setTimeout(r, seconds * 1000)); // the measurement window itself (a bench, not a test)
      done = [];
    } else done = await Promise.all(clients.slice(0, n).map((c) => (c.send({ cmd: "run", mode, ms: seconds * 1000 }), next(c, "done"))));
    const b = await ownerCpu();
    const ops = done.reduce((s, d) => s + d.ops, 0);
    const opsPerS = done.reduce((s, d) => s + (d.ops / d.ms) * 1000, 0);
    const wallMs = b.at - a.at;
    return {
      opsPerS,
      ownerUsPerOp: ops ? (b.us - a.us) / ops : NaN,
      ownerCpuPct: ((b.us - a.us) / 1000 / wallMs) * 100,
      clientUsPerOp: ops ? done.reduce((s, d) => s + d.cpuUs, 0) / ops : NaN,
      retries: done.reduce((s, d) => s + d.retries, 0),
    };
  };

  const cases = [
    ["idle", 0],
    ["read", 1],
    ["rpc", 1],
    ["read", 4],
    ["rpc", 4],
  ];
  const results = new Map(cases.map(([m, n]) => [`${m}/${n}`, []]));
  console.log(`bench/kv: provider ${readies[0].provider}, polling ${polling ?? "adaptive (default)"}, ${present.length} keys of ${GEOMETRY.valueMax} B, buckets of ${GEOMETRY.ways} slots (${GEOMETRY.ways * Math.ceil((12 + GEOMETRY.keyMax + GEOMETRY.valueMax) / 8) * 8} B per READ), ${seconds} s per case, ${runs} rounds after a warm-up`);
  for (let round = 0; round <= runs; round++) {
    for (const [m, n] of cases) {
      const r = await measure(m, n);
      if (round > 0) results.get(`${m}/${n}`).push(r);
    }
    if (round > 0) process.stderr.write(`round ${round}/${runs} done\n`);
  }
  for (const c of clients) c.send({ cmd: "exit" });
  owner.send({ cmd: "exit" });

  const med = (k, f) => median(results.get(k).map(f));
  const row = (label, k) => {
    const ops = med(k, (r) => r.opsPerS);
    return `| ${label} | ${k === "idle/0" ? "—" : fmt(ops, 0)} | ${fmt(med(k, (r) => r.ownerCpuPct), 1)} % | ${k === "idle/0" ? "—" : fmt(med(k, (r) => r.ownerUsPerOp), 2)} | ${k === "idle/0" ? "—" : fmt(med(k, (r) => r.clientUsPerOp), 1)} |`;
  };
  console.log("");
  console.log("| GET | ops/s (sum of clients) | owner CPU (of one core) | owner CPU µs per GET | client CPU µs per GET |");
  console.log("|---|---|---|---|---|");
  console.log(row("none (owner idle)", "idle/0"));
  console.log(row("one-sided READ, 1 client", "read/1"));
  console.log(row("RPC (send/receive), 1 client", "rpc/1"));
  console.log(row("one-sided READ, 4 clients", "read/4"));
  console.log(row("RPC (send/receive), 4 clients", "rpc/4"));
  console.log("");
  for (const n of [1, 4]) {
    const r = med(`read/${n}`, (x) => x.opsPerS) / med(`rpc/${n}`, (x) => x.opsPerS);
    const c = med(`read/${n}`, (x) => x.ownerUsPerOp) / med(`rpc/${n}`, (x) => x.ownerUsPerOp);
    console.log(`${n} client${n > 1 ? "s" : ""}: READ/RPC ops/s ${fmt(r)}×, owner CPU per GET READ/RPC ${fmt(c)}×`);
  }
  const retries = [...results.values()].flat().reduce((s, r) => s + r.retries, 0);
  console.log(`torn READs retried over all rounds: ${retries}`);
  console.log(`command: node bench/kv.mjs${args.length ? " " + args.join(" ") : ""}`);
}
