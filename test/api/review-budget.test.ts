/**
 * Review of the delivery-across-close change (issue 19 point 14): the
 * process-wide peer memory budget (peerMemoryUsage().used) returns to its
 * baseline after every connection ends, however it ends. Received memory
 * the user holds is moved out of the pool at teardown (which gives its
 * charge back), unless it is in use: lent or in flight on a newConnection()
 * sibling. Then nothing gives the charge back when the family's pool closes.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { peerMemoryUsage } from "../../src/index.js";
import { CM, PROVIDER, at, builder, eventually, pattern } from "../support/api.js";

describe(`review: peer memory budget after a family ends [${PROVIDER}, ${CM}]`, { timeout: 120_000 }, () => {
  it("issue 19 point 14 (review): a received rendezvous message lent on a sibling when its connection ends does not keep the budget charged after the family closed", async () => {
    const base = peerMemoryUsage().used;
    const listener = await builder("server").bind(at(0));
    const [client, server] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
    const [c2, s2] = await Promise.all([client.newConnection(), listener.accept({ timeoutMs: 60_000 })]);
    try {
      const N = 300_000; // rendezvous: c2 READs it into memory charged to the budget
      const m = s2.allocLocalMr(N);
      m.bytes.set(pattern(N, 4));
      await s2.send(m);
      m.dispose();
      const r = await c2.receive(); // held by the user (not disposed)
      assert.ok(peerMemoryUsage().used >= base + N, "the received message is charged");
      // Lent to `server` on the sibling (same protection domain): in use when c2's connection ends.
      await client.sendLocalMr(r, { leaseMs: 60_000 });
      const lent = await server.receiveRemoteMr({ signal: AbortSignal.timeout(30_000) });
      await s2.close();
      await eventually(() => c2.isClosed, 60_000, "c2 saw the close");
      lent.dispose();
    } finally {
      await Promise.allSettled([client.close(), server.close(), c2.close(), s2.close()]);
      await listener.close();
    }
    // Every connection of the family ended; the user never disposed `r` (it may, or it may drop it).
    await eventually(() => peerMemoryUsage().used === base, 10_000, `peer memory back to its baseline ${base} (now ${peerMemoryUsage().used})`);
  });
});
