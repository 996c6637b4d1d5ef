/**
 * From the review of 2b45321 (credits.growth(imm)): a receive taken by a
 * WRITE with immediate grew the ring without counting the credits owed to
 * the peer, at any ring size.
 * The credits.ts header says the ring doubles only "when the peer is about to
 * run out of credits even counting those owed to it", and "a connection that
 * never has more than a few messages in flight keeps a few receive buffers";
 * RdmaBuilder.setRecvDepth says the ring doubles "as the peer keeps more
 * messages in flight". A WRITE-with-immediate ping-pong never has more than
 * one in flight, yet every CREDIT round trip doubled the ring: with a large
 * receive depth it ended at the depth (recvDepth x (header + eagerMax) of
 * registered memory per connection, for one message in flight). Now that
 * holds only while the ring is under IMM_RING (32).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { CM, PROVIDER, pattern, withApiPair, writeImmPingPong } from "../support/api.js";

const SLOW = PROVIDER === "verbs" ? 4 : 1;
const DEPTH = 1024;

describe(`review: WRITE-with-immediate ring growth is bounded by what is in flight [${PROVIDER}, ${CM}]`, { timeout: 120_000 * SLOW }, () => {
  it("a one-in-flight writeWithImm ping-pong does not grow the ring to a large receive depth", () =>
    withApiPair(
      async (pair) => {
        const { server, client } = pair;
        await writeImmPingPong(pair, 600);
        const rings = { client: client.stats().receiveRing, server: server.stats().receiveRing };
        // One message in flight needs nowhere near the depth: at most IMM_RING (32) receives.
        for (const [side, ring] of Object.entries(rings)) assert.ok(ring <= 32, `the ${side}'s ring grew to ${ring} receives (depth ${DEPTH}) with one WRITE with immediate in flight`);
      },
      { server: (b) => b.setRecvDepth(DEPTH), client: (b) => b.setRecvDepth(DEPTH) },
    ));

  it("control: the same ping-pong with messages keeps 8 receives at that depth", () =>
    withApiPair(
      async ({ server, client }) => {
        for (let i = 0; i < 600; i++) {
          await client.send(pattern(8, i));
          (await server.receive()).dispose();
          await server.send(pattern(8, i + 1));
          (await client.receive()).dispose();
        }
        assert.equal(client.stats().receiveRing, 8);
        assert.equal(server.stats().receiveRing, 8);
      },
      { server: (b) => b.setRecvDepth(DEPTH), client: (b) => b.setRecvDepth(DEPTH) },
    ));
});
