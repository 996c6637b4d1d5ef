/**
 * issue 21 point 6: the receive ring is sized by the depth actually used.
 * Each side posts 8 receives before it connects (agent protocol v4), so its
 * peer starts with 8 credits; the ring doubles, up to the receive depth, when
 * the peer keeps more messages in flight than the ring can take. A connection
 * that only ever has one message in flight keeps its 8 buffers.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { CM, PROVIDER, eventually, pattern, withApiPair, writeImmPingPong } from "../support/api.js";

const SLOW = PROVIDER === "verbs" ? 4 : 1;

describe(`the receive ring grows with use [${PROVIDER}, ${CM}]`, { timeout: 120_000 * SLOW }, () => {
  it("issue 21 point 6: 8 receives at first; one message at a time keeps 8; a burst grows the ring to the depth (32), every message intact and in order", () =>
    withApiPair(async ({ server, client }) => {
      assert.equal(server.stats().receiveRing, 8, "the server's first receives");
      assert.equal(client.stats().receiveRing, 8, "the client's first receives");
      // The first credits are the peer's 8 first receives (less the LIMITS message, its return not yet reported).
      for (const [side, rdma] of [["client", client], ["server", server]] as const) {
        const c = rdma.stats().credits;
        assert.ok(c <= 8 && c >= 6, `the ${side} holds ${c} credits: the peer's first 8 receives, not its whole depth`);
      }
      // Ping-pong: never more than one message in flight each way.
      for (let i = 0; i < 100; i++) {
        await client.send(pattern(64, i));
        const m = await server.receive();
        assert.deepEqual(m.bytes, pattern(64, i));
        m.dispose();
        await server.send(pattern(32, i));
        const r = await client.receive();
        assert.deepEqual(r.bytes, pattern(32, i));
        r.dispose();
      }
      assert.equal(server.stats().receiveRing, 8, "ping-pong never grows the server's ring");
      assert.equal(client.stats().receiveRing, 8, "ping-pong never grows the client's ring");
      // A burst: 300 messages sent without waiting, of sizes up to the eager limit.
      const N = 300;
      const sizeOf = (i: number): number => [1, 64, 700, 4000][i % 4]!;
      const sent = Promise.all(Array.from({ length: N }, (_, i) => client.send(pattern(sizeOf(i), i))));
      for (let i = 0; i < N; i++) {
        const m = await server.receive();
        assert.deepEqual(m.bytes, pattern(sizeOf(i), i), `message ${i} of the burst`);
        m.dispose();
      }
      await sent;
      assert.equal(server.stats().receiveRing, 32, "the burst grew the server's ring to its receive depth");
      assert.equal(client.stats().receiveRing, 8, "the client received nothing new: its ring did not grow");
      // The client may now keep more of the server's receives busy than the first 8.
      await eventually(() => client.stats().credits > 8, 10_000 * SLOW, `the client to hold more than 8 credits (${client.stats().credits})`);
      assert.ok(client.stats().credits <= 32, "never more credits than the server's depth");
    }));

  it("a WRITE-with-immediate ping-pong (whose messages carry no credits back) grows the ring, so CREDIT messages stay under one per five messages", () =>
    withApiPair(async (pair) => {
      const { server, client } = pair;
      const c0 = client.stats().creditMessages;
      const s0 = server.stats().creditMessages;
      const N = 200;
      await writeImmPingPong(pair, N);
      const [cm, sm] = [client.stats().creditMessages - c0, server.stats().creditMessages - s0];
      // Each side's ring stays within its depth; a CREDIT returned only a few credits each at 8 receives (one per three or four messages).
      for (const [side, rdma, n] of [["client", client, cm], ["server", server, sm]] as const) {
        const ring = rdma.stats().receiveRing;
        assert.ok(ring > 8 && ring <= 32, `the ${side}'s ring grew within its depth (${ring})`);
        assert.ok(n < N / 5, `the ${side} sent ${n} CREDIT messages for ${N} WRITEs with immediate`);
      }
    }));
});
