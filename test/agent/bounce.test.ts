/**
 * The rules of agent/bounce.ts, one test per rule: each fails when its rule
 * is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { Context } from "../../src/api/context.js";
import { BOUNCE_SLOT, BOUNCE_SLOTS, Bounce } from "../../src/agent/bounce.js";
import type { MrPool } from "../../src/memory/pool.js";

const EAGER = 4096;

async function withPool(fn: (pool: MrPool) => void): Promise<void> {
  const ctx = await Context.open("tcp", undefined);
  try {
    fn(ctx.pool);
  } finally {
    ctx.release();
  }
}

describe("bounce memory (agent/bounce.ts)", () => {
  it("only mid-size messages take a slot: above the eager threshold, up to BOUNCE_SLOT", () =>
    withPool((pool) => {
      const b = new Bounce(pool);
      assert.equal(b.take(EAGER, EAGER), -1, "eager size");
      assert.equal(b.take(BOUNCE_SLOT + 1, EAGER), -1, "lent, not copied");
      assert.ok(b.take(EAGER + 1, EAGER) >= 0);
      assert.ok(b.take(BOUNCE_SLOT, EAGER) >= 0);
      b.release();
    }));

  it("BOUNCE_SLOTS slots, each once, with distinct addresses under one registration for remote READ; a slot put back is reused", () =>
    withPool((pool) => {
      const b = new Bounce(pool);
      const slots = Array.from({ length: BOUNCE_SLOTS }, () => b.take(8192, EAGER));
      assert.equal(new Set(slots).size, BOUNCE_SLOTS);
      assert.ok(slots.every((s) => s >= 0));
      assert.equal(b.take(8192, EAGER), -1, "all slots in use: the message is lent instead");
      assert.equal(new Set(slots.map((s) => b.addr(s))).size, BOUNCE_SLOTS);
      assert.equal(b.mr.length, BOUNCE_SLOT * BOUNCE_SLOTS);
      b.put(slots[3]!, false);
      assert.equal(b.take(8192, EAGER), slots[3]);
      b.release();
      assert.equal(b.mr.deregistered, true, "teardown deregisters: a late READ fails");
    }));

  it("a slot whose message the peer did not take is wiped before reuse; one it took is not touched", () =>
    withPool((pool) => {
      const b = new Bounce(pool);
      const s = b.take(8192, EAGER);
      b.copyIn(s, new Uint8Array(8192).fill(0xab));
      const view = (): Uint8Array => new Uint8Array(b.mr.buffer, b.mr.offset + s * BOUNCE_SLOT, 8192);
      b.put(s, false);
      assert.ok(view().every((x) => x === 0xab), "taken: left as it is");
      assert.equal(b.take(8192, EAGER), s);
      b.put(s, true);
      assert.ok(view().every((x) => x === 0), "not taken: zeroed");
      b.release();
    }));

  it("without memory for it, the connection registers per message from then on", () =>
    withPool((pool) => {
      const failing = Object.create(pool) as MrPool;
      failing.alloc = () => {
        throw new Error("no memory");
      };
      const b = new Bounce(failing);
      assert.equal(b.take(8192, EAGER), -1);
      assert.equal(b.take(8192, EAGER), -1, "no second attempt");
      b.release();
    }));
});
