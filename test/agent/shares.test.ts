/**
 * The orderly revoke rule of shares.ts (issue 19 point 16), on a scripted
 * opener: revoke() tells every opener and keeps each registration until that
 * opener acknowledges (close) or the bounded wait ends; revokeNow()
 * deregisters first; new opens fail as soon as a revoke starts.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { Context } from "../../src/api/context.js";
import { LocalMemory, LocalMr } from "../../src/memory/mr.js";
import { ShareTable, type Share, type ShareOpener } from "../../src/agent/shares.js";

function scripted(): { o: ShareOpener; told: number[]; dropped: number[] } {
  const told: number[] = [];
  const dropped: number[] = [];
  return { told, dropped, o: { revoked: (_s, id) => void told.push(id), dropped: (_s, id) => void dropped.push(id) } };
}

describe("orderly revoke (agent/shares.ts)", () => {
  it("keeps a registration until its opener acknowledges, then resolves", async () => {
    const ctx = await Context.open("tcp", undefined);
    try {
      const table = new ShareTable(null);
      const lmr = new LocalMr(new LocalMemory(ctx.pool, ctx.pool.alloc(64)), 0, 64);
      const share = table.add("x", lmr, "read", null);
      const a = scripted();
      const mr = share.open(ctx.pool, a.o, 7);
      let resolved = false;
      const p = share.revoke(60_000).then(() => (resolved = true));
      assert.deepEqual(a.told, [7], "the opener is told first");
      assert.equal(mr.deregistered, false, "the registration stays until the opener answers");
      assert.throws(() => share.open(ctx.pool, scripted().o, 8), (e: unknown) => e instanceof RdmaError && e.code === "NOT_FOUND");
      await Promise.resolve();
      assert.equal(resolved, false);
      share.close(ctx.pool.pd, a.o, 7); // the acknowledgement
      assert.equal(mr.deregistered, true);
      await p;
      assert.deepEqual(a.dropped, [], "an acknowledged open is closed, not dropped");
      assert.equal(lmr.mem.beforeFree.size, 0);
    } finally {
      ctx.release();
    }
  });

  it("deregisters after the bounded wait when an opener never answers, and drops its open", async () => {
    const ctx = await Context.open("tcp", undefined);
    try {
      const table = new ShareTable(null);
      const lmr = new LocalMr(new LocalMemory(ctx.pool, ctx.pool.alloc(64)), 0, 64);
      const share = table.add("x", lmr, "read", null);
      const a = scripted();
      const mr = share.open(ctx.pool, a.o, 1);
      await share.revoke(50);
      assert.equal(mr.deregistered, true);
      assert.deepEqual(a.told, [1], "told once, not again at the deadline");
      assert.deepEqual(a.dropped, [1]);
    } finally {
      ctx.release();
    }
  });

  it("revokeNow (memory freed, owner closing) deregisters before telling", async () => {
    const ctx = await Context.open("tcp", undefined);
    try {
      const table = new ShareTable(null);
      const lmr = new LocalMr(new LocalMemory(ctx.pool, ctx.pool.alloc(64)), 0, 64);
      const share = table.add("x", lmr, "read", null);
      let seenDeregistered: boolean | null = null;
      const mr = share.open(ctx.pool, { revoked: () => void (seenDeregistered = mr.deregistered), dropped: () => {} }, 3);
      lmr.dispose();
      assert.equal(seenDeregistered, true);
      assert.equal(share.revoked, true);
    } finally {
      ctx.release();
    }
  });
});
