/**
 * Review of the orderly revoke (issue 19 point 16): the opener acknowledges
 * MR_REVOKED with MR_RELEASE, and the owner deregisters on that answer. The
 * claim (shares.ts, docs/memory.md): every operation the opener posted on
 * the region before the acknowledgement has executed, so an operation right
 * after revoke "lands or fails locally with REMOTE_ACCESS and the opener's
 * connection lives". The acknowledgement is a control message; operations the
 * user issued before it may still wait in the data lane (credits), and the
 * control lane overtakes them.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { CM, PROVIDER, apiPair, eventually } from "../support/api.js";

describe(`review: orderly revoke under credit pressure [${PROVIDER}, ${CM}]`, { timeout: 120_000 }, () => {
  it("issue 19 point 16 (review): a write issued before the revoke, queued behind sends waiting for credits, does not kill the opener's connection", async () => {
    const p = await apiPair({ server: (b) => b.setRecvDepth(8) });
    try {
      const { client, server } = p;
      using region = server.allocLocalMr(64);
      const shared = server.share("review-revoke", region, { access: "write" });
      const rmr = await client.openSharedMr("review-revoke", { timeoutMs: 30_000 });
      // The server does not read: the client runs out of credits and its sends wait in its queue.
      const N = 24;
      using m = client.allocLocalMr(8);
      const sends = Array.from({ length: N }, () => client.send(m).then(() => "sent", (e: unknown) => e));
      let sent = 0;
      for (const s of sends) void s.then((v) => v === "sent" && sent++);
      await eventually(() => sent >= 8 && client.stats().sqOutstanding === 0, 30_000, "the client's sends to stop for credits");
      assert.ok(sent < N, `the client's sends wait for credits (${sent} of ${N} sent)`);
      // Issued before the revoke: a write on the shared region (it waits behind the sends).
      using w = client.allocLocalMr(64);
      w.bytes.fill(0x11);
      const write = client.write(w, rmr).then(() => "landed", (e: unknown) => e);
      // The owner revokes in order: the opener is told, answers, the registration goes.
      await shared.revoke();
      // The server reads now; the client's queue drains.
      for (let i = 0; i < N; i++) {
        try {
          (await server.receive({ signal: AbortSignal.timeout(30_000) })).dispose();
        } catch {
          break;
        }
      }
      const outcome = await write;
      // The write either landed before the registration went, or fails with REMOTE_ACCESS; either
      // way the opener's connection lives (docs/memory.md: "its connection lives on").
      assert.ok(outcome === "landed" || (outcome instanceof RdmaError && outcome.code === "REMOTE_ACCESS"), `write: ${String(outcome)}`);
      assert.equal(client.isClosed, false, `the opener's connection lives (write outcome: ${outcome instanceof Error ? outcome.message : String(outcome)})`);
      await Promise.all(sends);
      await client.send(m);
      (await server.receive({ signal: AbortSignal.timeout(30_000) })).dispose();
    } finally {
      await p.close();
    }
  });
});
