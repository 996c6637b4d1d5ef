/**
 * Review of the delivery-across-close change (issue 19 point 14): received
 * memory the user holds is moved out of the pool (LocalMemory.migrate) when
 * the connection it arrived on ends. The pool is the family's (newConnection()
 * siblings share it), so the move happens while the memory is still usable
 * elsewhere: on a sibling, and through a share of the family's table.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { type Rdma, type RdmaListener } from "../../src/index.js";
import { CM, PROVIDER, at, builder, eventually, pattern } from "../support/api.js";

describe(`review: received memory of a closed sibling [${PROVIDER}, ${CM}]`, { timeout: 120_000 }, () => {
  let listener: RdmaListener;
  let client: Rdma;
  let server: Rdma;

  before(async () => {
    listener = await builder("server").bind(at(0));
    [client, server] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
  });

  after(async () => {
    await Promise.allSettled([client.close(), server.close()]);
    await listener.close();
  });

  it("issue 19 point 14 (review): a message received on a sibling that closed stays usable on the family, like allocated memory", async () => {
    const [c2, s2] = await Promise.all([client.newConnection(), listener.accept({ timeoutMs: 60_000 })]);
    using m = s2.allocLocalMr(16);
    m.bytes.set(pattern(16, 5));
    await s2.send(m);
    const r = await c2.receive();
    // The sibling ends (here: its peer closes); the family, and its pool, live on.
    await s2.close();
    await eventually(() => c2.isClosed, 60_000, "c2 saw the close");
    // Memory allocated on c2 would still be usable on `client` (misuse.test.ts); received memory was
    // documented the same way ("memory allocated, registered or received on this connection or a
    // newConnection() sibling"): forwarding it must work.
    await client.send(r);
    using got = await server.receive();
    assert.deepEqual([...got.bytes], [...pattern(16, 5)]);
    r.dispose();
    await c2.close();
  });

  it("issue 19 point 14 (review): a received message shared on the family keeps one set of bytes after its connection ends", async () => {
    const [c2, s2] = await Promise.all([client.newConnection(), listener.accept({ timeoutMs: 60_000 })]);
    using m = s2.allocLocalMr(64);
    m.bytes.set(pattern(64, 7));
    await s2.send(m);
    const r = await c2.receive();
    // Shared on the family's table (c2 and `client` share it); `server` (the peer of `client`) opens it.
    const shared = client.share("review-received", r, { access: "write" });
    try {
      const rmr = await server.openSharedMr("review-received", { timeoutMs: 30_000 });
      // c2's connection ends; the share (on the family's table) stays.
      await s2.close();
      await eventually(() => c2.isClosed, 60_000, "c2 saw the close");
      assert.equal(shared.revoked, false, "the share lives on with the family");
      // The opener writes; the owner must see what it wrote in its LocalMr.
      using w = server.allocLocalMr(64);
      w.bytes.set(pattern(64, 99));
      await server.write(w, rmr);
      assert.deepEqual([...r.bytes], [...pattern(64, 99)], "the owner sees what the opener wrote into the shared region");
      // ... and the owner's writes must be what the opener reads.
      r.bytes.fill(0x5a);
      using back = server.allocLocalMr(64);
      await server.read(back, rmr);
      assert.deepEqual([...back.bytes], new Array(64).fill(0x5a), "the opener reads the owner's bytes (not memory the owner no longer has)");
      rmr.dispose();
    } finally {
      await shared.revoke({ timeoutMs: 0 });
      await c2.close();
    }
  });
});
