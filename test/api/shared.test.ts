/**
 * Shared regions (listener.share / rdma.share / openSharedMr), per-region
 * access, lease renewal, quota back-pressure and the peer's limits — on the
 * provider under test, over the connection manager under test.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, type Rdma, type RdmaListener, type SharedMr } from "../../src/index.js";
import { RemoteLease, RemoteMr } from "../../src/memory/mr.js";
import { CM, PROVIDER, apiPair, at, builder, eventually, until } from "../support/api.js";

const SLOW = PROVIDER === "verbs" ? 4 : 1;

function code(c: string, re?: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    if (re) assert.match(e.message, re);
    return true;
  };
}

/** The same address and rkey without the library's local checks: what a forged or stale operation would send. */
function forge(r: RemoteMr): RemoteMr {
  return new RemoteMr(r.addr, r.length, r.rkey, new RemoteLease(0, Infinity, null), "granted", "atomic");
}

/** Registrations a share holds (one per protection domain with it open). */
function registrations(s: SharedMr): number {
  return (s as unknown as { share: { registrations: number } }).share.registrations;
}

async function clients(listener: RdmaListener, n: number): Promise<{ c: Rdma; s: Rdma }[]> {
  const out: { c: Rdma; s: Rdma }[] = [];
  for (let i = 0; i < n; i++) {
    const [c, s] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
    out.push({ c, s });
  }
  return out;
}

async function closeAll(pairs: { c: Rdma; s: Rdma }[]): Promise<void> {
  await Promise.allSettled(pairs.flatMap((p) => [p.c.close(), p.s.close()]));
}

describe(`shared regions [${PROVIDER}, ${CM}]`, { timeout: 300_000 * SLOW }, () => {
  it("atomics from many peers on one shared word add up exactly; the owner sees the total locally", async () => {
    const listener = await builder("server").bind(at(0));
    const counter = listener.allocLocalMr(8);
    const shared = listener.share("counter", counter, { access: "atomic" });
    const pairs = await clients(listener, 3);
    try {
      const rmrs = await Promise.all(pairs.map((p) => p.c.openSharedMr("counter", { timeoutMs: 30_000 })));
      assert.equal(shared.openCount, 3);
      assert.equal(registrations(shared), 3, "one registration per connection's protection domain");
      for (const r of rmrs) {
        assert.equal(r.origin, "shared");
        assert.equal(r.access, "atomic");
        assert.equal(r.leaseDeadline, Infinity);
      }
      const N = 200;
      await Promise.all(pairs.map((p, i) => (async () => {
        for (let k = 0; k < N; k++) await p.c.fetchAndAdd(rmrs[i]!, 1n);
      })()));
      assert.equal(counter.view(BigUint64Array)[0], BigInt(3 * N));
      // every peer reads the same word
      for (const [i, p] of pairs.entries()) {
        using l = p.c.allocLocalMr(8);
        await p.c.read(l, rmrs[i]!);
        assert.equal(l.view(BigUint64Array)[0], BigInt(3 * N));
      }
      // a peer's close gives back its open (and its PD's registration)
      await pairs[0]!.c.close();
      await eventually(() => shared.openCount === 2, 30_000 * SLOW, "the closed peer's open to end");
      assert.equal(registrations(shared), 2);
      rmrs[1]!.dispose();
      await eventually(() => shared.openCount === 1, 30_000 * SLOW, "the disposed open to end");
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
    assert.equal(shared.revoked, true, "closing the listener revokes its shares");
    assert.equal(registrations(shared), 0);
  });

  it("an unknown name, or one allow() refuses, is NOT_FOUND and holds nothing; names are exact", async () => {
    const listener = await builder("server").bind(at(0));
    const lmr = listener.allocLocalMr(64);
    const seen: unknown[] = [];
    const shared = listener.share("only-some", lmr, { access: "read", allow: (peer) => (seen.push(peer), false) });
    listener.share("open", listener.allocLocalMr(8));
    const [p] = await clients(listener, 1);
    try {
      await assert.rejects(p!.c.openSharedMr("nope"), code("NOT_FOUND"));
      await assert.rejects(p!.c.openSharedMr("Open"), code("NOT_FOUND"));
      await assert.rejects(p!.c.openSharedMr("only-some"), code("NOT_FOUND"));
      assert.equal(seen.length, 1, "allow() was asked");
      assert.equal(shared.openCount, 0);
      // thousands of names cost nothing
      for (let i = 0; i < 500; i++) await assert.rejects(p!.c.openSharedMr(`name-${i}`), code("NOT_FOUND"));
      assert.equal(p!.s.stats().sharesOpenedByPeer, 0);
      const ok = await p!.c.openSharedMr("open");
      assert.equal(ok.access, "read");
      assert.equal(p!.s.stats().sharesOpenedByPeer, 1);
      await assert.rejects(p!.c.openSharedMr(""), code("INVALID_ARGUMENT"));
      assert.throws(() => listener.share("open", listener.allocLocalMr(8)), code("INVALID_ARGUMENT", /already shared/));
      assert.throws(() => listener.share("x", lmr, { access: "all" as never }), code("INVALID_ARGUMENT"));
    } finally {
      await closeAll([p!]);
      await listener.close();
    }
  });

  it("allow(peer) sees the identity a peer proved (authenticated connections): only alice opens", async () => {
    const alice = "alice-secret-0123456789";
    const bob = "bob-secret-0123456789ab";
    const listener = await builder("server").setAuth({ keys: { alice, bob } }).bind(at(0));
    const lmr = listener.allocLocalMr(8);
    const seen: (string | null)[] = [];
    listener.share("alice-only", lmr, { access: "atomic", allow: (peer) => (seen.push(peer.identity), peer.identity === "alice") });
    const pairs: { c: Rdma; s: Rdma }[] = [];
    try {
      for (const [identity, key] of [["alice", alice], ["bob", bob]] as const) {
        const [c, s] = await Promise.all([builder("client").setAuth({ key, identity }).connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
        pairs.push({ c, s });
      }
      const r = await pairs[0]!.c.openSharedMr("alice-only");
      await pairs[0]!.c.fetchAndAdd(r, 5n);
      await assert.rejects(pairs[1]!.c.openSharedMr("alice-only"), code("NOT_FOUND"));
      assert.deepEqual(seen, ["alice", "bob"]);
      assert.equal(lmr.view(BigUint64Array)[0], 5n);
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
  });

  it("access is exactly what was shared: refused locally, and by the device when forced; the owner's bytes are untouched", async () => {
    const listener = await builder("server").bind(at(0));
    const lmr = listener.allocLocalMr(64);
    lmr.bytes.fill(7);
    listener.share("ro", lmr, { access: "read" });
    const rw = listener.allocLocalMr(64);
    listener.share("rw", rw, { access: "write" });
    const pairs = await clients(listener, 2);
    try {
      const c = pairs[0]!.c;
      const ro = await c.openSharedMr("ro");
      using l = c.allocLocalMr(64);
      await c.read(l, ro);
      assert.deepEqual([...l.bytes], [...lmr.bytes]);
      l.bytes.fill(9);
      await assert.rejects(c.write(l, ro), code("REMOTE_ACCESS", /read only/));
      await assert.rejects(c.fetchAndAdd(ro.slice(0, 8), 1n), code("REMOTE_ACCESS"));
      const rwm = await c.openSharedMr("rw");
      await c.write(l, rwm);
      assert.deepEqual([...rw.bytes], [...l.bytes]);
      await assert.rejects(c.compareAndSwap(rwm.slice(0, 8), 0n, 1n), code("REMOTE_ACCESS", /no atomics/));
      // forced past the local check: the registration refuses (and the device ends that connection)
      await assert.rejects(c.write(l, forge(ro)), code("REMOTE_ACCESS"));
      assert.ok(lmr.bytes.every((b) => b === 7), "the read-only share was not written");
      // the other connection is unaffected
      const c2 = pairs[1]!.c;
      const ro2 = await c2.openSharedMr("ro");
      using l2 = c2.allocLocalMr(64);
      await c2.read(l2, ro2);
      assert.ok(l2.bytes.every((b) => b === 7));
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
  });

  it("a peer reaches a share only through its own open: another connection's rkey is refused", async () => {
    const listener = await builder("server").bind(at(0));
    const lmr = listener.allocLocalMr(64);
    listener.share("s", lmr, { access: "write" });
    const pairs = await clients(listener, 2);
    try {
      const a = await pairs[0]!.c.openSharedMr("s");
      // B never opened it: A's address and rkey mean nothing on B's connection
      using l = pairs[1]!.c.allocLocalMr(64);
      l.bytes.fill(3);
      // A's RemoteMr is refused locally on B…
      await assert.rejects(pairs[1]!.c.write(l, a), code("INVALID_ARGUMENT"));
      // …and forged, by the device (which ends B's connection)
      await assert.rejects(pairs[1]!.c.write(l, forge(a)), code("REMOTE_ACCESS"));
      assert.ok(lmr.bytes.every((b) => b === 0));
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
  });

  it("revoke(): every opener is told, later operations fail (locally and on the device), and nothing of the owner is touched", async () => {
    const listener = await builder("server").bind(at(0));
    const lmr = listener.allocLocalMr(64);
    const shared = listener.share("r", lmr, { access: "write" });
    const pairs = await clients(listener, 2);
    try {
      const rmrs = await Promise.all(pairs.map((p) => p.c.openSharedMr("r")));
      await shared.revoke();
      assert.equal(registrations(shared), 0, "deregistered once revoke() resolved");
      await eventually(() => rmrs.every((r) => r.revoked), 30_000 * SLOW, "the openers to learn of the revocation");
      using l = pairs[0]!.c.allocLocalMr(64);
      l.bytes.fill(5);
      await assert.rejects(pairs[0]!.c.write(l, rmrs[0]!), code("REMOTE_ACCESS", /revoked/));
      using l1 = pairs[1]!.c.allocLocalMr(64);
      await assert.rejects(pairs[1]!.c.write(l1, forge(rmrs[1]!)), code("REMOTE_ACCESS"));
      assert.ok(lmr.bytes.every((b) => b === 0));
      await assert.rejects(pairs[0]!.c.openSharedMr("r"), code("NOT_FOUND"));
      // the owner keeps its memory and may share it again
      lmr.bytes[0] = 1;
      const again = listener.share("r", lmr, { access: "read" });
      const r2 = await pairs[0]!.c.openSharedMr("r");
      assert.equal(r2.access, "read");
      again.revoke();
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
  });

  it("issue 19 point 16: an operation right after revoke() lands or fails locally with REMOTE_ACCESS, and the opener's connection lives", async () => {
    const listener = await builder("server").bind(at(0));
    const lmr = listener.allocLocalMr(64);
    const pairs = await clients(listener, 1);
    const { c, s } = pairs[0]!;
    try {
      for (let round = 0; round < 5; round++) {
        const shared = listener.share("r", lmr, { access: "write" });
        const rmr = await c.openSharedMr("r");
        using l = c.allocLocalMr(64);
        l.bytes.fill(round + 1);
        // The owner revokes while the opener's WRITE is on its way (nothing waits for the MR_REVOKED).
        const revoking = shared.revoke();
        const outcome = await c.write(l, rmr).then(
          () => "landed",
          (e: unknown) => {
            assert.ok(e instanceof RdmaError && e.code === "REMOTE_ACCESS", `expected REMOTE_ACCESS, got ${String(e)}`);
            return "refused";
          },
        );
        await revoking;
        assert.equal(registrations(shared), 0, "no registration left once revoke() resolved");
        assert.equal(shared.openCount, 0);
        assert.equal(lmr.bytes[0], outcome === "landed" ? round + 1 : round, `round ${round}: the owner's memory holds exactly what landed`);
        if (outcome === "refused") lmr.bytes.fill(round + 1);
        // After the opener knows, every use fails locally and the connection lives on.
        await eventually(() => rmr.revoked, 30_000 * SLOW, "the opener to learn of the revocation");
        await assert.rejects(c.write(l, rmr), code("REMOTE_ACCESS", /revoked/));
        await assert.rejects(c.read(l, rmr), code("REMOTE_ACCESS", /revoked/));
        assert.equal(c.isClosed, false, "the opener's connection lives");
        using m = c.allocLocalMr(8);
        await c.send(m);
        (await s.receive()).dispose();
      }
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
  });

  it("issue 19 point 16: revoke({ timeoutMs: 0 }) deregisters at once; a bad timeout is refused", async () => {
    const listener = await builder("server").bind(at(0));
    const lmr = listener.allocLocalMr(64);
    const pairs = await clients(listener, 1);
    try {
      const a = listener.share("a", lmr, { access: "read" });
      await pairs[0]!.c.openSharedMr("a");
      const now = a.revoke({ timeoutMs: 0 });
      assert.equal(registrations(a), 0, "timeoutMs 0: deregistered at once");
      await now;
      assert.throws(() => listener.share("b", lmr).revoke({ timeoutMs: -1 }), code("INVALID_ARGUMENT"));
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
  });

  it("disposing the shared memory revokes the share first; revoke, close and dispose in any order leak nothing", async () => {
    const listener = await builder("server").bind(at(0));
    const pairs = await clients(listener, 1);
    const c = pairs[0]!.c;
    try {
      const lmr = listener.allocLocalMr(32);
      const s1 = listener.share("a", lmr, { access: "atomic" });
      const r = await c.openSharedMr("a");
      lmr.dispose();
      assert.equal(s1.revoked, true);
      assert.equal(registrations(s1), 0);
      await eventually(() => r.revoked, 30_000 * SLOW, "the revocation to arrive");
      // revoke twice, dispose after revoke, share then close the connection
      const m2 = listener.allocLocalMr(32);
      const s2 = listener.share("b", m2);
      s2.revoke();
      s2.revoke();
      m2.dispose();
      const m3 = listener.allocLocalMr(32);
      const s3 = listener.share("c", m3);
      await c.openSharedMr("c");
      await c.close();
      await eventually(() => s3.openCount === 0, 30_000 * SLOW, "the open to end with the connection");
      assert.equal(registrations(s3), 0);
      s3.revoke();
      m3.dispose();
    } finally {
      await closeAll(pairs);
      await listener.close();
    }
  });

  it("rdma.share: a connection shares its own memory with its peer", async () => {
    const p = await apiPair();
    try {
      const lmr = p.client.allocLocalMr(16);
      lmr.bytes.set([1, 2, 3, 4]);
      const s = p.client.share("from-client", lmr, { access: "read" });
      const r = await p.server.openSharedMr("from-client");
      using l = p.server.allocLocalMr(16);
      await p.server.read(l, r);
      assert.deepEqual([...l.bytes.subarray(0, 4)], [1, 2, 3, 4]);
      assert.equal(s.openCount, 1);
      // a shared region stays with its owner: it cannot be lent away
      await assert.rejects(p.client.sendLocalMr(lmr), code("INVALID_STATE", /shared/));
      await assert.rejects(p.server.sendRemoteMr(r), code("INVALID_ARGUMENT"));
      await assert.rejects(r.renew(1000), code("INVALID_ARGUMENT", /no lease/));
    } finally {
      await p.close();
    }
  });
});

describe(`per-region access, leases, quotas and limits [${PROVIDER}, ${CM}]`, { timeout: 300_000 * SLOW }, () => {
  it("requestRemoteMr and sendLocalMr register exactly the rights asked for", async () => {
    const p = await apiPair();
    try {
      const r = await p.client.requestRemoteMr(64, { access: "read" });
      assert.equal(r.access, "read");
      using l = p.client.allocLocalMr(64);
      await p.client.read(l, r);
      await assert.rejects(p.client.write(l, r), code("REMOTE_ACCESS"));
      const w = await p.client.requestRemoteMr(64, { access: "write" });
      await p.client.write(l, w);
      await assert.rejects(p.client.fetchAndAdd(w.slice(0, 8), 1n), code("REMOTE_ACCESS"));
      await assert.rejects(p.client.requestRemoteMr(64, { access: "rw" as never }), code("INVALID_ARGUMENT"));
      // lent read-only
      const mine = p.server.allocLocalMr(64);
      await p.server.sendLocalMr(mine, { access: "read" });
      const lent = await p.client.receiveRemoteMr();
      assert.equal(lent.access, "read");
      await p.client.read(l, lent);
      await assert.rejects(p.client.write(l, lent), code("REMOTE_ACCESS"));
      // forced: the device refuses the write into the read-only grant
      await assert.rejects(p.client.write(l, forge(r)), code("REMOTE_ACCESS"));
    } finally {
      await p.close();
    }
  });

  it("each side knows the other's limits once connected", async () => {
    const p = await apiPair({ server: (b) => b.setRemoteMemoryQuota(1 << 20).setMaxRemoteRegions(7).setMaxLease(90_000).setMaxMessageSize(1 << 22) });
    try {
      assert.deepEqual(p.client.peerLimits, { quotaBytes: 1 << 20, maxRegions: 7, maxLeaseMs: 90_000, maxMessageSize: 1 << 22 });
      assert.ok(p.server.peerLimits, "the server knows the client's too");
    } finally {
      await p.close();
    }
  });

  it("renew extends a lease past its first end; more than the owner's maximum is refused, naming it", async () => {
    const p = await apiPair({ server: (b) => b.setMaxLease(60_000).setLeaseGrace(0) });
    try {
      await assert.rejects(p.client.requestRemoteMr(8, { leaseMs: 120_000 }), code("OUT_OF_RANGE", /60000/));
      const short = 300 * SLOW;
      const r = await p.client.requestRemoteMr(64, { leaseMs: short });
      const firstEnd = r.leaseDeadline;
      await r.renew(30_000);
      assert.ok(r.leaseDeadline > firstEnd + 10_000);
      await assert.rejects(r.renew(120_000), code("OUT_OF_RANGE", /60000/));
      // past the first end (plus the owner's grace of 0): still registered, still usable
      await until(firstEnd + 200 * SLOW);
      using l = p.client.allocLocalMr(64);
      await p.client.write(l, r);
      // a lent region too
      const mine = p.server.allocLocalMr(64);
      await p.server.sendLocalMr(mine, { leaseMs: short });
      const lent = await p.client.receiveRemoteMr();
      await p.client.renew(lent, 30_000);
      await until(lent.leaseDeadline - 29_000 + short);
      await p.client.write(l, lent);
      // without renewal the lease ends as before
      const gone = await p.client.requestRemoteMr(64, { leaseMs: 50 });
      await until(gone.leaseDeadline);
      await assert.rejects(gone.renew(1000), code("LEASE_EXPIRED"));
    } finally {
      await p.close();
    }
  });

  it("quota: the error says requested, in use and limit; waitForQuota waits for room; a request above the whole quota says so", async () => {
    const p = await apiPair({ server: (b) => b.setRemoteMemoryQuota(4096) });
    try {
      await assert.rejects(p.client.requestRemoteMr(8192), code("QUOTA_EXCEEDED", /whole quota .*4096/));
      await assert.rejects(p.client.requestRemoteMr(8192, { waitForQuota: true }), code("QUOTA_EXCEEDED", /whole quota/));
      const a = await p.client.requestRemoteMr(3072);
      await assert.rejects(p.client.requestRemoteMr(2048), code("QUOTA_EXCEEDED", /3072 bytes in 1 regions in use of 4096 bytes/));
      let got = false;
      const waiting = p.client.requestRemoteMr(2048, { waitForQuota: true, timeoutMs: 60_000 }).then((r) => {
        got = true;
        return r;
      });
      // it waits while the quota is full…
      await p.client.requestRemoteMr(8, { timeoutMs: 30_000 }).then((r) => r.dispose());
      assert.equal(got, false);
      // …and gets in once memory comes back
      a.dispose();
      const b = await waiting;
      assert.equal(b.length, 2048);
      await assert.rejects(p.client.requestRemoteMr(4096, { waitForQuota: true, timeoutMs: 300 }), code("TIMEOUT"));
      const ac = new AbortController();
      const aborted = p.client.requestRemoteMr(4096, { waitForQuota: true, signal: ac.signal });
      ac.abort();
      await assert.rejects(aborted, code("ABORTED"));
    } finally {
      await p.close();
    }
  });
});
