/**
 * Delivery semantics a Node user relies on (issue 19):
 *
 * - point 14: every message whose send() resolved before the peer closed stays
 *   receivable after the close, in order and intact (eager and rendezvous,
 *   with their immediates), then receive() rejects with CONNECTION_CLOSED; a
 *   side that closes itself drops what it did not read;
 * - point 13: memory of a closed connection reads `disposed`, and an
 *   operation on a closed connection rejects with CONNECTION_CLOSED, not
 *   INVALID_STATE, whatever memory it names.
 *
 * Runs on tcp, and on rxe in the verbs suite (api/ files).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { CM, PROVIDER, apiPair, eventually, pattern } from "../support/api.js";

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

/** Sizes of the 20 messages: eager, empty, bounce-copied rendezvous (≤ 128 KiB) and lent rendezvous. */
const SIZES = [16, 0, 4096, 100, 8192, 1, 300_000, 64, 2048, 65_536, 7, 4097, 512, 1_000_000, 33, 4000, 9000, 10, 200_000, 128];

describe(`delivery across close [${PROVIDER}, ${CM}]`, { timeout: 300_000 }, () => {
  it("issue 19 point 14: close() drops nothing send() reported delivered; the receiver reads all of it, then CONNECTION_CLOSED", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      const got: { bytes: number[]; imm: number | undefined }[] = [];
      // The receiver reads the first 8 while the sender sends; the rest only after the sender closed.
      const early = (async () => {
        for (let i = 0; i < 8; i++) {
          const { mr, imm } = await server.receiveWithImm();
          got.push({ bytes: [...mr.bytes], imm });
          mr.dispose();
        }
      })();
      for (let i = 0; i < SIZES.length; i++) {
        using m = client.allocLocalMr(Math.max(1, SIZES[i]!));
        m.bytes.set(pattern(SIZES[i]!, i + 1));
        const lmr = m.slice(0, SIZES[i]!);
        if (i % 3 === 0) await client.sendWithImm(lmr, 1000 + i);
        else await client.send(lmr);
      }
      await early;
      await client.close();
      await eventually(() => server.isClosed, 60_000, "the server saw the close");
      for (let i = 8; i < SIZES.length; i++) {
        const { mr, imm } = await server.receiveWithImm();
        assert.equal(mr.disposed, false, "a message kept past the close is readable");
        got.push({ bytes: [...mr.bytes], imm });
        mr.dispose();
      }
      for (let i = 0; i < SIZES.length; i++) {
        assert.equal(got[i]!.bytes.length, SIZES[i], `message ${i}: length`);
        assert.deepEqual(got[i]!.bytes, [...pattern(SIZES[i]!, i + 1)], `message ${i}: bytes`);
        assert.equal(got[i]!.imm, i % 3 === 0 ? 1000 + i : undefined, `message ${i}: immediate`);
      }
      await assert.rejects(server.receive(), code("CONNECTION_CLOSED"));
      await assert.rejects(server.receive(), code("CONNECTION_CLOSED"));
    } finally {
      await p.close();
    }
  });

  it("issue 19 point 14: a receive waiting when the peer closes still gets the message sent just before", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      using m = client.allocLocalMr(32);
      m.bytes.set(pattern(32, 9));
      const waiting = server.receive();
      await client.send(m);
      await client.close();
      using r = await waiting;
      assert.deepEqual([...r.bytes], [...pattern(32, 9)]);
      await assert.rejects(server.receive(), code("CONNECTION_CLOSED"));
    } finally {
      await p.close();
    }
  });

  it("issue 19 point 14: a side that closes itself drops what it did not read", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      using m = client.allocLocalMr(32);
      await client.send(m);
      await eventually(() => server.stats().unread === 1, 60_000, "the message arrived");
      await server.close();
      await assert.rejects(server.receive(), code("CONNECTION_CLOSED"));
      assert.equal(server.stats().unread, 0);
    } finally {
      await p.close();
    }
  });

  it("a rendezvous send still waiting for credits ends at its deadline with TIMEOUT, and the connection lives", async () => {
    const p = await apiPair({ server: (b) => b.setRecvDepth(8), client: (b) => b.setRendezvousTimeout(1000) });
    try {
      const { client, server } = p;
      using small = client.allocLocalMr(8);
      // The server reads nothing: its receive buffers fill and the client runs out of credits.
      const eager: Promise<void>[] = [];
      for (let i = 0; i < 24; i++) eager.push(client.send(small));
      await eventually(() => client.stats().credits < 5 && client.stats().sqOutstanding === 0, 60_000, "the client to run out of credits");
      using big = client.allocLocalMr(64 * 1024);
      // The announcement waits behind the eager sends for credits the server never returns.
      await assert.rejects(client.send(big), code("TIMEOUT"));
      assert.equal(client.isClosed, false);
      // Reading frees credits: the eager sends go, and the connection still carries messages.
      for (let i = 0; i < 24; i++) (await server.receive()).dispose();
      await Promise.all(eager);
      await client.send(small);
      (await server.receive()).dispose();
    } finally {
      await p.close();
    }
  });

  it("issue 19 point 13: memory of a closed connection is disposed, and operations on it reject with CONNECTION_CLOSED", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      const lmr = client.allocLocalMr(64);
      const rmr = await client.requestRemoteMr(64, { timeoutMs: 60_000 });
      assert.equal(lmr.disposed, false);
      await client.close();
      assert.equal(lmr.disposed, true, "its connection closed: the memory is gone");
      await assert.rejects(client.send(lmr), code("CONNECTION_CLOSED"));
      await assert.rejects(client.write(lmr, rmr), code("CONNECTION_CLOSED"));
      await assert.rejects(client.read(lmr, rmr), code("CONNECTION_CLOSED"));
      await eventually(() => server.isClosed, 60_000, "the server saw the close");
      const theirs = server.allocLocalMr.bind(server);
      assert.throws(() => theirs(8), code("CONNECTION_CLOSED"));
    } finally {
      await p.close();
    }
  });
});
