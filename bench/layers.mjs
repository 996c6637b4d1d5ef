#!/usr/bin/env node
// The message path's budget, layer by layer: CPU per 32-byte round trip with
// both sides in this process (so every figure is both sides' whole cost),
// and promises created per round trip, at each layer of the tcp provider's
// stack, against a plain Node socket doing the same ping-pong:
//
//   seam   the transport seam alone: postSend / postRecv / poll, notified by
//          the CQ (what the agent does underneath)
//   api    rdma.send() / rdma.receive() (the agent: credits, lanes, inbox)
//   rpc    RpcClient.call() on an RpcServer echo (the RPC layer on top)
//   net    the same ping-pong over async-rdma/net streams (stream.Duplex on
//          the api: a WRITE with immediate into the peer's ring per write)
//   node   net.Socket ping-pong of one fixed buffer (the floor, and the
//          reference for the net row)
//   node-rpc  the echo RPC on net.Socket that bench/rpc-vs-node.mjs measures
//          (bench/lib/node-rpc.mjs: framed, ids matched through a Map), the
//          reference for the rpc row
//
// The difference between two rows is what the layer between them costs.
// Each layer first runs for --warmup-ms (default 2000) unmeasured, then
// --trips round trips measured with process.cpuUsage(); the promise count
// comes from a separate short window with an async_hooks init hook (it
// counts the `await`s of the measuring loop too: two per round trip for the
// api and rpc rows, none for seam and node).
//
//   node bench/layers.mjs [--trips 20000] [--warmup-ms 2000] [--runs 3] [--only api,net,...]
//
// A program that reports: it never fails on a number.
import net from "node:net";
import { createHook } from "node:async_hooks";
import { loadavg } from "node:os";
import { nodeRpcPair } from "./lib/node-rpc.mjs";

const args = Object.fromEntries(process.argv.slice(2).reduce((a, v, i, all) => (v.startsWith("--") ? [...a, [v.slice(2), all[i + 1]]] : a), []));
const TRIPS = Number(args.trips ?? 20000);
const WARMUP_MS = Number(args["warmup-ms"] ?? 2000);
const RUNS = Number(args.runs ?? 3);
const SIZE = 32;
const dist = new URL("../dist/src/", import.meta.url);
const { RdmaBuilder } = await import(new URL("index.js", dist));
const { RpcServer, RpcClient } = await import(new URL("rpc/index.js", dist));
const { tcpProvider } = await import(new URL("transport/tcp/index.js", dist));
const { Access, CompletionBuffer, SendFlags, WrOpcode } = await import(new URL("transport/types.js", dist));

/** Runs `trip` (one round trip, returns a promise) for the warm-up, then measures. */
async function measure(trip) {
  const w0 = performance.now();
  while (performance.now() - w0 < WARMUP_MS) await trip();
  let promises = 0;
  const hook = createHook({ init: (_id, type) => void (type === "PROMISE" && promises++) }).enable();
  for (let i = 0; i < 200; i++) await trip();
  hook.disable();
  const c0 = process.cpuUsage();
  for (let i = 0; i < TRIPS; i++) await trip();
  const c = process.cpuUsage(c0);
  return { us: (c.user + c.system) / TRIPS, user: c.user / TRIPS, sys: c.system / TRIPS, promises: promises / 200 };
}

/** The seam: two QPs, each side re-posts its receive and the B side answers every SEND. */
async function seam() {
  const devA = await tcpProvider.openDevice("layers-a", { host: "127.0.0.1" });
  const devB = await tcpProvider.openDevice("layers-b", { host: "127.0.0.1" });
  const side = (dev) => {
    const pd = dev.allocPd();
    const cq = dev.createCq(256);
    const qp = pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 64, maxRecvWr: 64, maxSendSge: 1, maxRecvSge: 1, maxInlineData: 64 });
    const mr = pd.registerMr(4096, Access.LOCAL_WRITE);
    return { pd, cq, qp, mr, buf: new CompletionBuffer(16) };
  };
  const a = side(devA);
  const b = side(devB);
  const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
  a.qp.connect(b.qp.localEndpoint(), attr);
  b.qp.connect(a.qp.localEndpoint(), attr);
  const recv = (s) => s.qp.postRecv([{ wrId: 1, sgList: [{ addr: s.mr.addr, length: 4096, lkey: s.mr.lkey }] }]);
  const send = (s) => s.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [{ addr: s.mr.addr + 2048, length: SIZE, lkey: s.mr.lkey }] }]);
  for (let i = 0; i < 8; i++) {
    recv(a);
    recv(b);
  }
  let wake = null;
  // Each side: on notify, poll everything; a receive is re-posted (and on B answered).
  const handler = (s, onRecv) => () => {
    let n;
    while ((n = s.cq.poll(s.buf)) > 0) {
      for (let i = 0; i < n; i++) if (s.buf.wrId[i] === 1) onRecv();
    }
    s.cq.requestNotify();
    while ((n = s.cq.poll(s.buf)) > 0) for (let i = 0; i < n; i++) if (s.buf.wrId[i] === 1) onRecv();
  };
  a.cq.onNotify = handler(a, () => {
    recv(a);
    const w = wake;
    wake = null;
    w?.();
  });
  b.cq.onNotify = handler(b, () => {
    recv(b);
    send(b);
  });
  a.cq.requestNotify();
  b.cq.requestNotify();
  const r = await measure(() => new Promise((res) => ((wake = res), send(a))));
  a.cq.onNotify = null;
  b.cq.onNotify = null;
  devA.close();
  devB.close();
  return r;
}

async function api() {
  const l = await new RdmaBuilder().setProvider("tcp").bind("127.0.0.1:0");
  const accepted = l.accept();
  const c = await new RdmaBuilder().setProvider("tcp").connect(`127.0.0.1:${l.port}`);
  const s = await accepted;
  const cm = c.allocLocalMr(SIZE);
  let stop = false;
  const echo = (async () => {
    const sm = s.allocLocalMr(SIZE);
    while (!stop) {
      let m;
      try {
        m = await s.receive();
      } catch {
        return;
      }
      m.dispose();
      await s.send(sm);
    }
  })();
  const r = await measure(async () => {
    await c.send(cm);
    (await c.receive()).dispose();
  });
  stop = true;
  await c.close();
  await echo;
  await s.close().catch(() => {});
  await l.close();
  return r;
}

async function rpc() {
  const l = await new RdmaBuilder().setProvider("tcp").bind("127.0.0.1:0");
  void new RpcServer({ echo: (b) => b }).listen(l).catch(() => {});
  const c = new RpcClient(await new RdmaBuilder().setProvider("tcp").connect(`127.0.0.1:${l.port}`));
  const payload = new Uint8Array(SIZE).fill(7);
  const r = await measure(() => c.call("echo", payload));
  await c.close();
  await l.close();
  return r;
}

async function node() {
  return pingPong(net, {});
}

/** The node ping-pong on async-rdma/net: `mod` is node:net or async-rdma/net. */
async function pingPong(mod, opts) {
  const srv = mod.createServer({ ...opts, noDelay: true }, (s) => {
    s.on("data", (d) => s.write(d));
    s.on("error", () => {});
  });
  await new Promise((r) => srv.listen(0, "127.0.0.1", r));
  const s = mod.connect({ ...opts, port: srv.address().port, host: "127.0.0.1", noDelay: true });
  await new Promise((r) => s.once("connect", r));
  let done = null;
  s.on("data", () => done());
  const frame = Buffer.alloc(12 + SIZE);
  const r = await measure(() => new Promise((res) => ((done = res), s.write(frame))));
  s.destroy();
  await new Promise((r) => srv.close(r));
  return r;
}

async function stream() {
  return pingPong(await import(new URL("net/index.js", dist)), { provider: "tcp" });
}

async function nodeRpc() {
  const rpc = await nodeRpcPair();
  const payload = Buffer.alloc(SIZE, 7);
  const r = await measure(() => rpc.call(payload));
  rpc.close();
  return r;
}

const all = { seam, api, rpc, net: stream, node, "node-rpc": nodeRpc };
const only = args.only ? String(args.only).split(",") : Object.keys(all);
for (const k of only) if (!(k in all)) throw new Error(`--only: no layer ${k} (${Object.keys(all).join(", ")})`);
const layers = Object.fromEntries(only.map((k) => [k, all[k]]));
const res = Object.fromEntries(Object.keys(layers).map((k) => [k, []]));
for (let i = 0; i < RUNS; i++) for (const [k, f] of Object.entries(layers)) res[k].push(await f());
const med = (xs) => xs.slice().sort((a, b) => a - b)[Math.floor(xs.length / 2)];
console.log(`# the message path's budget per 32-byte round trip, both sides in one process; ${TRIPS} trips after ${WARMUP_MS} ms of warm-up, ${RUNS} runs (medians); load ${loadavg()[0].toFixed(2)}`);
console.log("| layer | CPU µs / round trip | of it user / system | × node | × node-rpc | promises / round trip (incl. the loop's awaits) |");
console.log("|---|---|---|---|---|---|");
const n = res.node ? med(res.node.map((x) => x.us)) : NaN;
const nr = res["node-rpc"] ? med(res["node-rpc"].map((x) => x.us)) : NaN;
for (const k of Object.keys(layers)) {
  const us = med(res[k].map((x) => x.us));
  console.log(`| ${k} | ${us.toFixed(1)} | ${med(res[k].map((x) => x.user)).toFixed(1)} / ${med(res[k].map((x) => x.sys)).toFixed(1)} | ${(us / n).toFixed(2)} | ${(us / nr).toFixed(2)} | ${med(res[k].map((x) => x.promises)).toFixed(1)} |`);
}
