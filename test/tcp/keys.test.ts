/**
 * Issue 9, points 11 and 1 (tcp keys): lkeys/rkeys are crypto-random (not
 * guessable from one another), never 0, and never collide with a live key —
 * memory windows included, whose low byte changes on every bind while their
 * 24-bit index stays reserved. Churn never overwrites a live key's entry.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { Access, type MemoryRegion } from "../../src/transport/types.js";
import { tcpProvider, type TcpDevice } from "../../src/transport/tcp/index.js";
import { KeySpace } from "../../src/transport/tcp/keys.js";
import type { TcpMw } from "../../src/transport/tcp/device.js";

async function open(): Promise<TcpDevice> {
  return (await tcpProvider.openDevice("tcp-keys", { host: "127.0.0.1" })) as TcpDevice;
}

describe("tcp keys [issue 9 #11, #1]", () => {
  it("churn: 60 000 registrations, half kept live: no collision, no key 0, live entries never overwritten, keys not sequential", async () => {
    const dev = await open();
    try {
      const pd = dev.allocPd();
      const live: MemoryRegion[] = [];
      const order: number[] = [];
      for (let round = 0; round < 3; round++) {
        const batch: MemoryRegion[] = [];
        for (let i = 0; i < 20_000; i++) {
          const mr = pd.registerMr(1, Access.LOCAL_WRITE | Access.REMOTE_READ);
          batch.push(mr);
          order.push(mr.rkey);
        }
        // Keep every other one; the rest goes away (its index becomes free again).
        for (let i = 0; i < batch.length; i++) {
          if (i % 2 === 0) live.push(batch[i]!);
          else batch[i]!.deregister();
        }
        const seen = new Set<number>();
        for (const mr of live) {
          assert.notEqual(mr.rkey, 0, "no key is 0");
          assert.equal(mr.lkey, mr.rkey);
          assert.ok(!seen.has(mr.rkey >>> 8), `two live MRs share key index 0x${(mr.rkey >>> 8).toString(16)}`);
          seen.add(mr.rkey >>> 8);
          assert.equal(dev.keys.get(mr.rkey), mr, `live key 0x${mr.rkey.toString(16)} still names its own MR`);
        }
        assert.equal(dev.keySpace.size, live.length, "exactly the live MRs hold an index");
      }
      // Not sequential: consecutive registrations whose indices differ by a small step are as rare as chance makes them.
      let near = 0;
      for (let i = 1; i < order.length; i++) if (Math.abs((order[i]! >>> 8) - (order[i - 1]! >>> 8)) <= 16) near++;
      assert.ok(near < order.length / 1000, `${near} of ${order.length} consecutive keys are within 16 indices of the previous one`);
      // Neither part of the key is predictable: both the index and the low byte spread over their range.
      const lowBytes = new Set(order.map((k) => k & 0xff));
      assert.equal(lowBytes.size, 256, "every low byte occurs");
      const topNibbles = new Set(order.map((k) => k >>> 28));
      assert.equal(topNibbles.size, 16, "indices spread over the whole 24-bit space");
      for (const mr of live) mr.deregister();
      assert.equal(dev.keySpace.size, 0);
      assert.equal(dev.keys.size, 0);
    } finally {
      dev.close();
    }
  });

  it("a memory window's index stays reserved: no MR ever gets a key with it, whatever the low byte", async () => {
    const dev = await open();
    try {
      const pd = dev.allocPd();
      const mws = Array.from({ length: 64 }, () => pd.allocMw(2) as TcpMw);
      const reserved = new Set(mws.map((w) => w.nextRkey() >>> 8));
      assert.equal(reserved.size, mws.length, "windows have distinct indices");
      for (const w of mws) assert.equal(w.rkey, 0, "an unbound window has rkey 0");
      for (let i = 0; i < 20_000; i++) {
        const mr = pd.registerMr(1, Access.LOCAL_WRITE);
        assert.ok(!reserved.has(mr.rkey >>> 8), `MR key 0x${mr.rkey.toString(16)} uses a window's index`);
        mr.deregister();
      }
      for (const w of mws) w.dealloc();
      assert.equal(dev.keySpace.size, 0, "deallocating a window frees its index");
    } finally {
      dev.close();
    }
  });

  it("the allocator draws again when the random index is live (scripted random source), and never returns 0", () => {
    // Draws: index 5 (low 0x11), index 5 again (live: skipped), index 0 (never used: skipped), index 7.
    const draws = [(5 << 8) | 0x11, (5 << 8) | 0x22, 0x000000aa, (7 << 8) | 0x33];
    const ks = new KeySpace(4, () => draws.shift() ?? assert.fail("ran out of scripted draws"));
    assert.equal(ks.alloc(), (5 << 8) | 0x11);
    assert.equal(ks.alloc(), (7 << 8) | 0x33, "a live index and index 0 were drawn again");
    assert.ok(ks.has((5 << 8) | 0xff), "the index is reserved whatever the low byte");
    ks.release((5 << 8) | 0x99);
    assert.ok(!ks.has((5 << 8) | 0x11));
    // Full: RESOURCE_EXHAUSTED rather than an endless search or a collision.
    const full = new KeySpace(1, () => (9 << 8) | 1);
    full.alloc();
    assert.throws(() => full.alloc(), (e: Error & { code?: string }) => e.code === "RESOURCE_EXHAUSTED");
  });

  it("maxMr is enforced per device (RESOURCE_EXHAUSTED, as verbs answers ENOMEM), and freeing one makes room", async () => {
    const dev = await open();
    try {
      const pd = dev.allocPd();
      // Pretend most of the budget is used, so the test stays fast.
      dev.liveMrs = dev.attr.maxMr - 1;
      const last = pd.registerMr(1, Access.LOCAL_WRITE);
      assert.throws(() => pd.registerMr(1, Access.LOCAL_WRITE), (e: Error & { code?: string }) => e.code === "RESOURCE_EXHAUSTED");
      last.deregister();
      pd.registerMr(1, Access.LOCAL_WRITE).deregister();
      dev.liveMrs = 0;
    } finally {
      dev.close();
    }
  });
});
