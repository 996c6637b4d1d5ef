/**
 * Plain buffers given to send()/write(): one of at most SMALL_SEND_COPY bytes
 * sent is copied behind the message's header, in a recycled header buffer;
 * larger ones, and every write, are copied into the connection's staging
 * memory, reused once the operation settles (never detached: no view of it
 * escapes). Either way the message is the same on the wire, the caller may
 * reuse its buffer as soon as the call returns, and the peer's limits apply.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, type Rdma } from "../../src/index.js";
import { SMALL_SEND_COPY } from "../../src/agent/connection.js";
import { PROVIDER, pattern, withApiPair } from "../support/api.js";

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

/** Counts the pool allocations `conn` makes while `fn` runs. */
async function allocations(rdma: Rdma, fn: () => Promise<void>): Promise<number> {
  const pool = (rdma as unknown as { ctx: { pool: { alloc: (...a: unknown[]) => unknown } } }).ctx.pool;
  const alloc = pool.alloc;
  let n = 0;
  pool.alloc = (...a: unknown[]) => {
    n++;
    return alloc.apply(pool, a);
  };
  try {
    await fn();
  } finally {
    pool.alloc = alloc;
  }
  return n;
}

describe(`send() of a small plain buffer [${PROVIDER}]`, () => {
  it("sizes 0 to SMALL_SEND_COPY + 1 and beyond, from views at an offset, DataViews and Buffers, with and without immediate: every byte arrives, in order, though the caller reuses its buffer at once", () =>
    withApiPair(async ({ server, client }) => {
      assert.equal(SMALL_SEND_COPY, 232);
      const sizes = [0, 1, 7, 40, 41, 100, SMALL_SEND_COPY - 1, SMALL_SEND_COPY, SMALL_SEND_COPY + 1, 1000, 4096];
      const sends: Promise<void>[] = [];
      sizes.forEach((n, i) => {
        const backing = new Uint8Array(n + 16);
        backing.set(pattern(n, i + 1), 8);
        const kind = i % 3;
        const data = kind === 0 ? backing.subarray(8, 8 + n) : kind === 1 ? new DataView(backing.buffer, 8, n) : Buffer.from(backing.buffer, 8, n);
        sends.push(i % 2 === 0 ? client.send(data) : client.sendWithImm(data, 0x1000 + i));
        // The bytes were taken when send() returned.
        backing.fill(0xee);
      });
      for (let i = 0; i < sizes.length; i++) {
        const { mr, imm } = await server.receiveWithImm();
        using got = mr;
        assert.equal(got.length, sizes[i], `message ${i}'s length`);
        assert.deepEqual(got.bytes, pattern(sizes[i]!, i + 1), `message ${i} (${sizes[i]} bytes)`);
        assert.equal(imm, i % 2 === 0 ? undefined : 0x1000 + i, `message ${i}'s immediate`);
      }
      await Promise.all(sends);
    }));

  it("no staging memory per small message: a second round of 100 sends takes no memory from the pool per message (larger ones do)", () =>
    withApiPair(async ({ server, client }) => {
      const round = async (n: number): Promise<void> => {
        const sends = Array.from({ length: 100 }, (_, i) => client.send(pattern(n, i + 1)));
        for (let i = 0; i < 100; i++) {
          using got = await server.receive();
          assert.deepEqual(got.bytes, pattern(n, i + 1));
        }
        await Promise.all(sends);
      };
      await round(SMALL_SEND_COPY); // the header buffers a round needs are made here
      // None per message (staged, each would take one); a control message of the round (a CREDIT) may still take a header buffer.
      const small = await allocations(client, () => round(SMALL_SEND_COPY));
      assert.ok(small <= 4, `${small} pool allocations by 100 sends of SMALL_SEND_COPY bytes`);
      assert.ok((await allocations(client, () => round(SMALL_SEND_COPY + 1))) >= 100, "a larger message is staged");
    }));

  it("the peer's limits still apply: over its maxMessageSize is OUT_OF_RANGE, over its eager threshold goes by rendezvous; an aborted signal or a closed connection rejects", async () => {
    await withApiPair(
      async ({ server, client }) => {
        await assert.rejects(client.send(new Uint8Array(65)), code("OUT_OF_RANGE"));
        const ok = client.send(pattern(64, 3));
        using got = await server.receive();
        assert.deepEqual(got.bytes, pattern(64, 3));
        await ok;
      },
      { server: (b) => b.setMaxMessageSize(64) },
    );
    await withApiPair(
      async ({ server, client }) => {
        const before = client.stats().rendezvousSent;
        const sends = [client.send(pattern(32, 1)), client.send(pattern(33, 2))];
        using a = await server.receive();
        using b = await server.receive();
        assert.deepEqual(a.bytes, pattern(32, 1));
        assert.deepEqual(b.bytes, pattern(33, 2));
        await Promise.all(sends);
        assert.equal(client.stats().rendezvousSent - before, 1, "the 33-byte message went by rendezvous");
        await assert.rejects(client.send(new Uint8Array(8), { signal: AbortSignal.abort() }), code("ABORTED"));
        await client.close();
        await assert.rejects(client.send(new Uint8Array(8)), (e: unknown) => e instanceof RdmaError);
      },
      { server: (b) => b.setEagerThreshold(32) },
    );
  });

  it("a peer that sends a message over this side's maxMessageSize anyway (it ignored the limit) fails the connection with PROTOCOL; neither it nor what follows it is delivered", async () => {
    await withApiPair(
      async ({ server, client }) => {
        // The client forgets the server's limit, as a hostile peer would.
        (client as unknown as { conn: { peer: { maxMessageSize?: number } } }).conn.peer.maxMessageSize = 1 << 30;
        const sends = [client.send(pattern(64, 1)), client.send(new Uint8Array(65)), client.send(pattern(8, 2))];
        using first = await server.receive();
        assert.deepEqual(first.bytes, pattern(64, 1));
        // Nothing after the violation is delivered either (the 8-byte message): the user never sees a gap.
        await assert.rejects(server.receive(), (e: unknown) => code("PROTOCOL")(e) && /65 bytes exceeds this side's maxMessageSize \(64\)/.test((e as Error).message));
        await Promise.allSettled(sends);
      },
      { server: (b) => b.setMaxMessageSize(64) },
    );
  });

  it("staging memory is reused: 4 KiB sends and writes of plain buffers take no pool memory per operation once warm, and a reused buffer never carries one message's bytes into another", () =>
    withApiPair(async ({ server, client }) => {
      const rmr = await client.requestRemoteMr(64 * 1024);
      const round = async (seed: number): Promise<void> => {
        // Sizes across the classes, eager and rendezvous (over 4 KiB + 64), each from a buffer the caller overwrites at once.
        const sizes = Array.from({ length: 60 }, (_, i) => [233, 1000, 1024, 4096, 4160, 5000, 16384, 40000][i % 8]!);
        const sends = sizes.map((n, i) => {
          const b = pattern(n, seed + i);
          const p = client.send(b);
          b.fill(0xee);
          return p;
        });
        for (let i = 0; i < sizes.length; i++) {
          using got = await server.receive();
          assert.deepEqual(got.bytes, pattern(sizes[i]!, seed + i), `round ${seed}, message ${i} (${sizes[i]} bytes)`);
        }
        await Promise.all(sends);
        const writes = Array.from({ length: 16 }, (_, i) => {
          const b = pattern(4096, seed + 100 + i);
          const p = client.write(b, rmr.slice(i * 4096, (i + 1) * 4096));
          b.fill(0xee);
          return p;
        });
        await Promise.all(writes);
        using back = client.allocLocalMr(64 * 1024);
        await client.read(back, rmr);
        for (let i = 0; i < 16; i++) assert.deepEqual(back.bytes.subarray(i * 4096, (i + 1) * 4096), pattern(4096, seed + 100 + i), `round ${seed}, write ${i}`);
      };
      await round(1);
      await round(1000);
      const load = async (): Promise<void> => {
        const sends = Array.from({ length: 32 }, (_, i) => client.send(pattern(4096, i)));
        for (let i = 0; i < 32; i++) {
          using got = await server.receive();
          assert.deepEqual(got.bytes, pattern(4096, i));
        }
        await Promise.all(sends);
        await Promise.all(Array.from({ length: 16 }, (_, i) => client.write(pattern(4096, i), rmr.slice(i * 4096, (i + 1) * 4096))));
      };
      await load(); // warm: the staging memory this load needs at once
      const steady = await allocations(client, load);
      // None per operation (48 of them; staged, each took one before); a control message may take a header buffer.
      assert.ok(steady <= 4, `${steady} pool allocations by 32 sends and 16 writes of 4 KiB, once warm`);
      const spare = (client as unknown as { staging: { spareBytes: number } }).staging.spareBytes;
      assert.ok(spare > 0 && spare <= 464 * 1024, `spare staging memory ${spare} bytes, at most 128 KiB per size class`);
      rmr.dispose();
    }));
});
