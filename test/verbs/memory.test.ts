/**
 * The MR pool on the provider under test (ASYNC_RDMA_PROVIDER): on verbs,
 * small allocations come from 1 MiB slabs registered once, each with an
 * alias ArrayBuffer of its own (MemoryRegion.aliasBuffer); on tcp, every
 * allocation is its own registration. Either way, disposing detaches exactly
 * the allocation's views, and on native memory lending detaches them too.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { isDetached } from "../../src/transport/buffers.js";
import { PROVIDER, withApiPair } from "../support/api.js";

const NATIVE = PROVIDER === "verbs";

test("allocLocalMr: slabs on native memory, one registration per allocation on tcp", async () => {
  await withApiPair(async ({ client }) => {
    const before = client.stats().pool.registrations;
    const lmrs = Array.from({ length: 100 }, (_, i) => client.allocLocalMr(64 + (i % 4) * 100));
    const after = client.stats().pool;
    if (NATIVE) {
      // Sizes 64..364 fall in three classes (64, 256, 1024 B): at most a small first slab and a 1 MiB one each.
      assert.ok(after.registrations - before <= 6, `100 small allocations cost ${after.registrations - before} registrations`);
      assert.ok(after.slabs >= 1);
    } else {
      assert.equal(after.registrations - before, 100);
    }
    for (const [i, l] of lmrs.entries()) {
      assert.ok(l.bytes.every((b) => b === 0), "zeroed");
      l.bytes.fill(i & 0xff);
    }
    for (const [i, l] of lmrs.entries()) assert.ok(l.bytes.every((b) => b === (i & 0xff)), `allocation ${i} kept its bytes (no overlap)`);
    for (const l of lmrs) l.dispose();
    assert.equal(client.stats().pool.liveAllocations, after.liveAllocations - 100);
  });
});

test("dispose detaches exactly the allocation's views; reuse is zeroed", async () => {
  await withApiPair(async ({ client }) => {
    const a = client.allocLocalMr(100);
    const b = client.allocLocalMr(100);
    const va = a.bytes;
    const vaSlice = a.slice(10, 20).bytes;
    const vf = a.view(Uint32Array);
    const vb = b.bytes;
    va.fill(7);
    vb.fill(9);
    a.dispose();
    assert.equal(va.length, 0, "a's byte view detached");
    assert.equal(vaSlice.length, 0, "a slice's view detached");
    assert.equal(vf.length, 0, "a's typed view detached");
    assert.ok(isDetached(va.buffer as ArrayBuffer));
    assert.equal(vb.length, 100, "b untouched");
    assert.ok(vb.every((x) => x === 9));
    assert.throws(() => a.bytes, { code: "INVALID_STATE" });
    // The freed chunk comes back zeroed.
    const c = client.allocLocalMr(100);
    assert.ok(c.bytes.every((x) => x === 0));
    b.dispose();
    c.dispose();
  });
});

test("large allocations (own registration) detach on dispose too", async () => {
  await withApiPair(async ({ client }) => {
    const before = client.stats().pool.registrations;
    const big = client.allocLocalMr(200_000);
    assert.equal(client.stats().pool.registrations - before, 1);
    const v = big.bytes;
    v[199_999] = 5;
    big.dispose();
    assert.equal(v.length, 0);
  });
});

test("lending detaches views taken before (native memory); the returned region has fresh ones", async () => {
  await withApiPair(async ({ client, server }) => {
    const lmr = client.allocLocalMr(64);
    const before = lmr.bytes;
    before.fill(3);
    const lent = client.sendLocalMr(lmr.slice(0, 32), { leaseMs: 60_000 });
    const rmr = await server.receiveRemoteMr();
    await lent;
    assert.throws(() => lmr.bytes, { code: "INVALID_STATE" });
    if (NATIVE) {
      assert.equal(before.length, 0, "a view from before lending cannot touch lent memory");
    } else {
      // A plain JS ArrayBuffer cannot be detached without losing its memory.
      assert.equal(before.length, 64);
    }
    // The peer writes through its remote access, then gives the region back.
    const src = server.allocLocalMr(32);
    src.bytes.fill(0xaa);
    await server.write(src, rmr);
    await server.sendRemoteMr(rmr);
    const back = await client.receiveLocalMr();
    const now = back.bytes;
    assert.equal(now.length, 32);
    assert.ok(now.every((x) => x === 0xaa), "the peer's write is visible through the fresh view");
    assert.ok(lmr.bytes.subarray(32).every((x) => x === 3), "bytes outside the lent range kept");
    if (NATIVE) assert.equal(before.length, 0, "the old view stays dead");
    lmr.dispose();
    assert.equal(now.length, 0, "dispose after the return detaches the fresh view");
    src.dispose();
  });
});
