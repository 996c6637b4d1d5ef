/**
 * The async-rdma lab manual, section 4.6, client side (my_client), in TypeScript.
 * Run: node dist/examples/lab/client.js [host:port]
 */
import assert from "node:assert/strict";
import { RdmaBuilder, type Rdma } from "../../src/index.js";


/** Send data to the server. */
async function sendDataToServer(rdma: Rdma): Promise<void> {
  using lmr = rdma.allocLocalMr(8);
  lmr.bytes.fill(1);
  await rdma.send(lmr);
}

/** Send data and an immediate value to the server. */
async function sendDataWithImmToServer(rdma: Rdma): Promise<void> {
  using lmr = rdma.allocLocalMr(8);
  lmr.bytes.fill(1);
  await rdma.sendWithImm(lmr, 1);
}

/** Write into local memory, then lend it to the server, which reads it. */
async function sendLmrToServer(rdma: Rdma): Promise<void> {
  const lmr = rdma.allocLocalMr(8);
  console.log(`[${[...lmr.bytes].join(", ")}]`);
  assert.deepEqual([...lmr.bytes], [0, 0, 0, 0, 0, 0, 0, 0]);
  lmr.bytes.fill(1);
  console.log(`[${[...lmr.bytes].join(", ")}]`);
  lmr.slice(4, 8).bytes.fill(2);
  console.log(`[${[...lmr.bytes].join(", ")}]`);
  assert.deepEqual([...lmr.bytes], [1, 1, 1, 1, 2, 2, 2, 2]);
  // The server may read and write it until it gives it back or the lease ends.
  await rdma.sendLocalMr(lmr);
}

/** Request remote memory, write into it, and hand it back to its owner. */
async function requestThenWrite(rdma: Rdma): Promise<void> {
  const rmr = await rdma.requestRemoteMr(8, { timeoutMs: 5_000 });
  using lmr = rdma.allocLocalMr(8);
  lmr.bytes.fill(1);
  // Write the second half of lmr into the second half of rmr.
  await rdma.write(lmr.slice(4, 8), rmr.slice(4, 8));
  await rdma.sendRemoteMr(rmr);
}

/** The same, with a WRITE_WITH_IMM whose immediate marks the boundary. */
async function requestThenWriteWithImm(rdma: Rdma): Promise<void> {
  const rmr = await rdma.requestRemoteMr(8, { timeoutMs: 5_000 });
  using lmr = rdma.allocLocalMr(8);
  lmr.bytes.fill(1);
  await rdma.writeWithImm(lmr.slice(4, 8), rmr.slice(4, 8), 4);
  await rdma.sendRemoteMr(rmr);
}

export async function client(addr: string): Promise<void> {
  console.log("client start");
  const rdma = await new RdmaBuilder().connect(addr);
  console.log(`connected (provider ${rdma.provider})`);
  await sendDataToServer(rdma);
  await sendDataWithImmToServer(rdma);
  await sendLmrToServer(rdma);
  await requestThenWrite(rdma);
  await requestThenWriteWithImm(rdma);
  // Wait for the server to finish and close (its close reaches our pending receive).
  await rdma.receive().catch(() => {});
  await rdma.close();
  console.log("client done");
}

if (import.meta.url === `file://${process.argv[1]}`) {
  await client(process.argv[2] ?? "127.0.0.1:5555");
}
