/**
 * What the connection's staging memory (api/staging.ts) and the rendezvous
 * bounce copy must hold when connections end and memory is disposed early:
 * found by a review of the staging change, each seen failing before its fix.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { type Rdma } from "../../src/index.js";
import { PROVIDER, at, builder, eventually, pattern, withApiPair } from "../support/api.js";
import { SLOW } from "../support/seam.js";

function spareOf(r: Rdma): number {
  return (r as unknown as { staging: { spareBytes: number } }).staging.spareBytes;
}

/** Plain-buffer traffic of every staging class (sends eager and rendezvous, writes) on `c` toward `s`. */
async function traffic(c: Rdma, s: Rdma): Promise<void> {
  const rmr = await c.requestRemoteMr(64 * 1024);
  const sizes = [233, 1000, 4096, 5000, 16384, 40000];
  const sends = sizes.map((n, i) => c.send(pattern(n, i + 1)));
  for (let i = 0; i < sizes.length; i++) {
    using got = await s.receive();
    assert.deepEqual(got.bytes, pattern(sizes[i]!, i + 1));
  }
  await Promise.all(sends);
  await Promise.all([c.write(pattern(4096, 1), rmr), c.write(pattern(60000, 2), rmr)]);
  rmr.dispose();
}

describe(`staging memory when connections end [${PROVIDER}]`, { timeout: 120_000 * SLOW }, () => {
  it("issue 21: a newConnection() sibling that closed leaves no staging memory in the pool it shares with its family (pool.liveBytes back to before it)", async () => {
    const listener = await builder("server").bind(at(0));
    const [client, server] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 10_000 * SLOW })]);
    try {
      for (const withTraffic of [false, true]) {
        const before = client.stats().pool.liveBytes;
        const [sib, peer] = await Promise.all([client.newConnection(), listener.accept({ timeoutMs: 10_000 * SLOW })]);
        if (withTraffic) {
          await traffic(sib, peer);
          assert.ok(spareOf(sib) > 0, "the sibling kept spare staging memory while open (the reuse)");
        }
        await sib.close();
        await peer.close();
        // Everything the sibling held (receive buffers, headers, bounce, staging) goes back to the shared pool.
        await eventually(() => client.stats().pool.liveBytes <= before, 10_000 * SLOW, `the sibling's memory to go back (with traffic: ${withTraffic}; live ${client.stats().pool.liveBytes} bytes, ${before} before; sibling's spare staging ${spareOf(sib)} bytes)`);
      }
    } finally {
      await Promise.allSettled([client.close(), server.close(), listener.close()]);
    }
  });
});

describe(`rendezvous bounce copy [${PROVIDER}]`, { timeout: 60_000 * SLOW }, () => {
  it("issue 21: a LocalMr sent by rendezvous through bounce memory and disposed at once (its memory waits for the operation) still settles the send, and the connection lives on", () =>
    withApiPair(async ({ server, client }) => {
      const m = client.allocLocalMr(8192);
      m.bytes.set(pattern(8192, 5));
      const sent = client.send(m);
      m.dispose(); // allowed: freeing waits for the operation (inflight)
      const r = await Promise.race([sent.then(() => "settled", (e: unknown) => `rejected: ${String(e)}`), new Promise<string>((res) => setTimeout(() => res("pending after 10 s"), 10_000 * SLOW).unref())]);
      assert.notEqual(r, "pending after 10 s", "the send settles");
      // Its bytes arrive whole (copied at post, while the operation still pinned them), and the connection still works.
      using first = await server.receive();
      assert.deepEqual(first.bytes, pattern(8192, 5));
      const ok = client.send(pattern(16, 1));
      using later = await server.receive();
      assert.deepEqual(later.bytes, pattern(16, 1));
      await ok;
    }));
});
