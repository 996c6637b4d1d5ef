/**
 * Isolation between the connections of one listener (issue 9, point 1): a
 * peer reaches only memory granted or lent to *it*. Every accepted connection
 * has its own protection domain, so an rkey of another connection is refused
 * by the device/provider (REMOTE_ACCESS on the attacker's connection) even
 * when the attacker knows it exactly; the victim's memory is untouched and its
 * connection keeps working. At the API, a LocalMr or RemoteMr of another
 * connection is refused with INVALID_ARGUMENT before anything is posted, and
 * neither connection dies.
 *
 * Runs on tcp, and on rxe with ASYNC_RDMA_PROVIDER=verbs
 * (scripts/softroce/test-verbs.sh single -- api/isolation).
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, type Rdma, type RdmaListener } from "../../src/index.js";
import { RemoteLease, RemoteMr } from "../../src/memory/mr.js";
import { CM, PROVIDER, at, builder, pattern } from "../support/api.js";

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

/** A RemoteMr carrying an address and rkey this connection was never given (what a raw client can put on the wire). */
function forge(addr: number, length: number, rkey: number): RemoteMr {
  return new RemoteMr(addr, length, rkey, new RemoteLease(0, Infinity, null), "granted");
}

interface Peer {
  client: Rdma;
  server: Rdma;
}

const SECRET = pattern(64, 0x5ec7e7);

/** The connection still carries messages both ways. */
async function alive(p: Peer, seed: number): Promise<void> {
  using m = p.client.allocLocalMr(16);
  m.bytes.set(pattern(16, seed));
  await p.client.send(m);
  using r = await p.server.receive();
  assert.deepEqual([...r.bytes], [...pattern(16, seed)]);
  using m2 = p.server.allocLocalMr(16);
  m2.bytes.set(pattern(16, seed + 1));
  await p.server.send(m2);
  using r2 = await p.client.receive();
  assert.deepEqual([...r2.bytes], [...pattern(16, seed + 1)]);
}

describe(`API isolation between connections of one listener [${PROVIDER}, ${CM}]`, { timeout: 300_000 }, () => {
  let listener: RdmaListener;
  const open: Rdma[] = [];

  async function join(): Promise<Peer> {
    const [client, server] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
    open.push(client, server);
    return { client, server };
  }

  before(async () => {
    listener = await builder("server").bind(at(0));
  });
  after(async () => {
    await Promise.allSettled(open.map((r) => r.close()));
    await listener.close();
  });

  /**
   * An attacking connection: a newConnection() sibling of `holder`, so that
   * memory allocated on the holder (same protection domain) outlives the
   * attacker's death and can be inspected afterwards.
   */
  async function attacker(holder: Peer): Promise<Peer> {
    const [client, server] = await Promise.all([holder.client.newConnection(), listener.accept({ timeoutMs: 60_000 })]);
    open.push(client, server);
    return { client, server };
  }

  /** B's granted region (server memory) holds the secret; B reads it back through its own connection. */
  async function victimGrant(b: Peer): Promise<RemoteMr> {
    const rmr = await b.client.requestRemoteMr(SECRET.length, { timeoutMs: 60_000 });
    using m = b.client.allocLocalMr(SECRET.length);
    m.bytes.set(SECRET);
    await b.client.write(m, rmr);
    return rmr;
  }

  async function victimIntact(b: Peer, rmr: RemoteMr, seed: number): Promise<void> {
    using m = b.client.allocLocalMr(SECRET.length);
    await b.client.read(m, rmr);
    assert.deepEqual([...m.bytes], [...SECRET], "B's granted memory was changed by another connection");
    await alive(b, seed);
    assert.equal(b.server.isClosed, false);
    assert.equal(b.client.isClosed, false);
  }

  it("a connection cannot write, read or apply atomics to memory the server granted another connection, even with its exact rkey", async () => {
    const b = await join();
    const rmr = await victimGrant(b);
    const h = await join();
    const ops: [string, (a: Rdma, target: RemoteMr) => Promise<unknown>][] = [
      [
        "write",
        async (a, t) => {
          using m = h.client.allocLocalMr(SECRET.length);
          m.bytes.fill(0xee);
          await a.write(m, t);
        },
      ],
      [
        "read",
        async (a, t) => {
          using m = h.client.allocLocalMr(SECRET.length);
          try {
            await a.read(m, t);
          } finally {
            assert.ok(
              m.bytes.every((x) => x === 0),
              "the refused READ placed B's bytes in A's memory",
            );
          }
        },
      ],
      ["fetchAndAdd", (a, t) => a.fetchAndAdd(t, 1n)],
      ["compareAndSwap", (a, t) => a.compareAndSwap(t, 0n, 0xdeadn)],
      [
        "writeWithImm",
        async (a, t) => {
          using m = h.client.allocLocalMr(8);
          m.bytes.fill(0xee);
          await a.writeWithImm(m, t, 7);
        },
      ],
    ];
    let seed = 100;
    for (const [name, op] of ops) {
      const a = await attacker(h);
      await alive(a, seed++);
      await assert.rejects(op(a.client, forge(rmr.addr, rmr.length, rmr.rkey)), code("REMOTE_ACCESS"), `${name} into B's grant`);
      await victimIntact(b, rmr, (seed += 2));
    }
    // the attacker's death took nothing else with it
    await alive(h, 300);
  });

  it("memory the server lent to one connection (sendLocalMr) is out of reach of another", async () => {
    const b = await join();
    const lent = b.server.allocLocalMr(SECRET.length);
    lent.bytes.set(SECRET);
    const [, rmr] = await Promise.all([b.server.sendLocalMr(lent, { leaseMs: 120_000 }), b.client.receiveRemoteMr()]);
    const h = await join();
    for (const name of ["write", "read", "fetchAndAdd"]) {
      const a = await attacker(h);
      using m = h.client.allocLocalMr(SECRET.length);
      m.bytes.fill(0xee);
      const t = forge(rmr.addr, rmr.length, rmr.rkey);
      const p = name === "write" ? a.client.write(m, t) : name === "read" ? a.client.read(m, t) : a.client.fetchAndAdd(t, 1n);
      await assert.rejects(p, code("REMOTE_ACCESS"), `${name} into B's lent region`);
      if (name === "read") assert.ok(m.bytes.every((x) => x === 0xee));
    }
    // B still reaches the lent region, and it is intact
    using got = b.client.allocLocalMr(SECRET.length);
    await b.client.read(got, rmr);
    assert.deepEqual([...got.bytes], [...SECRET]);
    await alive(b, 500);
  });

  it("guessing rkeys and addresses around its own grant reaches nothing of another connection", async () => {
    const b = await join();
    const rmr = await victimGrant(b);
    // Each refused guess ends the guessing connection (RC: the responder QP errs), so every guess gets a
    // fresh connection with a grant of its own to derive the neighbours from, as a raw client would.
    const guesses: ((own: RemoteMr) => { addr: number; rkey: number })[] = [
      () => ({ addr: rmr.addr, rkey: rmr.rkey }),
      () => ({ addr: rmr.addr, rkey: (rmr.rkey ^ 1) >>> 0 }),
      (own) => ({ addr: rmr.addr, rkey: (own.rkey + 1) >>> 0 }),
      (own) => ({ addr: rmr.addr, rkey: (own.rkey - 1) >>> 0 }),
      (own) => ({ addr: rmr.addr, rkey: (own.rkey + 0x100) >>> 0 }),
      (own) => ({ addr: rmr.addr, rkey: (own.rkey - 0x100) >>> 0 }),
      (own) => ({ addr: rmr.addr, rkey: (own.rkey + 0x200) >>> 0 }),
      (own) => ({ addr: rmr.addr, rkey: (own.rkey - 0x200) >>> 0 }),
      (own) => ({ addr: own.addr + 4096, rkey: rmr.rkey }),
      (own) => ({ addr: own.addr - 4096, rkey: rmr.rkey }),
      (own) => ({ addr: own.addr + 65536, rkey: (own.rkey + 0x100) >>> 0 }),
      (own) => ({ addr: own.addr - 65536, rkey: (own.rkey - 0x100) >>> 0 }),
    ];
    let refused = 0;
    const h = await join();
    for (const g of guesses) {
      const a = await attacker(h);
      const own = await a.client.requestRemoteMr(SECRET.length, { timeoutMs: 60_000 });
      const { addr, rkey } = g(own);
      using m = h.client.allocLocalMr(SECRET.length);
      try {
        await a.client.read(m, forge(addr, SECRET.length, rkey));
      } catch (e) {
        code("REMOTE_ACCESS")(e);
        refused++;
      }
      assert.notDeepEqual([...m.bytes], [...SECRET], `guess addr 0x${addr.toString(16)} rkey 0x${rkey.toString(16)} read B's secret`);
    }
    assert.equal(refused, guesses.length, "every guess is refused by the device/provider");
    await victimIntact(b, rmr, 700);
  });

  it("a LocalMr or RemoteMr of another connection is INVALID_ARGUMENT at the API, and both connections live on", async () => {
    const a = await join();
    const b = await join();
    using la = a.client.allocLocalMr(8);
    using sa = a.server.allocLocalMr(8);
    const bufA = new ArrayBuffer(16);
    using ra = a.client.registerMr(bufA);
    const rmrA = await a.client.requestRemoteMr(8, { timeoutMs: 60_000 });
    const rmrB = await b.client.requestRemoteMr(8, { timeoutMs: 60_000 });
    using lb = b.client.allocLocalMr(8);
    using sb = b.server.allocLocalMr(8);
    const misuse: [string, () => Promise<unknown>][] = [
      ["client send(A's lmr) on B", () => b.client.send(la)],
      ["client sendWithImm(A's lmr) on B", () => b.client.sendWithImm(la, 1)],
      ["client write(A's lmr) on B", () => b.client.write(la, rmrB)],
      ["client read(A's lmr) on B", () => b.client.read(la.slice(0, 4), rmrB)],
      ["client writeWithImm(A's registered memory) on B", () => b.client.writeWithImm(ra, rmrB, 3)],
      ["client sendLocalMr(A's registered memory) on B", () => b.client.sendLocalMr(ra)],
      ["client write(B's lmr, A's rmr) on B", () => b.client.write(lb, rmrA)],
      ["client read(B's lmr, A's rmr) on B", () => b.client.read(lb, rmrA)],
      ["client fetchAndAdd(A's rmr) on B", () => b.client.fetchAndAdd(rmrA, 1n)],
      ["client compareAndSwap(A's rmr slice) on B", () => b.client.compareAndSwap(rmrA.slice(0, 8), 0n, 1n)],
      ["client sendRemoteMr(A's rmr) on B", () => b.client.sendRemoteMr(rmrA)],
      ["server send(A's lmr) on B", () => b.server.send(sa)],
      ["server sendLocalMr(A's lmr) on B", () => b.server.sendLocalMr(sa)],
      ["server send(B's lmr) on A", () => a.server.send(sb)],
    ];
    for (const [name, f] of misuse) {
      await assert.rejects(f(), code("INVALID_ARGUMENT"), name);
    }
    await alive(a, 900);
    await alive(b, 910);
    // A's own memory and grant still work on A
    la.bytes.set(pattern(8, 3));
    await a.client.write(la, rmrA);
    using back = a.client.allocLocalMr(8);
    await a.client.read(back, rmrA);
    assert.deepEqual([...back.bytes], [...pattern(8, 3)]);
  });

  it("newConnection() siblings share their protection domain: memory of one is usable on the other", async () => {
    const a = await join();
    const [client2, server2] = await Promise.all([a.client.newConnection(), listener.accept({ timeoutMs: 60_000 })]);
    open.push(client2, server2);
    using m = a.client.allocLocalMr(4);
    m.bytes.set([1, 2, 3, 4]);
    await client2.send(m);
    using r = await server2.receive();
    assert.deepEqual([...r.bytes], [1, 2, 3, 4]);
    // but the server's two connections are two peers' worth of isolation: a RemoteMr of one is not the other's
    const rmr = await a.client.requestRemoteMr(8, { timeoutMs: 60_000 });
    await assert.rejects(client2.write(m, rmr), code("INVALID_ARGUMENT"));
    await alive({ client: client2, server: server2 }, 1000);
  });
});
