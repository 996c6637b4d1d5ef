/**
 * Issue 22 point 3: plain buffers.
 *
 * - send, sendWithImm, write and writeWithImm take any Uint8Array, Buffer or
 *   DataView, copied into registered memory when called (a pooled Buffer, a
 *   slice of Node's shared 8 KiB pool, sends exactly its own bytes), eager
 *   and rendezvous sizes, empty included; the caller may reuse its buffer at
 *   once; the staging memory is freed after each operation;
 * - registerMr takes a SharedArrayBuffer: a Worker fills the registered
 *   memory and the device sends it without a copy; the device writes into
 *   it and the Worker reads what arrived; what registerMr refuses gets
 *   INVALID_ARGUMENT saying why.
 *
 * Runs on tcp, and on rxe in the verbs suite (api/ files).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { Worker } from "node:worker_threads";
import { RdmaError } from "../../src/index.js";
import { CM, PROVIDER, apiPair, pattern } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const DEADLINE = 60_000 * SLOW;

function isCode(c: string, re?: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    if (re) assert.match(e.message, re);
    return true;
  };
}

/** Runs `body` in a Worker with `sab` and resolves with what it posts back. */
function inWorker<T>(body: string, sab: SharedArrayBuffer): Promise<T> {
  return new Promise((resolve, reject) => {
    const w = new Worker(`const { parentPort, workerData: sab } = require("node:worker_threads"); ${body}`, { eval: true, workerData: sab });
    w.once("message", (m: T) => (resolve(m), void w.terminate()));
    w.once("error", reject);
    w.once("exit", (c) => (c === 0 ? undefined : reject(new Error(`worker exited with ${c}`))));
  });
}

describe(`plain buffers [${PROVIDER}, ${CM}]`, { timeout: 10 * DEADLINE }, () => {
  it("issue 22 point 3: send(Buffer) from a pooled Buffer sends exactly its bytes, copied when called", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      const a = Buffer.from("hello");
      const b = Buffer.from("pooled world");
      assert.ok(a.buffer === b.buffer && a.byteOffset + a.length <= b.byteOffset, "both are slices of Node's shared pool");
      const sent = client.send(a);
      a.fill(0); // the caller may reuse its buffer as soon as send() returns
      await sent;
      await client.sendWithImm(b, 0xfeed);
      const big = Buffer.from(pattern(300_000, 3)); // rendezvous
      await client.send(big.subarray(5, 250_005));
      const dv = new DataView(pattern(64, 4).buffer, 8, 40);
      await client.send(dv);
      await client.send(new Uint8Array(0));
      await client.send(new Float64Array([1.5, -2]));
      const got: { bytes: Buffer; imm: number | undefined }[] = [];
      for (let i = 0; i < 6; i++) {
        const { mr, imm } = await server.receiveWithImm();
        got.push({ bytes: Buffer.from(mr.bytes), imm });
        mr.dispose();
      }
      assert.equal(got[0]!.bytes.toString(), "hello");
      assert.equal(got[0]!.imm, undefined);
      assert.equal(got[1]!.bytes.toString(), "pooled world");
      assert.equal(got[1]!.imm, 0xfeed);
      assert.deepEqual(got[2]!.bytes, big.subarray(5, 250_005));
      assert.deepEqual(got[3]!.bytes, Buffer.from(pattern(64, 4).subarray(8, 48)));
      assert.equal(got[4]!.bytes.length, 0);
      assert.deepEqual(got[5]!.bytes, Buffer.from(new Float64Array([1.5, -2]).buffer));
      assert.equal(client.stats().messagesSent, 6);
      // The staging memory goes back to the pool with each operation: more sends hold no more memory.
      const round = async (): Promise<number> => {
        for (let i = 0; i < 40; i++) await client.send(Buffer.from(`message ${i}`));
        for (let i = 0; i < 40; i++) (await server.receive()).dispose();
        return client.stats().memory.poolBytes;
      };
      const held = await round();
      assert.equal(await round(), held, "no staging memory kept");
      assert.equal(await round(), held, "no staging memory kept");
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 3: write and writeWithImm take a Buffer or DataView; read still needs registered memory", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      const rmr = await client.requestRemoteMr(64);
      await client.write(Buffer.from("abcdef"), rmr);
      await client.writeWithImm(new DataView(new TextEncoder().encode("XY").buffer), rmr.slice(10, 12), 7);
      assert.equal(await server.receiveWriteImm(), 7);
      using back = client.allocLocalMr(12);
      await client.read(back, rmr.slice(0, 12));
      assert.deepEqual([...back.bytes], [..."abcdef"].map((c) => c.charCodeAt(0)).concat([0, 0, 0, 0, 88, 89]));
      await assert.rejects(client.read(Buffer.alloc(4) as never, rmr), isCode("INVALID_ARGUMENT", /LocalMr/));
      await assert.rejects(client.write(Buffer.alloc(65), rmr), isCode("OUT_OF_RANGE"));
      await assert.rejects(client.send("text" as never), isCode("INVALID_ARGUMENT", /Uint8Array, Buffer or DataView/));
      await assert.rejects(client.send(null as never), isCode("INVALID_ARGUMENT"));
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 3: registerMr(SharedArrayBuffer): a Worker fills registered memory, the device sends it; the device writes into it, the Worker reads it", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      const sab = new SharedArrayBuffer(64 * 1024);
      using lmr = client.registerMr(sab);
      assert.equal(lmr.length, sab.byteLength);
      const filled = await inWorker<number>(`const u = new Uint8Array(sab); for (let i = 0; i < u.length; i++) u[i] = (i * 7 + 3) & 255; parentPort.postMessage(u.length);`, sab);
      assert.equal(filled, sab.byteLength);
      await client.send(lmr); // rendezvous: the peer READs the shared memory itself
      await client.send(lmr.slice(100, 200)); // eager
      using m1 = await server.receive();
      using m2 = await server.receive();
      const want = (i: number): number => (i * 7 + 3) & 255;
      assert.ok(m1.bytes.every((v, i) => v === want(i)), "the whole shared region arrived");
      assert.ok(m2.bytes.every((v, i) => v === want(i + 100)), "the slice arrived");
      // The other way: the device writes into shared memory, the worker sees it.
      const rmr = await client.requestRemoteMr(16);
      await client.write(Buffer.from("0123456789abcdef"), rmr);
      await client.read(lmr.slice(0, 16), rmr);
      const seen = await inWorker<string>(`parentPort.postMessage(Buffer.from(new Uint8Array(sab, 0, 16)).toString());`, sab);
      assert.equal(seen, "0123456789abcdef");
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 3: registerMr refuses what it cannot register, saying why", async () => {
    const p = await apiPair();
    try {
      const { client } = p;
      assert.throws(() => client.registerMr(Buffer.from("pooled") as never), isCode("INVALID_ARGUMENT", /shared pool/));
      assert.throws(() => client.registerMr(new Uint8Array(8) as never), isCode("INVALID_ARGUMENT", /view\.buffer/));
      assert.throws(() => client.registerMr("x" as never), isCode("INVALID_ARGUMENT"));
      const growable = new (SharedArrayBuffer as unknown as new (n: number, o: object) => SharedArrayBuffer)(8, { maxByteLength: 64 });
      if ((growable as SharedArrayBuffer & { growable?: boolean }).growable) assert.throws(() => client.registerMr(growable), isCode("INVALID_ARGUMENT", /growable/));
      assert.throws(() => client.registerMr(new SharedArrayBuffer(8), 4, 8), isCode("INVALID_ARGUMENT"));
    } finally {
      await p.close();
    }
  });
});
