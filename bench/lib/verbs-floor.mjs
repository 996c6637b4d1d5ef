// What node itself costs per verbs operation, without the library above the
// seam: two connected QPs on one device in one process, one work request
// posted and its completion busy-polled in a synchronous loop (no agent, no
// promises, no event loop), as perftest's latency loops do in C.
//
//   node bench/lib/verbs-floor.mjs [--device rxe0] [--gid-index 1] [--iters 2000]
//
// Prints one JSON line per operation: {"type":"floor","op":"write",
// "usecMedian":…,"postUsecMedian":…}. bench/verbs-vs-perftest.sh runs it in
// the Soft-RoCE guest next to perftest, so the gap between `async-rdma perf`
// and perftest splits into what any node program pays (this floor) and what
// the library adds on top. Also the cost of one empty poll and of one
// event-loop turn (setImmediate), which every asynchronous wait pays.
import { loadProvider } from "../../dist/src/transport/providers.js";
import { Access, CompletionBuffer, SendFlags, WrOpcode } from "../../dist/src/transport/types.js";
import { flags } from "./common.mjs";

const o = flags(process.argv.slice(2), { device: process.env.RXE_DEV ?? "", "gid-index": Number(process.env.RXE_GID_INDEX ?? 1), iters: 2000 });
const N = Number(o.iters);
const provider = await loadProvider("verbs");
const dev = await provider.openDevice(o.device || undefined);
const ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC;

function side() {
  const pd = dev.allocPd();
  const cq = dev.createCq(256);
  const qp = pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 64, maxRecvWr: 64, maxSendSge: 1, maxRecvSge: 1, maxInlineData: 64 });
  const mr = pd.registerMr(new ArrayBuffer(64), ALL);
  return { pd, cq, qp, mr };
}
const a = side();
const b = side();
const attr = { gidIndex: o["gid-index"], timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
a.qp.connect(b.qp.localEndpoint({ gidIndex: o["gid-index"] }), attr);
b.qp.connect(a.qp.localEndpoint({ gidIndex: o["gid-index"] }), attr);
const cb = new CompletionBuffer(16);
const now = () => process.hrtime.bigint();
const median = (xs) => {
  const s = Float64Array.from(xs).sort();
  return s[s.length >> 1];
};

function spinFor(cq, n) {
  let got = 0;
  const deadline = Date.now() + 10_000;
  while (got < n) {
    const k = cq.poll(cb, 16);
    for (let i = 0; i < k; i++) if (cb.status[i] !== 0) throw new Error(`completion status ${cb.status[i]}`);
    got += k;
    if (k === 0 && Date.now() > deadline) throw new Error("no completion within 10 s");
  }
}

const ops = {
  write: { wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED | SendFlags.INLINE, sgList: [{ addr: a.mr.addr, length: 8, lkey: a.mr.lkey }], remoteAddr: b.mr.addr, rkey: b.mr.rkey },
  read: { wrId: 2, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [{ addr: a.mr.addr, length: 8, lkey: a.mr.lkey }], remoteAddr: b.mr.addr, rkey: b.mr.rkey },
  atomic: { wrId: 3, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [{ addr: a.mr.addr, length: 8, lkey: a.mr.lkey }], remoteAddr: b.mr.addr, rkey: b.mr.rkey, compareAdd: 1n },
  send: { wrId: 4, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED | SendFlags.INLINE, sgList: [{ addr: a.mr.addr, length: 8, lkey: a.mr.lkey }] },
};
const recv = [{ wrId: 5, sgList: [{ addr: b.mr.addr, length: 64, lkey: b.mr.lkey }] }];

for (const [name, wr] of Object.entries(ops)) {
  const total = [];
  const post = [];
  for (let i = 0; i < N + 100; i++) {
    if (name === "send") b.qp.postRecv(recv);
    const t0 = now();
    a.qp.postSend([wr]);
    const t1 = now();
    spinFor(a.cq, 1);
    if (name === "send") spinFor(b.cq, 1);
    const t2 = now();
    if (i >= 100) {
      total.push(Number(t2 - t0) / 1000);
      post.push(Number(t1 - t0) / 1000);
    }
  }
  console.log(JSON.stringify({ type: "floor", op: name, bytes: 8, iterations: N, usecMedian: median(total), postUsecMedian: median(post) }));
}
{
  const poll = [];
  for (let i = 0; i < N; i++) {
    const t0 = now();
    a.cq.poll(cb, 16);
    poll.push(Number(now() - t0) / 1000);
  }
  const turn = [];
  for (let i = 0; i < N; i++) {
    const t0 = now();
    await new Promise((r) => setImmediate(r));
    turn.push(Number(now() - t0) / 1000);
  }
  console.log(JSON.stringify({ type: "floor", op: "empty_poll", usecMedian: median(poll) }));
  console.log(JSON.stringify({ type: "floor", op: "event_loop_turn", usecMedian: median(turn) }));
}
for (const s of [a, b]) s.qp.destroy();
dev.close();
