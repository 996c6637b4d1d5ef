/**
 * The async-rdma API on the provider under test: every data operation,
 * ownership, leases, quota, abort, close, concurrency.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, RemoteMr } from "../../src/index.js";
import { RemoteLease } from "../../src/memory/mr.js";
import { PROVIDER, apiPair, eventually, pattern, until, withApiPair } from "../support/api.js";
import type { RdmaBuilder } from "../../src/index.js";
import { SLOW } from "../support/seam.js";
import { contention } from "../../src/agent/poller.js";

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

describe(`API data operations [${PROVIDER}]`, () => {
  it("send/receive of any length: eager, the eager edge, rendezvous (1 MiB), in order", () =>
    withApiPair(async ({ server, client }) => {
      const sizes = [1, 8, 4095, 4096, 4097, 65536, 1 << 20];
      const sent = sizes.map((n, i) => {
        const m = client.allocLocalMr(n);
        m.bytes.set(pattern(n, i + 1));
        return m;
      });
      const sends = sent.map((m) => client.send(m));
      for (let i = 0; i < sizes.length; i++) {
        using got = await server.receive();
        assert.equal(got.length, sizes[i]);
        assert.deepEqual(got.bytes, pattern(sizes[i]!, i + 1), `message ${i} (${sizes[i]} bytes)`);
      }
      await Promise.all(sends);
      for (const m of sent) m.dispose();
    }));

  for (const [mode, spinUs] of [["event", undefined], ["busy", undefined], ["adaptive", 0], ["adaptive", 1_000_000]] as const) {
    it(`polling ${mode}${spinUs === undefined ? "" : ` (spinUs ${spinUs})`}: the same traffic completes, and nothing keeps polling after close`, async () => {
      const cfg = (b: RdmaBuilder) => b.setPolling(mode, spinUs);
      const { server, client, close } = await apiPair({ server: cfg, client: cfg });
      try {
        // Many sends issued in one tick (one posted list), a rendezvous message, and one-sided ops.
        const msgs = Array.from({ length: 300 }, (_, i) => {
          const m = client.allocLocalMr(i === 150 ? 20_000 : 1 + (i % 64));
          m.bytes.set(pattern(m.length, i + 1));
          return m;
        });
        const sends = msgs.map((m) => client.send(m));
        for (let i = 0; i < msgs.length; i++) {
          using got = await server.receive();
          assert.deepEqual(got.bytes, pattern(msgs[i]!.length, i + 1), `message ${i}`);
        }
        await Promise.all(sends);
        for (const m of msgs) m.dispose();
        const rmr = await client.requestRemoteMr(72);
        using l = client.allocLocalMr(64);
        l.bytes.set(pattern(64, 9));
        await client.write(l, rmr.slice(0, 64));
        using back = client.allocLocalMr(64);
        await client.read(back, rmr.slice(0, 64));
        assert.deepEqual(back.bytes, pattern(64, 9));
        const w = rmr.slice(64, 72);
        for (let i = 0; i < 50; i++) assert.equal(await client.fetchAndAdd(w, 1n), BigInt(i));
        rmr.dispose();
      } finally {
        await close();
      }
      // Busy and adaptive polling reschedule themselves with setImmediate while a connection is
      // open; once both are closed no Immediate may remain (checked from timer callbacks, which
      // themselves schedule none).
      const end = performance.now() + 2000 * SLOW;
      while (process.getActiveResourcesInfo().includes("Immediate")) {
        assert.ok(performance.now() < end, `an Immediate is still scheduled after close (${process.getActiveResourcesInfo().join(", ")})`);
        await new Promise((r) => setTimeout(r, 1));
      }
    });
  }

  for (const mode of ["busy", "adaptive"] as const) {
    it(`polling ${mode} while this process waits for a core (more pollers than cores): it gives way to completion events and the traffic completes`, async () => {
      // The thread's contention detector: here its signal always says "contended", as when 4 busy
      // processes share 2 cores.
      const real = contention.signal;
      contention.reset({ name: "always", read: () => performance.now(), exceeded: () => true });
      const gaveWay0 = contention.gaveWay;
      const cfg = (b: RdmaBuilder) => b.setPolling(mode, 1_000_000);
      try {
        await withApiPair(async ({ server, client }) => {
          for (let round = 0; round < 20; round++) {
            using m = client.allocLocalMr(round === 10 ? 20_000 : 32);
            m.bytes.set(pattern(m.length, round + 1));
            const sent = client.send(m);
            using got = await server.receive();
            assert.deepEqual(got.bytes, pattern(m.length, round + 1), `round ${round}`);
            await sent;
            const rmr = await client.requestRemoteMr(8);
            assert.equal(await client.fetchAndAdd(rmr, 1n), 0n);
            rmr.dispose();
          }
        }, { server: cfg, client: cfg });
      } finally {
        contention.reset(real);
      }
      // Both providers spin (tcp's event-driven CQs by keeping the loop turning), so both give way.
      assert.ok(contention.gaveWay > gaveWay0, "the pollers gave way at least once");
    });
  }

  it("sendWithImm / receiveWithImm resolve to { mr, imm }; plain send has imm undefined", () =>
    withApiPair(async ({ server, client }) => {
      using a = client.allocLocalMr(8);
      a.bytes.fill(3);
      using big = client.allocLocalMr(10_000);
      await client.sendWithImm(a, 0xdeadbeef);
      await client.send(a);
      const p = client.sendWithImm(big, 7);
      const r1 = await server.receiveWithImm();
      assert.equal(r1.imm, 0xdeadbeef);
      assert.deepEqual([...r1.mr.bytes], [3, 3, 3, 3, 3, 3, 3, 3]);
      const r2 = await server.receiveWithImm();
      assert.equal(r2.imm, undefined);
      const r3 = await server.receiveWithImm();
      assert.equal(r3.imm, 7, "rendezvous messages carry the immediate too");
      assert.equal(r3.mr.length, 10_000);
      await p;
      await assert.rejects(client.sendWithImm(a, -1), code("INVALID_ARGUMENT"));
    }));

  it("write, read and writeWithImm on slices; bounds are checked before anything is posted", () =>
    withApiPair(async ({ server, client }) => {
      const rmr = await client.requestRemoteMr(64, { timeoutMs: 5000 });
      using lmr = client.allocLocalMr(64);
      lmr.bytes.set(pattern(64, 9));
      await client.write(lmr.slice(16, 48), rmr.slice(16, 48));
      using back = client.allocLocalMr(64);
      await client.read(back, rmr);
      assert.deepEqual([...back.bytes.subarray(16, 48)], [...lmr.bytes.subarray(16, 48)]);
      assert.deepEqual([...back.bytes.subarray(0, 16)], new Array(16).fill(0));
      await client.writeWithImm(lmr.slice(0, 4), rmr.slice(60, 64), 60);
      assert.equal(await server.receiveWriteImm(), 60);
      assert.throws(() => lmr.slice(10, 65), code("OUT_OF_RANGE"));
      assert.throws(() => rmr.slice(-1, 2), code("OUT_OF_RANGE"));
      await assert.rejects(client.write(lmr, rmr.slice(0, 63)), code("OUT_OF_RANGE"));
      await assert.rejects(client.write({} as never, rmr), code("INVALID_ARGUMENT"));
      await client.sendRemoteMr(rmr);
      using mine = await server.receiveLocalMr();
      assert.deepEqual([...mine.bytes.subarray(16, 48)], [...lmr.bytes.subarray(16, 48)]);
      assert.deepEqual([...mine.bytes.subarray(60, 64)], [...lmr.bytes.subarray(0, 4)]);
      await assert.rejects(client.write(lmr, rmr), code("INVALID_STATE"), "a region handed back cannot be used any more");
    }));

  it("compareAndSwap and fetchAndAdd return the old value; misaligned targets are refused locally", () =>
    withApiPair(async ({ client }) => {
      const rmr = await client.requestRemoteMr(16);
      const w = rmr.slice(8, 16);
      assert.equal(await client.fetchAndAdd(w, 5n), 0n);
      assert.equal(await client.fetchAndAdd(w, 5n), 5n);
      assert.equal(await client.compareAndSwap(w, 10n, 100n), 10n);
      assert.equal(await client.compareAndSwap(w, 10n, 200n), 100n, "no swap when the compare fails");
      assert.equal(await client.fetchAndAdd(w, -1n), 100n);
      assert.equal(await client.fetchAndAdd(w, 0n), 99n);
      await assert.rejects(client.fetchAndAdd(rmr.slice(4, 12), 1n), code("INVALID_ARGUMENT"));
      await assert.rejects(client.fetchAndAdd(rmr.slice(0, 4), 1n), code("OUT_OF_RANGE"));
      await assert.rejects(client.fetchAndAdd(w, 1 as never), code("INVALID_ARGUMENT"));
    }));

  it("sendLocalMr lends exactly those bytes; the lender cannot touch them until they come back", () =>
    withApiPair(async ({ server, client }) => {
      const lmr = client.allocLocalMr(32);
      lmr.bytes.fill(1);
      const part = lmr.slice(8, 16);
      await client.sendLocalMr(part);
      assert.throws(() => lmr.bytes, code("INVALID_STATE"));
      const rmr = await server.receiveRemoteMr();
      assert.equal(rmr.length, 8);
      using buf = server.allocLocalMr(8);
      await server.read(buf, rmr);
      assert.deepEqual([...buf.bytes], new Array(8).fill(1));
      buf.bytes.fill(9);
      await server.write(buf, rmr);
      await server.sendRemoteMr(rmr);
      using back = await client.receiveLocalMr();
      assert.deepEqual([...back.bytes], new Array(8).fill(9));
      assert.deepEqual([...lmr.bytes.subarray(0, 8)], new Array(8).fill(1), "bytes outside the lent range untouched");
      assert.deepEqual([...lmr.bytes.subarray(8, 16)], new Array(8).fill(9));
    }));

  it("a dropped RemoteMr goes back early: the lender can use its memory again", () =>
    withApiPair(async ({ server, client }) => {
      const lmr = client.allocLocalMr(8);
      await client.sendLocalMr(lmr);
      const rmr = await server.receiveRemoteMr();
      rmr.dispose();
      await eventually(() => client.stats().lends === 0, 5000, "the lend to return");
      lmr.bytes.fill(4);
      assert.equal(lmr.bytes[0], 4);
    }));

  it("lease expiry, requester side: a late write fails with LEASE_EXPIRED and never reaches the wire", () =>
    withApiPair(async ({ client, server }) => {
      // allocate first, and leave the first write time: on a loaded machine (the suite twice at
      // once, or the emulated guest) the request's round trip plus a write outlasted 30 ms
      using lmr = client.allocLocalMr(8);
      const rmr = await client.requestRemoteMr(8, { leaseMs: 500 * SLOW });
      await client.write(lmr, rmr);
      await until(rmr.leaseDeadline);
      await assert.rejects(client.write(lmr, rmr), code("LEASE_EXPIRED"));
      await eventually(() => server.stats().grants === 0, 5000, "the owner to revoke the grant");
      // the connection is still fine
      const r2 = await client.requestRemoteMr(8);
      await client.write(lmr, r2);
    }));

  it("lease expiry, owner side: after revocation a forged access fails with REMOTE_ACCESS and touches nothing", () =>
    withApiPair(async ({ client, server }) => {
      const rmr = await client.requestRemoteMr(8, { leaseMs: 30 });
      await until(rmr.leaseDeadline);
      await eventually(() => server.stats().grants === 0, 5000, "the owner to revoke the grant");
      // Bypass the local lease check, as a buggy or hostile client would.
      const forged = new RemoteMr(rmr.addr, rmr.length, rmr.rkey, new RemoteLease(1, Infinity, null), "granted");
      using lmr = client.allocLocalMr(8);
      lmr.bytes.fill(0xee);
      await assert.rejects(client.write(lmr, forged), code("REMOTE_ACCESS"));
      // RC: a remote access error is fatal for the connection, on both sides.
      await assert.rejects(client.send(lmr), (e: unknown) => e instanceof RdmaError);
    }));

  it("quota: requests past the peer's quota fail with QUOTA_EXCEEDED until memory is released", () =>
    withApiPair(
      async ({ client, server }) => {
        const a = await client.requestRemoteMr(3000);
        await assert.rejects(client.requestRemoteMr(2000), code("QUOTA_EXCEEDED"));
        const b = await client.requestRemoteMr(1000);
        a.dispose();
        await eventually(() => server.stats().quotaUsed === 1000, 5000, "the release to reach the owner");
        const c = await client.requestRemoteMr(3000);
        c.dispose();
        b.dispose();
      },
      { server: (b) => b.setRemoteMemoryQuota(4096) },
    ));

  it("every wait takes an AbortSignal: receive, requestRemoteMr, send", () =>
    withApiPair(async ({ client, server }) => {
      const ac = new AbortController();
      const p = server.receive({ signal: ac.signal });
      ac.abort(new Error("user gave up"));
      await assert.rejects(p, code("ABORTED"));
      await assert.rejects(server.receiveLocalMr({ signal: AbortSignal.abort() }), code("ABORTED"));
      await assert.rejects(client.requestRemoteMr(8, { signal: AbortSignal.abort() }), code("ABORTED"));
      // the connection still works after aborts, and an aborted receive does not eat a message
      using m = client.allocLocalMr(4);
      m.bytes.fill(2);
      await client.send(m);
      using got = await server.receive();
      assert.deepEqual([...got.bytes], [2, 2, 2, 2]);
    }));

  it("close with pending work: the peer's pending receives reject with CONNECTION_CLOSED", () =>
    withApiPair(async ({ client, server }) => {
      const pending = [client.receive(), client.receiveWithImm(), client.receiveWriteImm(), client.receiveRemoteMr()].map((p) => assert.rejects(p, code("CONNECTION_CLOSED")));
      await server.close();
      await Promise.all(pending);
      await assert.rejects(client.requestRemoteMr(8), code("CONNECTION_CLOSED"));
      assert.throws(() => server.allocLocalMr(8), code("CONNECTION_CLOSED"));
    }));

  it("hundreds of operations in flight on one connection, data verified", () =>
    withApiPair(async ({ client, server }) => {
      const N = 300;
      const rmr = await client.requestRemoteMr(N * 64);
      const srcs = Array.from({ length: N }, (_, i) => {
        const m = client.allocLocalMr(64);
        m.bytes.set(pattern(64, i + 100));
        return m;
      });
      const msgs = Array.from({ length: N }, (_, i) => {
        const m = client.allocLocalMr(100 + i);
        m.bytes.set(pattern(100 + i, i + 5000));
        return m;
      });
      const ops: Promise<unknown>[] = [];
      for (let i = 0; i < N; i++) {
        ops.push(client.write(srcs[i]!, rmr.slice(i * 64, i * 64 + 64)));
        ops.push(client.send(msgs[i]!));
        ops.push(client.fetchAndAdd(rmr.slice(0, 8), 0n));
      }
      const recv = (async () => {
        for (let i = 0; i < N; i++) {
          using r = await server.receive();
          assert.deepEqual(r.bytes, pattern(100 + i, i + 5000), `message ${i}`);
        }
      })();
      await Promise.all([...ops, recv]);
      using all = client.allocLocalMr(N * 64);
      await client.read(all, rmr);
      for (let i = 1; i < N; i++) assert.deepEqual(all.bytes.subarray(i * 64, i * 64 + 64), pattern(64, i + 100), `write ${i}`);
    }));

  it("hundreds of rendezvous messages in flight: credits never deadlock (control messages wait on credits too)", () =>
    withApiPair(async ({ server, client }) => {
      const N = 1000;
      const WINDOW = 128;
      using src = client.allocLocalMr(8192);
      src.bytes.set(pattern(8192, 77));
      let sent = 0;
      const sender = (async () => {
        const inflight = new Set<Promise<void>>();
        while (sent < N) {
          const p: Promise<void> = client.send(src).then(() => void inflight.delete(p));
          inflight.add(p);
          sent++;
          if (inflight.size >= WINDOW) await Promise.race(inflight);
        }
        await Promise.all(inflight);
      })();
      for (let i = 0; i < N; i++) {
        using r = await server.receive();
        assert.equal(r.length, 8192);
        if (i % 97 === 0) assert.deepEqual(r.bytes, pattern(8192, 77));
      }
      await sender;
    }));

  it("both sides send eager and rendezvous messages at once: the READ of an arrived rendezvous message never waits behind sends that wait for credits", () =>
    withApiPair(async ({ server, client }) => {
      // Found by the RPC test (10,000 calls in flight): each side's next message to read was a
      // rendezvous whose READ sat in the send queue behind that side's own credit-blocked sends,
      // while the credits could only come back once those messages were read.
      const N = PROVIDER === "verbs" ? 150 : 400;
      const size = (i: number): number => (i % 3 === 0 ? 65536 : 64);
      const run = async (me: typeof server, seed: number): Promise<void> => {
        const src = me.allocLocalMr(65536);
        src.bytes.set(pattern(65536, seed));
        const sends = Array.from({ length: N }, (_, i) => me.send(src.slice(0, size(i))));
        for (let i = 0; i < N; i++) {
          using m = await me.receive();
          assert.equal(m.length, size(i), `message ${i}`);
          if (i % 50 === 0) assert.deepEqual(m.bytes, pattern(65536, seed ^ 1).subarray(0, size(i)));
        }
        await Promise.all(sends);
      };
      let timer: NodeJS.Timeout | undefined;
      const deadline = new Promise<never>((_, rej) => {
        timer = setTimeout(() => rej(new Error(`no progress: server read ${server.stats().unread} unread, client ${client.stats().unread} (a deadlock)`)), 60_000 * (PROVIDER === "verbs" ? 5 : 1));
      });
      try {
        await Promise.race([Promise.all([run(server, 4), run(client, 5)]), deadline]);
      } finally {
        clearTimeout(timer);
      }
    }));

  it("two sides that both leave messages unread go quiet: no CREDIT message answers a CREDIT message for ever", () =>
    withApiPair(async ({ server, client }) => {
      // Found with the deadlock above: each side returned the one buffer the other's CREDIT
      // consumed, ~10,000 CREDIT messages a second each way, while neither user read anything.
      const a = client.allocLocalMr(64);
      const b = server.allocLocalMr(64);
      const sends = [];
      for (let i = 0; i < 100; i++) sends.push(client.send(a).catch(() => {}), server.send(b).catch(() => {}));
      // Both sides stop taking messages once half their receive buffers hold unread ones.
      await eventually(() => server.stats().unread >= 16 && client.stats().unread >= 16, 30_000, "both sides hold unread messages");
      const before = client.stats().creditMessages + server.stats().creditMessages;
      // Absence of a livelock is watched over a window: before the fix this window saw thousands.
      await new Promise((r) => setTimeout(r, 500));
      const during = client.stats().creditMessages + server.stats().creditMessages - before;
      assert.ok(during <= 4, `${during} CREDIT messages in 500 ms while both sides were blocked`);
      // Reading everything lets every send through.
      const drain = async (me: typeof server): Promise<void> => {
        for (let i = 0; i < 100; i++) (await me.receive()).dispose();
      };
      await Promise.all([drain(server), drain(client), ...sends]);
    }));

  it("a rendezvous message aborted while it waits for credits never reaches the bounce memory the peer can read", () =>
    withApiPair(async ({ server, client }) => {
      // Mid-size rendezvous messages go through bounce memory registered once for the peer, whose
      // key the peer learns from any earlier message: bytes copied there before the announcement
      // is posted would be readable by a peer that READs with that key, even if the send is aborted.
      using m = client.allocLocalMr(10_000);
      m.bytes.fill(1);
      await client.send(m); // the first mid-size message: the bounce memory exists now
      (await server.receive()).dispose();
      // The server stops reading: credits run out and later messages wait in the queue.
      using small = client.allocLocalMr(8);
      const queued = Array.from({ length: 100 }, () => client.send(small).catch(() => {}));
      await eventually(() => server.stats().unread >= 16, 30_000, "the server to hold unread messages");
      const secret = pattern(10_000, 0x5ec);
      m.bytes.set(secret);
      const bounce = (client.conn as unknown as { rndv: { bounce: { mem: { alloc: { buffer: ArrayBuffer; bufOffset: number; length: number } } } | null } }).rndv.bounce;
      assert.ok(bounce, "the bounce memory exists");
      const readable = (): Buffer => Buffer.from(bounce.mem.alloc.buffer, bounce.mem.alloc.bufOffset, bounce.mem.alloc.length);
      const ac = new AbortController();
      const p = client.send(m, { signal: ac.signal });
      await new Promise((r) => setImmediate(r)); // the queue was flushed: the announcement still waits for credits
      assert.equal(readable().indexOf(Buffer.from(secret.subarray(0, 64))), -1, "a queued message's bytes are already in memory the peer can READ");
      ac.abort();
      await assert.rejects(p, code("ABORTED"));
      assert.equal(readable().indexOf(Buffer.from(secret.subarray(0, 64))), -1, "the aborted message's bytes are in memory the peer can READ");
      for (let i = 0; i < 100; i++) (await server.receive()).dispose();
      await Promise.all(queued);
    }));

  it("disposing memory detaches its views; a registered user buffer stays the user's", () =>
    withApiPair(async ({ client }) => {
      const lmr = client.allocLocalMr(16);
      const view = lmr.bytes;
      view.fill(1);
      lmr.dispose();
      assert.equal(view.length, 0, "the old view is detached");
      assert.throws(() => lmr.bytes, code("INVALID_STATE"));
      const ab = new ArrayBuffer(32);
      const mine = client.registerMr(ab, 8, 16);
      mine.bytes.fill(7);
      assert.equal(new Uint8Array(ab)[8], 7);
      mine.dispose();
      assert.equal(ab.byteLength, 32, "the user's buffer is not detached");
      const f64 = client.allocLocalMr(64).view(Float64Array);
      assert.equal(f64.length, 8);
    }));
});
