/**
 * The async-rdma lab manual, section 4.6, server side (my_server), in TypeScript.
 * Run: node dist/examples/lab/server.js [host:port]
 */
import assert from "node:assert/strict";
import { RdmaBuilder, type Rdma } from "../../src/index.js";


/** Receive the data the client sent. */
async function receiveDataFromClient(rdma: Rdma): Promise<void> {
  using lmr = await rdma.receive();
  const data = [...lmr.bytes];
  console.log(`[${data.join(", ")}]`);
  assert.deepEqual(data, [1, 1, 1, 1, 1, 1, 1, 1]);
}

/** Receive the data and the immediate value the client sent. */
async function receiveDataWithImmFromClient(rdma: Rdma): Promise<void> {
  const { mr, imm } = await rdma.receiveWithImm();
  using lmr = mr;
  const data = [...lmr.bytes];
  console.log(`[${data.join(", ")}]`);
  assert.ok(imm !== undefined);
  assert.deepEqual(data, new Array(8).fill(imm));
}

/** Read the memory the client lent us with RDMA READ. */
async function readRmrFromClient(rdma: Rdma): Promise<void> {
  using lmr = rdma.allocLocalMr(8);
  using rmr = await rdma.receiveRemoteMr();
  await rdma.read(lmr, rmr);
  const data = [...lmr.bytes];
  console.log(`[${data.join(", ")}]`);
  assert.deepEqual(data, [1, 1, 1, 1, 2, 2, 2, 2]);
}

/** Receive our own memory back after the client wrote into it. */
async function receiveMrAfterBeingWritten(rdma: Rdma): Promise<void> {
  using lmr = await rdma.receiveLocalMr();
  const data = [...lmr.bytes];
  console.log(`[${data.join(", ")}]`);
  assert.deepEqual(data, [0, 0, 0, 0, 1, 1, 1, 1]);
}

/** Same, announced by a WRITE with immediate data marking the boundary. */
async function receiveMrAfterBeingWrittenWithImm(rdma: Rdma): Promise<void> {
  const imm = await rdma.receiveWriteImm();
  using lmr = await rdma.receiveLocalMr();
  const data = lmr.bytes;
  console.log(`[${[...data].join(", ")}]`);
  assert.deepEqual([...data], [0, 0, 0, 0, 1, 1, 1, 1]);
  // The immediate is the boundary between the two kinds of data.
  assert.notEqual(data[(imm - 1) >>> 0], data[imm]);
}

export async function server(addr: string, onListening?: (port: number) => void): Promise<void> {
  console.log("server start");
  const listener = await new RdmaBuilder().bind(addr);
  onListening?.(listener.port);
  const rdma = await listener.accept();
  await listener.close();
  console.log(`accepted (provider ${rdma.provider})`);
  await receiveDataFromClient(rdma);
  await receiveDataWithImmFromClient(rdma);
  await readRmrFromClient(rdma);
  await receiveMrAfterBeingWritten(rdma);
  await receiveMrAfterBeingWrittenWithImm(rdma);
  await rdma.close();
  console.log("server done");
}

if (import.meta.url === `file://${process.argv[1]}`) {
  // Prints "listening on PORT" so a launcher can start the client without guessing or sleeping.
  await server(process.argv[2] ?? "127.0.0.1:5555", (port) => console.log(`listening on ${port}`));
}
