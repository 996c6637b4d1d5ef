/**
 * Authenticated peers (setAuth): HMAC-SHA256 challenge–response on both
 * ways of establishing a connection, before the server allocates anything.
 *
 * - the right key connects, and both sides see `rdma.peer.identity`;
 * - a wrong key, a missing key on either side, an unknown identity: AUTH_FAILED
 *   on the client, a refusal in `listener.rejected`, and nothing allocated by
 *   the server (no context fork: counted with a spy; contexts, QPs and keys
 *   at their baseline);
 * - a recorded valid proof replayed, a hello altered after it was signed: refused;
 * - a run of failed attempts costs nothing while a legitimate client is served;
 * - a server with several identities (a record, a function).
 *
 * The builder-level tests run on both connection managers (ASYNC_RDMA_CM);
 * raw clients forge side-channel lines (CM "tcp") or RDMA CM private data
 * (CM "rdmacm", verbs).
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import { RdmaBuilder, RdmaError, type Rdma, type RdmaListener } from "../../src/index.js";
import { Context, contextStats } from "../../src/api/context.js";
import { ChallengeTable, authMac } from "../../src/api/establish/auth.js";
import { CM_MAC_BYTES, CM_NONCE_BYTES, acceptMac, connectMac, decodeAuthConnect, decodeAuthRequest, decodeChallenge, decodeReject, encodeAuthConnect, encodeAuthRequest, encodeChallenge, encodeHello } from "../../src/api/establish/rdmacm-wire.js";
import { helloBytes, parseHello } from "../../src/api/establish/sidechannel-wire.js";
import { canonicalIp } from "../../src/api/establish/protocol.js";
import type { CmEvent, CmId, Endpoint } from "../../src/transport/types.js";
import type { TcpDevice } from "../../src/transport/tcp/device.js";
import { CM, HOST, PROVIDER, at, builder, eventually, pattern } from "../support/api.js";
import { GID_INDEX, SLOW, deviceNames, openDevice } from "../support/seam.js";
import { LineProxy, RawClient } from "../support/raw-side-channel.js";
import { RawAgentPeer } from "../support/agent-peer.js";
import { MsgType } from "../../src/agent/codec.js";
import { nameKey } from "../../src/agent/shares.js";

const K1 = "correct horse battery staple #1";
const K2 = new Uint8Array(32).fill(7);
const WRONG = "correct horse battery staple #2";

function code(c: string, re?: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    if (re) assert.match(e.message, re);
    return true;
  };
}

const hex = (b: Uint8Array): string => Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString("hex");

/** Context forks: the first thing a server allocates for a connection (both establishers). */
const forks = { n: 0 };
const realFork = Context.prototype.fork;
Context.prototype.fork = function (this: Context, ...args: Parameters<Context["fork"]>): Context {
  forks.n++;
  return realFork.apply(this, args);
};

let device: TcpDevice | null = null;

function counts(): { contexts: number; qps: number; keys: number } {
  return { contexts: contextStats().live, qps: device?.qps.size ?? 0, keys: device?.keys.size ?? 0 };
}

/** A client and server connection, one message each way, then closed; returns both peers. */
async function roundTrip(listener: RdmaListener, client: RdmaBuilder, seed: number): Promise<{ client: Rdma["peer"]; server: Rdma["peer"] }> {
  const [c, s] = await Promise.all([client.connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
  try {
    using m = c.allocLocalMr(32);
    m.bytes.set(pattern(32, seed));
    await c.send(m);
    using r = await s.receive();
    assert.deepEqual([...r.bytes], [...pattern(32, seed)]);
    await s.send(r);
    using back = await c.receive();
    assert.deepEqual([...back.bytes], [...pattern(32, seed)]);
    return { client: c.peer, server: s.peer };
  } finally {
    await Promise.all([c.close(), s.close()]);
  }
}

/** A connect that must fail: a connection it makes anyway (the feature broken) is closed, so the run still ends. */
function mustFail(p: Promise<Rdma>): Promise<never> {
  return p.then(async (r) => {
    await r.close();
    throw new Error(`connected as ${JSON.stringify(r.peer)}`);
  });
}

/**
 * A client that must be refused: `connect` fails with AUTH_FAILED (matching
 * `re`), the server records one more refusal (returned), and it forked no
 * context for the client at any point.
 */
async function refused(listener: RdmaListener, client: RdmaBuilder, re?: RegExp): Promise<{ client: RdmaError; server: RdmaError }> {
  const r0 = listener.stats().rejected;
  const f0 = forks.n;
  let err: RdmaError | null = null;
  await assert.rejects(mustFail(client.connect(at(listener.port))), (e: unknown) => {
    code("AUTH_FAILED", re)(e);
    err = e as RdmaError;
    return true;
  });
  await eventually(() => listener.stats().rejected === r0 + 1, 60_000 * SLOW, "the server to record the refusal");
  const rec = listener.rejected[listener.rejected.length - 1]!;
  assert.equal(rec.code, "AUTH_FAILED", rec.message);
  assert.equal(forks.n, f0, "the server allocated nothing for the refused client");
  return { client: err!, server: rec };
}

type Counts = ReturnType<typeof counts>;

/** The counts once no handshake is under way (the baseline of a test). */
async function settled(listener: RdmaListener): Promise<Counts> {
  await eventually(() => listener.stats().handshakes === 0, 60_000 * SLOW, "every handshake to end");
  return counts();
}

/** Waits until every handshake ended and the counts are back at `base` (abandoned QPs close asynchronously), then asserts it. */
async function atBaseline(listener: RdmaListener, base: Counts): Promise<void> {
  const same = (): boolean => {
    const c = counts();
    return c.contexts === base.contexts && c.qps === base.qps && c.keys === base.keys;
  };
  await eventually(() => listener.stats().handshakes === 0 && same(), 60_000 * SLOW, "the counts to come back to the baseline").catch(() => {});
  assert.deepEqual(counts(), base);
}

describe(`setAuth: argument checks [${PROVIDER}, ${CM}]`, () => {
  it("keys of at least 16 bytes, identities of at most 32 bytes, one of key and keys: INVALID_ARGUMENT otherwise", async () => {
    const bad: unknown[] = [
      undefined,
      {},
      "a key",
      { key: "short" },
      { key: new Uint8Array(15) },
      { key: 12345678901234567890 },
      { key: K1, keys: { a: K1 } },
      { key: K1, identity: "x".repeat(33) },
      { key: K1, identity: 5 },
      { key: K1, identity: "\ud800" },
      { keys: {} },
      { keys: { alice: "short" } },
      { keys: { ["é".repeat(17)]: K1 } },
      { keys: K1 },
      { keys: { alice: K1 }, identity: "alice" },
      { key: K1, secret: K1 },
    ];
    for (const b of bad) assert.throws(() => new RdmaBuilder().setAuth(b as never), code("INVALID_ARGUMENT"), JSON.stringify(b));
    // accepted: strings and bytes, an identity of 32 bytes, a record or a function, and null (off)
    new RdmaBuilder().setAuth({ key: K1 }).setAuth({ key: K2, identity: "x".repeat(32) }).setAuth({ keys: { alice: K1 } }).setAuth({ keys: () => undefined }).setAuth(null);
    // a client authenticates with one key
    await assert.rejects(new RdmaBuilder().setProvider("tcp").setAuth({ keys: { alice: K1 } }).connect("127.0.0.1:1"), code("INVALID_ARGUMENT", /one key/));
  });

  it("the key is copied: changing the caller's bytes later does not change it", async () => {
    const k = new Uint8Array(K2);
    const b = new RdmaBuilder().setAuth({ key: k });
    k.fill(0);
    const a = (b as unknown as { s: { auth: { clientKey(): Buffer } } }).s.auth;
    assert.deepEqual([...a.clientKey()], [...K2]);
  });
});

describe("auth primitives", () => {
  it("the challenge table: single use, expiring, bounded", () => {
    let t = 0;
    const tab = new ChallengeTable(3, 100, CM_NONCE_BYTES, () => t);
    const a = tab.issue("alice")!;
    assert.equal(a.length, CM_NONCE_BYTES);
    assert.equal(tab.take(a), "alice");
    assert.equal(tab.take(a), null, "used once");
    const b = tab.issue("b")!;
    tab.issue("c");
    tab.issue("d");
    assert.equal(tab.issue("e"), null, "bounded");
    t = 100;
    assert.equal(tab.take(b), null, "expired");
    assert.equal(tab.size, 0);
    assert.ok(tab.issue("f"), "room again once expired");
    assert.equal(tab.take(new Uint8Array(CM_NONCE_BYTES)), null, "unknown");
  });

  it("MACs separate their inputs (no two encodings alike) and depend on every part", () => {
    const k = Buffer.from(K1);
    const m = authMac(k, "x", "ab", "c");
    assert.notDeepEqual(m, authMac(k, "x", "a", "bc"));
    assert.notDeepEqual(m, authMac(k, "y", "ab", "c"));
    assert.notDeepEqual(m, authMac(Buffer.from(WRONG), "x", "ab", "c"));
    assert.deepEqual(m, authMac(k, "x", "ab", "c"));
  });

  it("RDMA CM auth messages fit their private data (REQ ≤ 56, REP ≤ 196, REJ ≤ 148) and round-trip", () => {
    const req1 = encodeAuthRequest("é".repeat(16));
    assert.ok(req1.length <= 56);
    const padded = new Uint8Array(56);
    padded.set(req1);
    assert.equal(decodeAuthRequest(padded), "é".repeat(16));
    assert.throws(() => decodeAuthRequest(new Uint8Array([0x61, 0x52, 0x44, 0x4d, 1, 4, 40, 0])), code("PROTOCOL"));
    const ns = new Uint8Array(CM_NONCE_BYTES).fill(1);
    const rej = encodeChallenge(ns);
    assert.ok(rej.length <= 148);
    assert.equal(hex(decodeChallenge(rej)!), hex(ns));
    assert.equal(decodeChallenge(encodeHello(1, { psn: 1, recvDepth: 32, eagerMax: 0 })), null);
    const k = Buffer.from(K1);
    const req2 = encodeAuthConnect({ psn: 5, recvDepth: 32, eagerMax: 64 }, ns, new Uint8Array(CM_NONCE_BYTES).fill(2), k, "alice", 0x42);
    assert.ok(req2.length <= 56);
    const d = decodeAuthConnect(req2);
    assert.equal(hex(d.ns), hex(ns));
    assert.equal(hex(d.mac), hex(connectMac(k, "alice", d.signed, 0x42)));
    assert.notEqual(hex(d.mac), hex(connectMac(k, "alice", d.signed, 0x43)), "the QP number is signed");
    assert.notEqual(hex(d.mac), hex(connectMac(k, "bob", d.signed, 0x42)), "the identity is signed");
    assert.equal(acceptMac(k, "alice", d.signed, encodeHello(2, { psn: 1, recvDepth: 32, eagerMax: 0 }), 1, 2).length, CM_MAC_BYTES);
    assert.ok(20 + CM_MAC_BYTES <= 196);
  });
});

describe(`authenticated connections [${PROVIDER}, ${CM}]`, { timeout: 900_000 }, () => {
  let open: RdmaListener;
  let shared: RdmaListener;
  let multi: RdmaListener;
  const lookups: string[] = [];

  before(async () => {
    open = await builder("server").bind(at(0));
    shared = await builder("server").setAuth({ key: K1 }).bind(at(0));
    multi = await builder("server")
      .setAuth({ keys: { alice: K1, bob: K2 } })
      .bind(at(0));
    // the tcp device (one per process): its QP and key tables show what a refused client cost
    const [c, s] = await Promise.all([builder("client").connect(at(open.port)), open.accept({ timeoutMs: 60_000 })]);
    if (PROVIDER === "tcp") device = c.ctx.device as TcpDevice;
    await Promise.all([c.close(), s.close()]);
  });

  after(async () => {
    await Promise.all([open.close(), shared.close(), multi.close()]);
  });

  it("the right key connects; both sides see the identity and address in rdma.peer", async () => {
    const p = await roundTrip(shared, builder("client").setAuth({ key: K1, identity: "alice" }), 1);
    assert.equal(p.client.identity, "alice");
    assert.equal(p.server.identity, "alice");
    assert.equal(p.client.address, canonicalIp(HOST));
    assert.equal(p.client.port, shared.port);
    assert.ok(net.isIP(p.server.address), p.server.address);
    assert.ok(p.server.port > 0);
    // no identity named: the empty one
    const q = await roundTrip(shared, builder("client").setAuth({ key: K1 }), 2);
    assert.equal(q.client.identity, "");
    assert.equal(q.server.identity, "");
    // unauthenticated: null on both sides
    const u = await roundTrip(open, builder("client"), 3);
    assert.equal(u.client.identity, null);
    assert.equal(u.server.identity, null);
    assert.equal(u.client.port, open.port);
  });

  it("newConnection() authenticates again, with the same identity", async () => {
    const [c, s] = await Promise.all([builder("client").setAuth({ key: K2, identity: "bob" }).connect(at(multi.port)), multi.accept({ timeoutMs: 60_000 })]);
    try {
      const [c2, s2] = await Promise.all([c.newConnection(), multi.accept({ timeoutMs: 60_000 })]);
      assert.equal(c2.peer.identity, "bob");
      assert.equal(s2.peer.identity, "bob");
      await Promise.all([c2.close(), s2.close()]);
    } finally {
      await Promise.all([c.close(), s.close()]);
    }
  });

  it("a wrong key: AUTH_FAILED on the client, the refusal recorded, nothing allocated by the server", async () => {
    const base = await settled(shared);
    const r = await refused(shared, builder("client").setAuth({ key: WRONG, identity: "alice" }));
    assert.doesNotMatch(r.client.message, new RegExp(WRONG));
    await atBaseline(shared, base);
  });

  it("a client with a key refuses a server without one: AUTH_FAILED", async () => {
    const base = await settled(open);
    await refused(open, builder("client").setAuth({ key: K1, identity: "alice" }), /does not authenticate/);
    await atBaseline(open, base);
  });

  it("a server with a key refuses a client without one: AUTH_FAILED naming setAuth", async () => {
    const base = await settled(shared);
    await refused(shared, builder("client"), /requires authentication.*setAuth/);
    await atBaseline(shared, base);
  });

  it("several identities (a record): each with its own key; a wrong key and an unknown identity get the same answer", async () => {
    assert.equal((await roundTrip(multi, builder("client").setAuth({ key: K1, identity: "alice" }), 4)).server.identity, "alice");
    assert.equal((await roundTrip(multi, builder("client").setAuth({ key: K2, identity: "bob" }), 5)).server.identity, "bob");
    const wrong = await refused(multi, builder("client").setAuth({ key: K2, identity: "alice" }));
    const unknown = await refused(multi, builder("client").setAuth({ key: K1, identity: "carol" }));
    const anon = await refused(multi, builder("client").setAuth({ key: K1 }));
    // the client learns nothing about which identities exist
    const strip = (e: RdmaError, id: string) => e.message.replace(JSON.stringify(id), '"?"');
    assert.equal(strip(unknown.client, "carol"), strip(wrong.client, "alice"));
    assert.equal(strip(anon.client, ""), strip(wrong.client, "alice"));
    // the server's own record says which
    assert.match(unknown.server.message, /unknown identity/);
    assert.doesNotMatch(wrong.server.message, /unknown identity/);
  });

  it("several identities (a function): looked up by the identity the client names", async () => {
    const l = await builder("server")
      .setAuth({
        keys: (id) => {
          lookups.push(id);
          return id === "dave" ? K2 : id === "broken" ? "short" : undefined;
        },
      })
      .bind(at(0));
    try {
      assert.equal((await roundTrip(l, builder("client").setAuth({ key: K2, identity: "dave" }), 6)).server.identity, "dave");
      assert.ok(lookups.includes("dave"));
      const w = await refused(l, builder("client").setAuth({ key: K1, identity: "dave" }));
      const u = await refused(l, builder("client").setAuth({ key: K2, identity: "erin" }));
      const b = await refused(l, builder("client").setAuth({ key: K2, identity: "broken" }));
      assert.match(b.server.message, /key lookup/);
      assert.equal(u.client.message.replace('"erin"', ""), w.client.message.replace('"dave"', ""));
    } finally {
      await l.close();
    }
  });

  it("many failed attempts in a row cost nothing; a legitimate client is served in between", async () => {
    const N = PROVIDER === "verbs" ? 24 : 150;
    const BATCH = PROVIDER === "verbs" ? 4 : 25;
    const base = await settled(multi);
    const f0 = forks.n;
    let served = 0;
    const attackers = [
      () => builder("client").setAuth({ key: WRONG, identity: "alice" }),
      () => builder("client").setAuth({ key: K1, identity: "mallory" }),
      () => builder("client"),
    ];
    const r0 = multi.stats().rejected;
    for (let done = 0; done < N; done += BATCH) {
      const batch = Array.from({ length: BATCH }, (_, i) => assert.rejects(mustFail(attackers[(done + i) % attackers.length]!().connect(at(multi.port))), code("AUTH_FAILED")));
      await Promise.all([...batch, roundTrip(multi, builder("client").setAuth({ key: K1, identity: "alice" }), 100 + served++)]);
    }
    await eventually(() => multi.stats().rejected === r0 + N, 60_000 * SLOW, "every refusal to be recorded");
    assert.equal(forks.n - f0, served, "the server forked a context for the legitimate clients only");
    await atBaseline(multi, base);
  });

  describe("raw side-channel clients", { skip: CM !== "tcp" && "side channel (the RDMA CM raw clients are below)" }, () => {
    /** A hello a raw client can send: a real client's endpoint (the raw client never connects its QP). */
    let endpoint: Endpoint;
    before(async () => {
      const [c, s] = await Promise.all([builder("client").connect(at(open.port)), open.accept({ timeoutMs: 60_000 })]);
      const ep = c.conn.qp.localEndpoint({ gidIndex: GID_INDEX });
      endpoint = PROVIDER === "tcp" ? { ...ep, qpNum: 0x4242, gid: "0.0.0.0" } : { ...ep, qpNum: 0x4242 };
      await Promise.all([c.close(), s.close()]);
    });

    const helloOf = (extra: Record<string, unknown> = {}): Record<string, unknown> => ({ asyncRdma: 1, provider: PROVIDER, endpoint, recvDepth: 32, eagerMax: 4096, ...extra });

    /** The client proof a raw client with `key` computes for `signed` (the hello it claims). */
    function proofOf(key: string | Uint8Array, identity: string, nc: Buffer, challenge: Record<string, unknown>, signed: Record<string, unknown>): string {
      const ns = Buffer.from((challenge.challenge as { nonce: string }).nonce, "base64");
      return authMac(Buffer.from(key), "side-channel client proof", identity, nc, ns, helloBytes(parseHello(signed, PROVIDER))).toString("base64");
    }

    it("issue 19 point 11: an MR_OPEN sent before 'ready' is judged with the proven identity: allow(peer) is never called without it", async () => {
      const l = await builder("server")
        .setAuth({ keys: { guest: K1, admin: K2 } })
        .bind(at(0));
      const dev = await openDevice(deviceNames()[1]);
      const seen: unknown[] = [];
      try {
        // a deny-list: everyone but the guest
        l.share("secret", l.allocLocalMr(64), { allow: (peer) => (seen.push(peer), peer?.identity !== "guest") });
        const token = 7;
        const accepted = l.accept({ timeoutMs: 60_000 });
        const p = await RawAgentPeer.connect(dev, l.port, {
          auth: { key: K1, identity: "guest" },
          // the open reaches the server before the connection is confirmed
          beforeReady: async (q) => {
            q.send({ type: MsgType.MR_OPEN, token, hash: nameKey("secret").hash });
            await q.whenSent();
          },
        });
        const rdma = await accepted;
        try {
          await p.w.until(() => p.denies.has(token) || (p.receivedByType.get(MsgType.MR_SHARED) ?? 0) > 0 || p.dead !== null, "the answer to the open", 60_000 * SLOW);
          assert.ok(seen.length > 0, "allow was asked");
          for (const peer of seen) {
            assert.ok(peer !== null && typeof peer === "object", `allow was called with ${String(peer)}`);
            assert.equal((peer as { identity: unknown }).identity, "guest");
          }
          assert.equal(p.receivedByType.get(MsgType.MR_SHARED) ?? 0, 0, "the guest did not get the share");
          assert.ok(p.denies.has(token), "the guest's open was refused");
          assert.equal(rdma.peer.identity, "guest");
        } finally {
          p.close();
          await rdma.close();
        }
      } finally {
        await l.close();
        dev.close();
      }
    });

    it("a recorded valid exchange, replayed verbatim, is refused before anything is allocated", async () => {
      // record a legitimate client's lines through a proxy
      const proxy = await LineProxy.start(shared.port);
      try {
        const [c, s] = await Promise.all([builder("client").setAuth({ key: K1, identity: "alice" }).connect(`127.0.0.1:${proxy.port}`), shared.accept({ timeoutMs: 60_000 })]);
        await Promise.all([c.close(), s.close()]);
      } finally {
        await proxy.close();
      }
      const up = proxy.lines.filter((l) => l.dir === "up").map((l) => l.line);
      assert.equal(up.length, 3, "hello, proof, ready");
      assert.ok((JSON.parse(up[1]!) as { proof?: string }).proof);
      const base = await settled(shared);
      const f0 = forks.n;
      const r0 = shared.stats().rejected;
      const raw = await RawClient.open(shared.port);
      try {
        raw.send(up[0]! + "\n");
        const ch = await raw.json();
        assert.ok(ch.challenge, "a fresh challenge");
        raw.send(up[1]! + "\n");
        const answer = await raw.json();
        assert.equal(answer.code, "AUTH_FAILED");
        assert.equal(answer.endpoint, undefined);
        await raw.closedByServer();
      } finally {
        raw.destroy();
      }
      await eventually(() => shared.stats().rejected === r0 + 1, 60_000, "the refusal to be recorded");
      code("AUTH_FAILED")(shared.rejected[shared.rejected.length - 1]);
      assert.equal(forks.n, f0);
      await atBaseline(shared, base);
    });

    it("a proof made for another hello than the one sent (a hello altered after signing) is refused before allocation", async () => {
      const base = await settled(shared);
      const f0 = forks.n;
      for (const altered of [{ recvDepth: 64 }, { eagerMax: 0 }, { maxRdAtomic: 1 }, { endpoint: { ...endpoint, psn: (endpoint.psn + 1) & 0xffffff } }]) {
        const raw = await RawClient.open(shared.port);
        try {
          const nc = Buffer.alloc(16, 9);
          const signed = helloOf({ auth: { identity: "alice", nonce: nc.toString("base64") } });
          const sent = { ...signed, ...altered };
          raw.send(sent);
          const ch = await raw.json();
          raw.send({ proof: proofOf(K1, "alice", nc, ch, signed) });
          const answer = await raw.json();
          assert.equal(answer.code, "AUTH_FAILED", JSON.stringify(altered));
          assert.equal(answer.endpoint, undefined);
        } finally {
          raw.destroy();
        }
      }
      // the same raw client, honest, is served: the refusals above were the alterations
      const raw = await RawClient.open(shared.port);
      try {
        const nc = Buffer.alloc(16, 3);
        const h = helloOf({ auth: { identity: "alice", nonce: nc.toString("base64") } });
        raw.send(h);
        raw.send({ proof: proofOf(K1, "alice", nc, await raw.json(), h) });
        assert.ok((await raw.json()).endpoint, "the honest raw client gets the server's hello");
        assert.equal(forks.n, f0 + 1);
      } finally {
        raw.destroy();
      }
      await atBaseline(shared, base);
    });

    it("a man in the middle altering either hello: the client refuses (AUTH_FAILED)", async () => {
      const base = await settled(shared);
      for (const [dir, field] of [
        ["up", "recvDepth"],
        ["down", "recvDepth"],
        ["down", "psn"],
      ] as const) {
        const f0 = forks.n;
        const proxy = await LineProxy.start(shared.port, (d, line, i) => {
          if (d !== dir || i !== (dir === "up" ? 0 : 1)) return line;
          const v = JSON.parse(line) as Record<string, unknown> & { endpoint: Record<string, number> };
          if (field === "psn") v.endpoint.psn = (v.endpoint.psn! + 1) & 0xffffff;
          else v.recvDepth = 64;
          return JSON.stringify(v);
        });
        try {
          await assert.rejects(mustFail(builder("client").setAuth({ key: K1, identity: "alice" }).connect(`127.0.0.1:${proxy.port}`)), code("AUTH_FAILED", dir === "up" ? /did not prove/ : /failed its authentication/));
        } finally {
          await proxy.close();
        }
        // altering the client's hello is caught before the server allocates
        if (dir === "up") assert.equal(forks.n, f0);
      }
      await atBaseline(shared, base);
    });

    it("a server of the format before authentication (a hello, no challenge): AUTH_FAILED, never a hang", async () => {
      const before = await settled(open);
      const srv = net.createServer((s) => {
        s.on("error", () => {});
        s.once("data", () => s.write(JSON.stringify({ ...helloOf(), endpoint: { ...endpoint, gid: "0.0.0.0" } }) + "\n"));
      });
      await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
      try {
        await assert.rejects(mustFail(builder("client").setAuth({ key: K1 }).connect(`127.0.0.1:${(srv.address() as net.AddressInfo).port}`)), code("AUTH_FAILED", /did not authenticate itself/));
      } finally {
        await new Promise<void>((r) => srv.close(() => r()));
      }
      // the client freed what it set up
      await atBaseline(open, before);
    });

    it("an impostor server without the key (a challenge with a made-up proof): the client refuses it and sends no proof", async () => {
      const before = await settled(open);
      const got: string[] = [];
      const srv = net.createServer((s) => {
        s.on("error", () => {});
        s.setEncoding("utf8");
        s.on("data", (d: string) => {
          got.push(...d.split("\n").filter(Boolean));
          if (got.length === 1) s.write(JSON.stringify({ asyncRdma: 1, challenge: { nonce: Buffer.alloc(16, 4).toString("base64"), proof: Buffer.alloc(32, 5).toString("base64") } }) + "\n");
        });
      });
      await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
      try {
        await assert.rejects(mustFail(builder("client").setAuth({ key: K1, identity: "alice" }).connect(`127.0.0.1:${(srv.address() as net.AddressInfo).port}`)), code("AUTH_FAILED", /did not prove it has the key/));
      } finally {
        await new Promise<void>((r) => srv.close(() => r()));
      }
      assert.ok(got.length >= 1);
      for (const l of got.slice(1)) assert.equal((JSON.parse(l) as { proof?: unknown }).proof, undefined, "the client gave the impostor no proof");
      await atBaseline(open, before);
    });

    it("a client that stops after the challenge holds nothing, and is recorded when its connect timeout ends", async () => {
      const l = await builder("server").setAuth({ key: K1 }).setConnectTimeout(300 * SLOW).bind(at(0));
      try {
        const raw = await RawClient.open(l.port);
        const f0 = forks.n;
        try {
          raw.send(helloOf({ auth: { identity: "", nonce: Buffer.alloc(16).toString("base64") } }));
          assert.ok((await raw.json()).challenge);
          await raw.closedByServer();
        } finally {
          raw.destroy();
        }
        await eventually(() => l.stats().rejected === 1, 60_000, "the refusal to be recorded");
        code("AUTH_FAILED", /did not complete authentication/)(l.rejected[0]);
        assert.equal(forks.n, f0);
      } finally {
        await l.close();
      }
    });
  });

  describe("raw RDMA CM clients", { skip: CM !== "rdmacm" && "RDMA CM (verbs; the side-channel raw clients are above)" }, () => {
    type CmModule = typeof import("../../src/transport/verbs/cm.js");
    let cm: CmModule;
    before(async () => {
      cm = await import("../../src/transport/verbs/cm.js");
    });
    const QPN = 0x123;
    const params = { responderResources: 1, initiatorDepth: 1, retryCount: 7, rnrRetryCount: 7 };

    /** A raw CM id dialing `port` with `pdata`; returns its first event after the connect (the caller destroys the id). */
    async function dial(port: number, pdata: Uint8Array, qpn = QPN): Promise<{ id: CmId; ev: CmEvent }> {
      const id = cm.CmId.create();
      try {
        id.resolveAddr(null, HOST, port, 2000 * SLOW);
        assert.equal((await id.next("resolve addr", 5000 * SLOW)).name, "ADDR_RESOLVED");
        id.resolveRoute(2000 * SLOW);
        assert.equal((await id.next("resolve route", 5000 * SLOW)).name, "ROUTE_RESOLVED");
        id.connect(qpn, pdata, params);
        return { id, ev: await id.next("connect", 10_000 * SLOW) };
      } catch (e) {
        id.destroy();
        throw e;
      }
    }

    async function challengeFor(port: number, identity: string): Promise<Uint8Array> {
      const { id, ev } = await dial(port, encodeAuthRequest(identity));
      id.destroy();
      assert.equal(ev.name, "REJECTED");
      const ns = decodeChallenge(ev.privateData);
      assert.ok(ns, "a challenge");
      return ns;
    }

    const hello = { psn: 7, recvDepth: 32, eagerMax: 4096 };

    function refusedWith(ev: CmEvent, re: RegExp): void {
      assert.equal(ev.name, "REJECTED");
      const r = decodeReject(ev.privateData);
      assert.ok(r, "our reject");
      assert.equal(r.code, 3, r.reason);
      assert.match(r.reason, re);
    }

    it("a recorded valid REQ, replayed (alone, or after a fresh challenge), is refused before anything is allocated", async () => {
      const ns = await challengeFor(shared.port, "alice");
      const req = encodeAuthConnect(hello, ns, new Uint8Array(CM_NONCE_BYTES).fill(5), Buffer.from(K1), "alice", QPN);
      // the original is valid: the server accepts it (its REP proves it has the key), then we walk away
      const first = await dial(shared.port, req);
      try {
        assert.equal(first.ev.name, "CONNECT_RESPONSE");
        const rep = first.ev.privateData!;
        assert.equal(hex(rep.subarray(20, 20 + CM_MAC_BYTES)), hex(acceptMac(Buffer.from(K1), "alice", req.subarray(0, 36), rep, first.ev.conn!.qpNum, QPN)), "the server proves it has the key");
        first.id.reject(null);
      } finally {
        first.id.destroy();
      }
      const base = await settled(shared);
      const f0 = forks.n;
      const r0 = shared.stats().rejected;
      const again = await dial(shared.port, req);
      again.id.destroy();
      refusedWith(again.ev, /unknown, expired or already used/);
      await challengeFor(shared.port, "alice");
      const third = await dial(shared.port, req);
      third.id.destroy();
      refusedWith(third.ev, /unknown, expired or already used/);
      assert.equal(forks.n, f0);
      await eventually(() => shared.stats().rejected >= r0 + 2, 60_000 * SLOW, "the refusals to be recorded");
      await atBaseline(shared, base);
    });

    it("a REQ altered after signing (hello fields, QP number), or signed with a wrong key, is refused before allocation", async () => {
      const base = await settled(shared);
      const f0 = forks.n;
      const k = Buffer.from(K1);
      const cases: [string, (req: Uint8Array) => Uint8Array, number, Buffer][] = [
        ["recvDepth", (r) => (r[15]! ^= 1, r), QPN, k],
        ["psn", (r) => (r[11]! ^= 1, r), QPN, k],
        ["client nonce", (r) => (r[30]! ^= 1, r), QPN, k],
        ["QP number", (r) => r, QPN + 1, k],
        ["wrong key", (r) => r, QPN, Buffer.from(WRONG)],
      ];
      for (const [what, alter, qpn, key] of cases) {
        const ns = await challengeFor(shared.port, "alice");
        const req = alter(encodeAuthConnect(hello, ns, new Uint8Array(CM_NONCE_BYTES).fill(1), key, "alice", QPN));
        const { id, ev } = await dial(shared.port, req, qpn);
        id.destroy();
        assert.equal(ev.name, "REJECTED", what);
        refusedWith(ev, /wrong key or unknown identity/);
      }
      assert.equal(forks.n, f0);
      await atBaseline(shared, base);
    });

    it("an impostor server without the key (a challenge, then an accept with a made-up proof): the client refuses it", async () => {
      const before = await settled(open);
      const lid = cm.CmId.create();
      const children: CmId[] = [];
      lid.bind(HOST, 0);
      lid.listen(8);
      lid.onEvent = (e) => {
        if (!e.child) return;
        children.push(e.child);
        if (e.privateData?.[5] === 4) e.child.reject(encodeChallenge(new Uint8Array(CM_NONCE_BYTES).fill(3)));
        else {
          const rep = new Uint8Array(20 + CM_MAC_BYTES);
          rep.set(encodeHello(2, { psn: 9, recvDepth: 32, eagerMax: 4096 }));
          e.child.accept(0x321, rep, params);
        }
      };
      try {
        await assert.rejects(mustFail(builder("client").setAuth({ key: K1, identity: "alice" }).connect(at(lid.info().localPort))), code("AUTH_FAILED", /did not prove it has the key/));
      } finally {
        for (const c of children) c.destroy();
        lid.destroy();
      }
      assert.equal(children.length, 2, "the client asked for a challenge, then answered it");
      await atBaseline(open, before);
    });

    it("issue 19 point 13: a forged REQ with a client's challenge nonce (an eavesdropper's) does not use the nonce up: the client's own REQ is accepted", async () => {
      const ns = await challengeFor(shared.port, "alice");
      const f0 = forks.n;
      // the eavesdropper saw the nonce, not the key: its MAC is wrong
      const forged = await dial(shared.port, encodeAuthConnect(hello, ns, new Uint8Array(CM_NONCE_BYTES).fill(9), Buffer.from(WRONG), "alice", QPN));
      forged.id.destroy();
      refusedWith(forged.ev, /wrong key or unknown identity/);
      assert.equal(forks.n, f0, "nothing allocated for the forgery");
      // the client the nonce was issued to answers it: accepted
      const req = encodeAuthConnect(hello, ns, new Uint8Array(CM_NONCE_BYTES).fill(5), Buffer.from(K1), "alice", QPN);
      const mine = await dial(shared.port, req);
      try {
        assert.equal(mine.ev.name, "CONNECT_RESPONSE", `the client's own REQ: ${mine.ev.name} ${JSON.stringify(decodeReject(mine.ev.privateData))}`);
        mine.id.reject(null);
      } finally {
        mine.id.destroy();
      }
      // once used, the nonce is spent
      const again = await dial(shared.port, req);
      again.id.destroy();
      refusedWith(again.ev, /unknown, expired or already used/);
      await settled(shared);
    });

    it("outstanding challenges are bounded (16 × maxHandshakes): past that, busy", async () => {
      const l = await builder("server").setAuth({ key: K1 }).setMaxHandshakes(1).setConnectTimeout(600_000).bind(at(0));
      try {
        for (let i = 0; i < 16; i++) await challengeFor(l.port, "");
        const { id, ev } = await dial(l.port, encodeAuthRequest(""));
        id.destroy();
        assert.equal(ev.name, "REJECTED");
        const r = decodeReject(ev.privateData);
        assert.equal(r?.code, 1);
        assert.match(r!.reason, /busy/);
      } finally {
        await l.close();
      }
    });
  });
});
