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
import { RdmaBuilder } from "../dist/src/index.js";

const N = Number(process.argv[2] ?? 40000);
const D = Number(process.argv[3] ?? 128);
const SIZE = Number(process.argv[4] ?? 64);
const provider = process.env.ASYNC_RDMA_PROVIDER ?? "tcp";
const listener = await new RdmaBuilder().setProvider(provider).bind("127.0.0.1:0");
const server = (async () => {
  const s = await listener.accept();
  const t0 = performance.now();
  for (let i = 0; i < N; i++) (await s.receive()).dispose();
  const dt = performance.now() - t0;
  return { s, rate: Math.round((N / dt) * 1000) };
})();
const c = await new RdmaBuilder().setProvider(provider).connect(`127.0.0.1:${listener.port}`);
const m = c.allocLocalMr(SIZE);
let posted = 0;
let done = 0;
await new Promise((resolve, reject) => {
  const fill = () => {
    while (posted < N && posted - done < D) {
      posted++;
      c.send(m).then(() => (++done === N ? resolve() : fill()), reject);
    }
  };
  fill();
});
const { s, rate } = await server;
console.log(JSON.stringify({ provider, messages: N, bytes: SIZE, inFlight: D, messagesPerSec: rate, creditMessagesReceiver: s.stats().creditMessages, creditMessagesSender: c.stats().creditMessages }));
m.dispose();
await c.close();
await s.close();
await listener.close();
