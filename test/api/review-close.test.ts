/**
 * Review of the delivery-across-close change (issue 19 points 14 and 5-10's
 * "what a peer can make us hold"): what a connection keeps for its user after
 * the peer closed.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, peerMemoryUsage, setPeerMemoryLimit, type Rdma } from "../../src/index.js";
import { CM, PROVIDER, apiPair, at, builder, eventually, pattern } from "../support/api.js";

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

describe(`review: kept across close [${PROVIDER}, ${CM}]`, { timeout: 300_000 }, () => {
  it("issue 19 point 14 (review): immediates of WRITE_WITH_IMMs that completed before the peer closed stay receivable", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      const rmr = await client.requestRemoteMr(64, { timeoutMs: 30_000 });
      using lmr = client.allocLocalMr(64);
      lmr.bytes.set(pattern(64, 3));
      // Both resolved: the data and the immediates reached the server.
      await client.writeWithImm(lmr, rmr, 7);
      await client.writeWithImm(lmr, rmr, 8);
      await client.close();
      await eventually(() => server.isClosed, 60_000, "the server saw the close");
      // "messages and immediates received and not yet read" (limits.md) arrived before the close:
      // like the messages, they stay receivable, then CONNECTION_CLOSED.
      assert.equal(await server.receiveWriteImm(), 7);
      assert.equal(await server.receiveWriteImm(), 8);
      await assert.rejects(server.receiveWriteImm(), code("CONNECTION_CLOSED"));
    } finally {
      await p.close();
    }
  });

  it("issue 19 point 14 (review): unread rendezvous messages kept past the peer's close stay within the process-wide peer memory limit", async () => {
    const MIB = 1 << 20;
    const before = peerMemoryUsage();
    const LIMIT = before.used + 4 * MIB;
    setPeerMemoryLimit(LIMIT);
    const listener = await builder("server").bind(at(0));
    const servers: Rdma[] = [];
    let delivered = 0;
    try {
      // A peer connects, sends 3 MiB the server does not read yet (each send resolves once the server
      // holds the message), closes, and comes back. The server's application is slow: it has not
      // read nor closed these connections yet.
      for (let round = 0; round < 4; round++) {
        const [c, s] = await Promise.all([builder("client").setRendezvousTimeout(5_000).connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
        servers.push(s);
        const msgs = [0, 1, 2].map(() => {
          const m = c.allocLocalMr(MIB);
          m.bytes.fill(round + 1);
          return m;
        });
        const sent = await Promise.allSettled(msgs.map((m) => c.send(m)));
        delivered += sent.filter((r) => r.status === "fulfilled").length;
        await c.close();
        await eventually(() => s.isClosed, 60_000, "the server saw the close");
      }
      const held = servers.reduce((n, s) => n + s.stats().unread, 0);
      assert.equal(held, delivered, "every delivered message is kept for the server's application");
      // limits.md: rendezvous receive buffers of all connections together are bounded by
      // setPeerMemoryLimit. The bytes the peer made this process hold must stay under it.
      assert.ok(held * MIB <= LIMIT - before.used, `the peer made this process hold ${held} MiB of unread messages with a peer memory limit of ${(LIMIT - before.used) / MIB} MiB`);
    } finally {
      await Promise.allSettled(servers.map((s) => s.close()));
      await listener.close();
      setPeerMemoryLimit(before.limit);
    }
    assert.equal(peerMemoryUsage().used, before.used, "the budget is back to its baseline");
  });
  it("issue 19 point 14 (review): a received message stays readable after its connection ends; views taken before are detached, as documented", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      using m = client.allocLocalMr(32);
      m.bytes.set(pattern(32, 11));
      await client.send(m);
      const r = await server.receive();
      const view = r.bytes;
      assert.deepEqual([...view], [...pattern(32, 11)]);
      await client.close();
      await eventually(() => server.isClosed, 60_000, "the server saw the close");
      // concepts.md: the bytes move out of the registered memory that went with the connection;
      // a view taken before reads as empty, `bytes` again reads the message.
      assert.equal(view.length, 0, "a view taken before the end is detached, never left over freed memory");
      assert.deepEqual([...r.bytes], [...pattern(32, 11)], "the LocalMr reads the message");
      r.dispose();
    } finally {
      await p.close();
    }
  });
});
