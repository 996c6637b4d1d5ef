/**
 * A peer that speaks the control protocol and lies, floods or stalls: each
 * case names the point of issue 9 it proves. The hostile side is our own
 * agent driven below the API (`conn.sendCtrl`), so the same file runs on tcp
 * and on verbs.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { getEventListeners } from "node:events";
import { RdmaError, peerMemoryUsage, setPeerMemoryLimit } from "../../src/index.js";
import { MsgType } from "../../src/agent/codec.js";
import { Access } from "../../src/transport/types.js";

const ALL_REMOTE = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC;
import { MAX_UNCLAIMED_LENDS } from "../../src/agent/memory-protocol.js";
import { CM, PROVIDER, eventually, withApiPair } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const code = (c: string) => (e: unknown) => {
  assert.ok(e instanceof RdmaError, `not an RdmaError: ${String(e)}`);
  assert.equal(e.code, c, e.message);
  return true;
};

// A hang is a failure, not a stuck suite.
describe(`hostile peer, agent level [${PROVIDER}, ${CM}]`, { timeout: 120_000 * SLOW }, () => {
  it("#2 grant ids are the owner's: a repeated request token is refused, and every grant is freed when the connection ends", async () => {
    const before = peerMemoryUsage().used;
    await withApiPair(async ({ client, server }) => {
      const a = await client.requestRemoteMr(4096);
      // Forge a second MR_REQUEST with the token of the live grant (the first request used token 1).
      client.conn.sendCtrl({ type: MsgType.MR_REQUEST, token: 1, size: 4096, leaseMs: 1000, access: ALL_REMOTE });
      await assert.rejects(server.receive(), (e) => code("PROTOCOL")(e) && /reuses the token/.test((e as Error).message));
      await eventually(() => server.isClosed, 10_000 * SLOW, "the server side to tear down");
      assert.equal(server.stats().grants, 0);
      assert.equal(server.stats().quotaUsed, 0);
      assert.equal(peerMemoryUsage().used, before, "process-wide peer memory back");
      void a;
    });
  });

  it("#2 a grant the requester no longer waits for is released at once (no orphan)", () =>
    withApiPair(async ({ client, server }) => {
      // The request is aborted after its MR_REQUEST is queued: the owner still grants it, and the
      // requester, which no longer waits, must hand the grant straight back.
      const ac = new AbortController();
      const gone = client.requestRemoteMr(8, { signal: ac.signal });
      ac.abort();
      await assert.rejects(gone, code("ABORTED"));
      // RC order: once this later grant is here, the first grant reached the client before it, and
      // its release left before anything this side sends next.
      const kept = await client.requestRemoteMr(8);
      await eventually(() => server.stats().grants === 1, 10_000 * SLOW, "the orphan grant to be released");
      using lmr = client.allocLocalMr(8);
      await client.write(lmr, kept);
      assert.equal(server.stats().grants, 1, "only the grant the client holds");
      kept.dispose();
      await eventually(() => server.stats().grants === 0, 10_000 * SLOW, "the release");
    }));

  it("#3 lending: the borrower's lease always ends before the owner revokes (writes until the deadline: done or LEASE_EXPIRED, never REMOTE_ACCESS)", () =>
    withApiPair(async ({ client, server }) => {
      using lmr = client.allocLocalMr(64);
      const lent = client.sendLocalMr(lmr.slice(0, 64), { leaseMs: 200 * SLOW });
      const rmr = await server.receiveRemoteMr();
      await lent;
      using src = server.allocLocalMr(64);
      let done = 0;
      for (;;) {
        try {
          await server.write(src, rmr);
          done++;
        } catch (e) {
          assert.ok(e instanceof RdmaError && e.code === "LEASE_EXPIRED", `${String(e)}`);
          break;
        }
      }
      assert.ok(done > 0);
      // the connection is healthy, and the owner gets its memory back after the grace
      await eventually(() => client.stats().lends === 0, 10_000 * SLOW, "the owner to revoke");
      using m = server.allocLocalMr(4);
      await server.send(m);
      using got = await client.receive();
      assert.equal(got.length, 4);
    }));

  it("#6 a closed connection frees unread eager and rendezvous messages and regions handed back but never picked up", async () => {
    const before = peerMemoryUsage().used;
    let liveAtClose = -1;
    await withApiPair(async ({ client, server }) => {
      // What the pool still holds when the connection releases it (close() would force-free it).
      const pool = server.ctx.pool;
      const close = pool.close.bind(pool);
      pool.close = () => {
        liveAtClose = pool.stats().liveAllocations;
        close();
      };
      using small = client.allocLocalMr(100);
      using big = client.allocLocalMr(256 * 1024);
      for (let i = 0; i < 10; i++) await client.send(small);
      for (let i = 0; i < 3; i++) await client.send(big);
      const g = await client.requestRemoteMr(1 << 20);
      await client.sendRemoteMr(g); // handed back, never picked up by the server
      await eventually(() => server.stats().unclaimedLocal === 1, 5000 * SLOW, "the region to come back");
      assert.ok(server.stats().unread >= 13);
      assert.ok(peerMemoryUsage().used >= before + 3 * 256 * 1024);
      await server.close();
    });
    assert.equal(liveAtClose, 0, "the connection freed everything it held before its pool closed");
    assert.equal(peerMemoryUsage().used, before);
  });

  it("#7 unread immediates throttle the writer instead of queueing without bound", () =>
    withApiPair(async ({ client, server }) => {
      const rmr = await client.requestRemoteMr(8);
      using lmr = client.allocLocalMr(8);
      const n = 200;
      const writes = Array.from({ length: n }, (_, i) => client.writeWithImm(lmr, rmr, i));
      await eventually(() => server.stats().unread >= 16, 10_000 * SLOW, "immediates to pile up");
      // The writer ran out of credits: far fewer than n are held here.
      assert.ok(server.stats().unread <= 32, `unread ${server.stats().unread}`);
      for (let i = 0; i < n; i++) assert.equal(await server.receiveWriteImm(), i);
      await Promise.all(writes);
    }));

  it(`#7 lent regions never taken: past ${MAX_UNCLAIMED_LENDS} the peer is in breach (PROTOCOL), nothing grows`, () =>
    withApiPair(async ({ client, server }) => {
      // Forged MR_LENDs (no registration behind them): they only cost the receiver its queue.
      for (let i = 0; i <= MAX_UNCLAIMED_LENDS; i++) client.conn.sendCtrl({ type: MsgType.MR_LEND, token: i + 1, size: 8, leaseMs: 60_000, addr: 0x1000, rkey: 1, access: Access.REMOTE_READ });
      await assert.rejects(server.receive(), (e) => code("PROTOCOL")(e) && /not taken with receiveRemoteMr/.test((e as Error).message));
      assert.ok(server.stats().unclaimedRemote <= MAX_UNCLAIMED_LENDS);
    }));

  it("#8 regions are capped per connection, and bytes per process", () =>
    withApiPair(
      async ({ client, server }) => {
        const held = [];
        for (let i = 0; i < 4; i++) held.push(await client.requestRemoteMr(1));
        await assert.rejects(client.requestRemoteMr(1), code("QUOTA_EXCEEDED"));
        held.pop()!.dispose();
        await eventually(() => server.stats().grants === 3, 5000 * SLOW, "the release");
        const limit = peerMemoryUsage().limit;
        setPeerMemoryLimit(peerMemoryUsage().used);
        try {
          await assert.rejects(client.requestRemoteMr(1), code("QUOTA_EXCEEDED"));
        } finally {
          setPeerMemoryLimit(limit);
        }
        held.push(await client.requestRemoteMr(1));
        for (const h of held) h.dispose();
      },
      { server: (b) => b.setMaxRemoteRegions(4) },
    ));

  it("#12 a rendezvous the peer never takes ends at its deadline (TIMEOUT), is never delivered, and the connection keeps working", () =>
    withApiPair(
      async ({ client, server }) => {
        const limit = peerMemoryUsage().limit;
        setPeerMemoryLimit(peerMemoryUsage().used); // the receiver cannot take the message
        using big = client.allocLocalMr(64 * 1024);
        big.bytes.fill(7);
        try {
          await assert.rejects(client.send(big), code("TIMEOUT"));
          // an abort takes the same path
          const ac = new AbortController();
          const p = client.send(big, { signal: ac.signal });
          await eventually(() => server.stats().unread === 1, 5000 * SLOW, "the announcement");
          ac.abort();
          await assert.rejects(p, code("ABORTED"));
          assert.equal(server.stats().unread, 0, "dropped, never delivered");
        } finally {
          setPeerMemoryLimit(limit);
        }
        using small = client.allocLocalMr(4);
        small.bytes.fill(3);
        await client.send(small);
        await client.send(big);
        using a = await server.receive();
        assert.deepEqual([...a.bytes], [3, 3, 3, 3], "the cancelled messages never arrived");
        using b = await server.receive();
        assert.equal(b.length, 64 * 1024);
        assert.equal(client.stats().rendezvousOut, 0);
      },
      { client: (b) => b.setRendezvousTimeout(300 * SLOW) },
    ));

  it("#12 a peer that ignores the cancel fails the connection within the peer timeout: nothing stays lent", () =>
    withApiPair(
      async ({ client, server }) => {
        const limit = peerMemoryUsage().limit;
        setPeerMemoryLimit(peerMemoryUsage().used);
        (server.conn as unknown as { rndv: { onCancel: () => void } }).rndv.onCancel = () => {};
        try {
          using big = client.allocLocalMr(64 * 1024);
          await assert.rejects(client.send(big), code("RETRY_EXCEEDED"));
          assert.equal(client.stats().rendezvousOut, 0);
        } finally {
          setPeerMemoryLimit(limit);
        }
      },
      { client: (b) => b.setRendezvousTimeout(100 * SLOW).setPeerTimeout(500 * SLOW) },
    ));

  it("#15 a pre-aborted operation never reaches the wire", () =>
    withApiPair(async ({ client }) => {
      const rmr = await client.requestRemoteMr(8);
      using lmr = client.allocLocalMr(8);
      lmr.bytes.fill(0xff);
      const aborted = AbortSignal.abort();
      await assert.rejects(client.write(lmr, rmr, { signal: aborted }), code("ABORTED"));
      await assert.rejects(client.writeWithImm(lmr, rmr, 1, { signal: aborted }), code("ABORTED"));
      await assert.rejects(client.fetchAndAdd(rmr, 1n, { signal: aborted }), code("ABORTED"));
      await assert.rejects(client.send(lmr, { signal: aborted }), code("ABORTED"));
      await assert.rejects(client.sendLocalMr(lmr, { signal: aborted }), code("ABORTED"));
      using back = client.allocLocalMr(8);
      await client.read(back, rmr);
      assert.deepEqual([...back.bytes], new Array(8).fill(0), "the aborted write did not land");
      assert.equal(client.stats().lends, 0);
    }));

  it("#15 an operation aborted while it waits for credits never reaches the wire; a posted one is reported done", { timeout: 60_000 * SLOW }, () =>
    withApiPair(async ({ client, server }) => {
      using lmr = client.allocLocalMr(16);
      const ac = new AbortController();
      const sends = Array.from({ length: 100 }, () => client.send(lmr, { signal: ac.signal }));
      await eventually(() => server.stats().unread >= 16, 10_000 * SLOW, "messages to pile up");
      ac.abort();
      const results = await Promise.allSettled(sends);
      const done = results.filter((r) => r.status === "fulfilled").length;
      for (const r of results) if (r.status === "rejected") code("ABORTED")(r.reason);
      assert.ok(done < 100, "some were still queued");
      using marker = client.allocLocalMr(3);
      // Not awaited before reading: when the sends that got through filled the receiver's whole
      // window (it holds that many unread), the marker waits for credits that only these reads return.
      const markerSent = client.send(marker);
      for (let i = 0; i < done; i++) (await server.receive()).dispose();
      using last = await server.receive();
      await markerSent;
      assert.equal(last.length, 3, "exactly the sends reported done arrived");
      assert.equal(getEventListeners(ac.signal, "abort").length, 0, "no listener outlives its operation");
    }));

  it("credits: a reader that falls behind and catches up never strands the writer (credits return when the writer is starved)", () =>
    withApiPair(async ({ client, server }) => {
      for (const n of [45, 60, 61, 77]) {
        using lmr = client.allocLocalMr(16);
        const sends = Array.from({ length: n }, () => client.send(lmr));
        await eventually(() => server.stats().unread >= 16, 10_000 * SLOW, "messages to pile up");
        for (let i = 0; i < n; i++) (await server.receive({ signal: AbortSignal.timeout(20_000 * SLOW) })).dispose();
        await Promise.all(sends);
      }
    }));

  it("#15 no abort listener outlives its operation (eager, rendezvous, one-sided, and ops failed by the connection)", () =>
    withApiPair(async ({ client, server }) => {
      const signal = new AbortController().signal;
      using small = client.allocLocalMr(8);
      using big = client.allocLocalMr(64 * 1024);
      const rmr = await client.requestRemoteMr(8);
      for (let i = 0; i < 20; i++) {
        await client.send(small, { signal });
        await client.send(big, { signal });
        await client.write(small, rmr, { signal });
        (await server.receive()).dispose();
        (await server.receive()).dispose();
      }
      assert.equal(getEventListeners(signal, "abort").length, 0);
      const pending = assert.rejects(client.receive({ signal }), code("CONNECTION_CLOSED"));
      await server.close();
      await pending;
      await assert.rejects(client.send(small, { signal }), (e: unknown) => e instanceof RdmaError);
      assert.equal(getEventListeners(signal, "abort").length, 0);
    }));

  it("#16 a RemoteMr of another connection is refused locally, and kills neither connection", () =>
    withApiPair(async ({ client, server }) => {
      const rmr = await client.requestRemoteMr(8);
      using lmr = server.allocLocalMr(8);
      const lent = server.sendLocalMr(lmr);
      const back = await client.receiveRemoteMr();
      await lent;
      using mine = server.allocLocalMr(8);
      // the server uses the client's grant (a region of its own memory, granted to the client)
      await assert.rejects(server.write(mine, rmr), code("INVALID_ARGUMENT"));
      await assert.rejects(server.read(mine, back), code("INVALID_ARGUMENT"));
      await client.write(client.allocLocalMr(8), rmr);
      back.dispose();
    }));

  it("#18 a stopped peer (keepalive PING unanswered) fails pending waits within the peer timeout", () =>
    withApiPair(
      async ({ client, server }) => {
        // Stop the client's agent from answering (as SIGSTOP would; the device may still ACK).
        (client.conn as unknown as { arrivals: { onControl: (m: unknown) => void } }).arrivals.onControl = () => {};
        (client.conn as unknown as { live: { stop: () => void } }).live.stop();
        await assert.rejects(server.receive(), code("RETRY_EXCEEDED"));
      },
      { server: (b) => b.setKeepalive(50).setPeerTimeout(500 * SLOW) },
    ));
});
