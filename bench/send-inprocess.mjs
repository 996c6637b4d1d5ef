#!/usr/bin/env node
// send_bw-like, sender and receiver in ONE process, for CPU profiles that hold
// both sides of the two-sided path and no wait for another process:
//
//   node --cpu-prof --cpu-prof-dir=prof bench/send-inprocess.mjs [messages 40000] [in flight 128] [bytes 64]
//   node bench/lib/cpuprofile-top.mjs prof/*.cpuprofile
//
// The client keeps `in flight` sends outstanding; the server receive()s and
// dispose()s each message. Prints messages/s and the CREDIT messages each
// side sent (stats().creditMessages). ASYNC_RDMA_PROVIDER picks the provider (tcp).
// A first pass of WARMUP messages (default: the same count) is not measured.
import { RdmaBuilder } from "../dist/src/index.js";

const N = Number(process.argv[2] ?? 40000);
const D = Number(process.argv[3] ?? 128);
const SIZE = Number(process.argv[4] ?? 64);
const provider = process.env.ASYNC_RDMA_PROVIDER ?? "tcp";
const WARMUP = Number(process.env.WARMUP ?? N);
const listener = await new RdmaBuilder().setProvider(provider).bind("127.0.0.1:0");
const accepted = listener.accept();
const c = await new RdmaBuilder().setProvider(provider).connect(`127.0.0.1:${listener.port}`);
const m = c.allocLocalMr(SIZE);
// One pass: n messages, `D` in flight; the receiver's rate.
async function pass(n) {
  const receiving = (async () => {
    const s = await accepted;
    const t0 = performance.now();
    for (let i = 0; i < n; i++) (await s.receive()).dispose();
    return { s, rate: Math.round((n / (performance.now() - t0)) * 1000) };
  })();
  let posted = 0;
  let done = 0;
  await new Promise((resolve, reject) => {
    const fill = () => {
      while (posted < n && posted - done < D) {
        posted++;
        c.send(m).then(() => (++done === n ? resolve() : fill()), reject);
      }
    };
    fill();
  });
  return receiving;
}
// A first pass, unmeasured (WARMUP messages, default N): the figure is the steady state's, not V8 compiling the library.
if (WARMUP > 0) await pass(WARMUP);
const server = pass(N);
const { s, rate } = await server;
console.log(JSON.stringify({ provider, messages: N, bytes: SIZE, inFlight: D, messagesPerSec: rate, creditMessagesReceiver: s.stats().creditMessages, creditMessagesSender: c.stats().creditMessages }));
m.dispose();
await c.close();
await s.close();
await listener.close();
