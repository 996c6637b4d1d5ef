/**
 * What a peer can make this side hold through the memory protocol, and the
 * smaller holes of issue 19 that live in the agent:
 *
 * - point 6: a granted region handed back (sendRemoteMr) stays charged to the
 *   owner's quota, region count and process budget until it is claimed with
 *   receiveLocalMr, so request + give-back in a loop stops at the quota with
 *   QUOTA_EXCEEDED instead of growing the owner's memory without bound; what
 *   is never claimed is freed when the connection ends;
 * - point 13: a LocalMr of a closed connection reads `disposed`; an operation
 *   on a closed connection rejects with CONNECTION_CLOSED whatever memory it
 *   names; a borrower cannot renew a lend past the owner's maximum lease
 *   counted from the lend.
 *
 * Runs on tcp, and on rxe in the verbs suite (api/ files).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, peerMemoryUsage } from "../../src/index.js";
import { CM, PROVIDER, eventually, withApiPair } from "../support/api.js";

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

const MiB = 2 ** 20;

describe(`what a peer makes this side hold [${PROVIDER}, ${CM}]`, { timeout: 300_000 }, () => {
  it("issue 19 point 6: handed-back regions stay charged until claimed; request + give-back stops at the quota", async () => {
    const baseline = peerMemoryUsage().used;
    await withApiPair(
      async ({ client, server }) => {
        // 4 rounds fill the 4 MiB quota with regions handed back and never claimed.
        for (let i = 0; i < 4; i++) {
          const rmr = await client.requestRemoteMr(MiB, { timeoutMs: 60_000 });
          await client.sendRemoteMr(rmr);
        }
        await eventually(() => server.stats().unclaimedLocal === 4, 60_000, "the owner received the four regions");
        assert.equal(server.stats().quotaUsed, 4 * MiB, "handed-back regions count against the quota until claimed");
        assert.equal(peerMemoryUsage().used - baseline, 4 * MiB, "and against the process budget");
        // The fifth round is refused: the peer cannot cycle past the quota.
        await assert.rejects(client.requestRemoteMr(MiB, { timeoutMs: 60_000 }), code("QUOTA_EXCEEDED"));
        // Claiming gives the room back.
        const taken = [];
        for (let i = 0; i < 2; i++) taken.push(await server.receiveLocalMr());
        assert.equal(server.stats().quotaUsed, 2 * MiB);
        const again = await client.requestRemoteMr(MiB, { timeoutMs: 60_000 });
        await client.sendRemoteMr(again);
        await eventually(() => server.stats().unclaimedLocal === 3, 60_000, "the owner received the fifth region");
        for (const l of taken) l.dispose();
      },
      { server: (b) => b.setRemoteMemoryQuota(4 * MiB) },
    );
    // Unclaimed regions are freed, and uncharged, when the connection ends.
    await eventually(() => peerMemoryUsage().used === baseline, 60_000, "the process budget is back where it was");
  });

  it("issue 19 point 13: unread messages stop at the documented bound (receive depth + half of it) and nothing is dropped", async () => {
    const DEPTH = 16;
    await withApiPair(
      async ({ client, server }) => {
        using m = client.allocLocalMr(8);
        let resolved = 0;
        const sends = Array.from({ length: 100 }, () => client.send(m).then(() => void resolved++));
        // The sender stops when the receiver stops re-posting (it has fewer credits than a data message needs).
        await eventually(() => server.stats().unread === resolved && resolved > 0 && client.stats().credits < 5 && client.stats().sqOutstanding === 0, 60_000, "the sender to run out of credits");
        const held = server.stats().unread;
        assert.ok(held <= DEPTH + DEPTH / 2, `${held} unread messages: more than the documented ${DEPTH + DEPTH / 2}`);
        assert.ok(held > DEPTH / 2, `${held} unread messages: the peer may use the credits it holds when the reader stops`);
        for (let i = 0; i < 100; i++) (await server.receive()).dispose();
        await Promise.all(sends);
        assert.equal(resolved, 100);
      },
      { server: (b) => b.setRecvDepth(DEPTH), client: (b) => b.setRecvDepth(DEPTH) },
    );
  });

  it("issue 19 point 13: renewals cannot carry a lend past the owner's maximum lease from the lend", async () => {
    await withApiPair(
      async ({ client, server }) => {
        using lmr = server.allocLocalMr(64);
        await server.sendLocalMr(lmr, { leaseMs: 60_000 });
        const rmr = await client.receiveRemoteMr();
        // Asking for the whole maximum again, from now, would end after the lend's allowed life.
        await assert.rejects(rmr.renew(60_000), code("OUT_OF_RANGE"));
        await rmr.renew(1000);
        await client.sendRemoteMr(rmr);
      },
      { server: (b) => b.setMaxLease(60_000) },
    );
  });

  it("issue 19 point 19: allocLocalMr(0) is an empty region, and an empty message travels", async () => {
    await withApiPair(async ({ client, server }) => {
      using e = client.allocLocalMr(0);
      assert.equal(e.length, 0);
      assert.equal(e.bytes.length, 0);
      await client.sendWithImm(e, 7);
      const { mr, imm } = await server.receiveWithImm();
      assert.equal(mr.length, 0);
      assert.equal(imm, 7);
      mr.dispose();
    });
  });

  it("issue 19 point 6: the region count bounds handed-back regions too", async () => {
    await withApiPair(
      async ({ client, server }) => {
        for (let i = 0; i < 3; i++) await client.sendRemoteMr(await client.requestRemoteMr(4096, { timeoutMs: 60_000 }));
        await eventually(() => server.stats().unclaimedLocal === 3, 60_000, "the owner received the three regions");
        await assert.rejects(client.requestRemoteMr(4096, { timeoutMs: 60_000 }), code("QUOTA_EXCEEDED"));
      },
      { server: (b) => b.setMaxRemoteRegions(3) },
    );
  });
});
