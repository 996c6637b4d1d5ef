/**
 * Receive buffers are recycled: a message's buffer goes back to the
 * connection when the user disposes it and is posted again, with no new
 * allocation or registration. Recycled memory is poisoned here (0xa5), so a
 * message the user still holds that shared a recycled buffer would see its
 * bytes change; a view taken before dispose must be dead afterwards.
 */
process.env.ASYNC_RDMA_POISON_RECYCLED = "1";
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { CM, PROVIDER, pattern, withApiPair } from "../support/api.js";
import { peekBytes } from "../../src/memory/mr.js";

describe(`receive buffers are recycled [${PROVIDER}, ${CM}]`, { timeout: 120_000 * (PROVIDER === "verbs" ? 4 : 1) }, () => {
  it("held messages keep their bytes while disposed ones are recycled and reused", () =>
    withApiPair(async ({ server, client }) => {
      const N = PROVIDER === "verbs" ? 300 : 2000;
      const sizeOf = (i: number): number => [0, 1, 7, 64, 500, 1000, 4000][i % 7]!;
      const held: { i: number; mr: { bytes: Uint8Array; dispose(): void; length: number }; imm: number | undefined }[] = [];
      const receiving = (async () => {
        for (let i = 0; i < N; i++) {
          const m = await server.receiveWithImm();
          assert.equal(m.mr.length, sizeOf(i), `message ${i}: length`);
          assert.deepEqual(m.mr.bytes, pattern(sizeOf(i), i), `message ${i}: bytes on arrival`);
          assert.equal(m.imm, i % 3 === 0 ? i : undefined, `message ${i}: immediate`);
          // Hold every 5th message (at most 12 at once, below half the receive depth), dispose the rest.
          if (i % 5 === 0) {
            held.push({ i, mr: m.mr, imm: m.imm });
            if (held.length > 12) {
              const h = held.shift()!;
              assert.deepEqual(h.mr.bytes, pattern(sizeOf(h.i), h.i), `message ${h.i}: bytes after ${i - h.i} more arrivals through recycled buffers`);
              h.mr.dispose();
            }
          } else {
            const stale = m.mr.bytes;
            m.mr.dispose();
            assert.equal(stale.byteLength, 0, `message ${i}: a view taken before dispose is detached`);
          }
        }
      })();
      const src = client.allocLocalMr(4096);
      for (let i = 0; i < N; i++) {
        const n = sizeOf(i);
        src.bytes.set(pattern(n, i));
        if (i % 3 === 0) await client.sendWithImm(src.slice(0, n), i);
        else await client.send(src.slice(0, n));
      }
      await receiving;
      for (const h of held) assert.deepEqual(h.mr.bytes, pattern(sizeOf(h.i), h.i), `message ${h.i}: bytes at the end`);
      const st = server.stats();
      // Most buffers came back by dispose and were posted again instead of new ones.
      assert.ok(st.recycledReceives >= N / 2, `recycled ${st.recycledReceives} of ${N} receive buffers`);
      assert.ok(st.pool.registrations < 64, `${st.pool.registrations} registrations for ${N} messages`);
    }));

  it("a message disposed while a send from it is in flight is recycled only after the send completes", () =>
    withApiPair(async ({ server, client }) => {
      // Echo: the server sends each received message back from its receive buffer, disposing it at once.
      const N = PROVIDER === "verbs" ? 100 : 500;
      const echo = (async () => {
        for (let i = 0; i < N; i++) {
          const m = await server.receive();
          const sent = server.send(m);
          m.dispose();
          await sent;
        }
      })();
      const src = client.allocLocalMr(1000);
      for (let i = 0; i < N; i++) {
        src.bytes.set(pattern(1000, i));
        await client.send(src);
        const back = await client.receive();
        assert.deepEqual(back.bytes, pattern(1000, i), `echo ${i}`);
        back.dispose();
      }
      await echo;
    }));

  it("issue 21 point 1: a message the library read only through peekBytes is re-posted without detaching its buffer; one the user viewed is detached first", () =>
    withApiPair(async ({ server, client }) => {
      const src = client.allocLocalMr(100);
      for (let i = 0; i < 2; i++) {
        src.bytes.set(pattern(100, i));
        await client.send(src);
      }
      const a = await server.receive();
      const peek = peekBytes(a);
      assert.deepEqual(peek, pattern(100, 0));
      a.dispose();
      assert.equal(peek.byteLength, 100, "nothing was handed out: the buffer is re-posted as it is (no detach, no new ArrayBuffer)");
      const b = await server.receive();
      const view = b.bytes;
      assert.deepEqual(view, pattern(100, 1));
      b.dispose();
      assert.equal(view.byteLength, 0, "a view the user took is detached before its buffer is re-posted");
      assert.ok(server.stats().recycledReceives >= 2, "both buffers went back to the receive ring");
    }));
});
