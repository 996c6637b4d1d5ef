/**
 * Establishment against hostile peers (issue 19), on the side channel with
 * raw peers (test/support/agent-peer.ts: a QP of its own and the handshake
 * by hand), provider neutral:
 *
 * - point 5: the side channel ends with the handshake. A peer that streams
 *   lines into it afterwards (client or server role) is cut off: nothing of
 *   it is read or kept, the socket is closed, the connection lives; clients
 *   that keep finished side channels open never fill the listener's socket
 *   limit; the line reader holds at most one line and stops once it failed.
 * - point 12: a connection that fails during setup (a malformed control
 *   message sent before "ready") releases everything and never reaches
 *   accept().
 * - point 13: one source address holds at most half of the handshake slots,
 *   so a client from another address still gets through.
 *
 * The RDMA CM paths share the code that hands a connection over
 * (setup.ts startConnection) and are covered in rdmacm.test.ts and
 * auth.test.ts.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import { EventEmitter } from "node:events";
import { RdmaError, type RdmaListener } from "../../src/index.js";
import { LineReader } from "../../src/api/establish/sidechannel-wire.js";
import { MsgType } from "../../src/agent/codec.js";
import type { Device, Endpoint } from "../../src/transport/types.js";
import { CM, PROVIDER, at, builder, eventually, pattern } from "../support/api.js";
import { GID_INDEX, SLOW, deviceNames, openDevice } from "../support/seam.js";
import { RawAgentPeer } from "../support/agent-peer.js";
import { RawClient } from "../support/raw-side-channel.js";
import { Waiter, fdCount, gc, tables, type Tables } from "../support/fuzz.js";

const MiB = 2 ** 20;
const STEP_MS = 60_000 * SLOW;

function code(c: string, re?: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    if (re) assert.match(e.message, re);
    return true;
  };
}

/** Heap in use after full collections. */
async function settledHeap(): Promise<number> {
  for (let i = 0; i < 4; i++) {
    gc();
    await new Promise((r) => setImmediate(r));
  }
  return process.memoryUsage().heapUsed;
}

/**
 * Writes `line` into `sock` over and over, honouring back-pressure, until
 * the socket closes or `limit` bytes went out; returns the bytes written.
 */
async function stream(sock: net.Socket, line: string, limit: number): Promise<number> {
  const w = new Waiter();
  let closed = sock.destroyed;
  sock.on("error", () => {});
  sock.on("close", () => ((closed = true), w.poke()));
  sock.on("drain", () => w.poke());
  let sent = 0;
  // (a write that met the peer's reset destroys the socket before its "close" event)
  const gone = (): boolean => closed || sock.destroyed;
  while (!gone() && sent < limit) {
    sent += line.length;
    if (!sock.write(line)) await w.until(() => gone() || sock.writableLength === 0, "the socket to drain or close", STEP_MS);
  }
  return sent;
}

/** A stand-in for a socket that emits what the test feeds it (the reader under test sees only these events). */
class FakeSocket extends EventEmitter {
  paused = false;
  setEncoding(): this {
    return this;
  }
  pause(): this {
    this.paused = true;
    return this;
  }
  resume(): this {
    this.paused = false;
    return this;
  }
}

describe("LineReader (issue 19 point 5)", () => {
  const reader = (): { r: LineReader; s: FakeSocket } => {
    const s = new FakeSocket();
    return { r: new LineReader(s as unknown as net.Socket), s };
  };

  it("issue 19 point 5: a line without its newline fails the reader past 16 KiB, and a failed reader reads and keeps nothing more", async () => {
    const { r, s } = reader();
    const first = r.next();
    const chunk = "A".repeat(64 * 1024);
    s.emit("data", chunk);
    await assert.rejects(first, code("PROTOCOL", /too long/));
    assert.equal(s.listenerCount("data"), 0, "the failed reader stopped reading");
    assert.ok(s.paused, "the socket is paused: TCP flow control holds the peer back");
    // were anything still listening, 64 MiB more would be held
    const heap0 = await settledHeap();
    for (let i = 0; i < 1024; i++) s.emit("data", chunk);
    assert.ok((await settledHeap()) - heap0 < 16 * MiB, "nothing kept after the failure");
    await assert.rejects(r.next(), code("PROTOCOL", /too long/));
  });

  it("issue 19 point 5: lines nobody asked for pause the socket; a line that arrives a byte at a time is whole; stop() ends reading", async () => {
    const { r, s } = reader();
    s.emit("data", '{"a":1}\n{"b":2}\n');
    assert.ok(s.paused, "two lines wait for their reader: the socket is paused");
    assert.deepEqual(await r.nextJson(), { a: 1 });
    assert.deepEqual(await r.nextJson(), { b: 2 });
    const next = r.next();
    assert.ok(!s.paused, "a reader waits: the socket reads again");
    const line = JSON.stringify({ pad: "p".repeat(10_000) });
    for (const ch of line) s.emit("data", ch);
    s.emit("data", "\n");
    assert.equal(await next, line);
    r.stop();
    assert.equal(s.listenerCount("data"), 0);
    await assert.rejects(r.next(), code("CONNECTION_CLOSED"));
  });
});

describe(`establishment against hostile peers [${PROVIDER}]`, { skip: CM !== "tcp" && "raw side-channel peers (RDMA CM: rdmacm.test.ts, auth.test.ts)", timeout: 900_000 * SLOW }, () => {
  let peerDev: Device;
  /** An endpoint a server QP can be connected to (tcp: `sinks`' port for the address; verbs: a real GID). */
  let endpointFor: (from: string) => Endpoint;
  /** Hold the streams that tcp QPs set up for fake hellos dial, one per source address. */
  const sinks = new Map<string, net.Server>();
  const held = new Set<net.Socket>();

  before(async () => {
    peerDev = await openDevice(deviceNames()[1]);
    for (const a of ["127.0.0.1", "127.0.0.2"]) {
      const srv = net.createServer((x) => {
        held.add(x);
        x.on("error", () => {});
        x.on("close", () => held.delete(x));
        x.resume();
      });
      await new Promise<void>((r) => srv.listen(0, a, r));
      sinks.set(a, srv);
    }
    const l = await builder("server").bind(at(0));
    const [c, s] = await Promise.all([builder("client").connect(at(l.port)), l.accept({ timeoutMs: STEP_MS })]);
    const ep = c.conn.qp.localEndpoint({ gidIndex: GID_INDEX });
    endpointFor = (from) => (PROVIDER === "tcp" ? { ...ep, qpNum: 0x4242, gid: "0.0.0.0", port: (sinks.get(from)!.address() as net.AddressInfo).port } : { ...ep, qpNum: 0x4242 });
    await Promise.all([c.close(), s.close()]);
    await l.close();
  });

  after(async () => {
    for (const x of held) x.destroy();
    for (const srv of sinks.values()) await new Promise<void>((r) => srv.close(() => r()));
    peerDev?.close();
  });

  /** A legitimate client served end to end: accept() yields it (not some dead connection), one message each way. Returns the server's device. */
  async function legit(l: RdmaListener, seed: number): Promise<Device> {
    const [c, s] = await Promise.all([builder("client").connect(at(l.port)), l.accept({ timeoutMs: STEP_MS })]);
    try {
      using m = c.allocLocalMr(32);
      m.bytes.set(pattern(32, seed));
      await c.send(m);
      using r = await s.receive();
      assert.deepEqual([...r.bytes], [...pattern(32, seed)]);
      await s.send(r);
      using back = await c.receive();
      assert.deepEqual([...back.bytes], [...pattern(32, seed)]);
      return s.ctx.device;
    } finally {
      await Promise.all([c.close(), s.close()]);
    }
  }

  /** A well-formed line (under the 16 KiB bound: the reader would keep every one of them). */
  const LINE = JSON.stringify({ junk: "j".repeat(4096 - 20) }) + "\n";
  /** What a hostile peer streams at most (the issue: 128 MiB sent, +134 MiB of heap). */
  const LIMIT = 64 * MiB;

  describe("issue 19 point 5: the side channel ends with the handshake", () => {
    it("issue 19 point 5: a client streaming lines into its side channel after 'ready' is cut off: the server keeps nothing, closes the socket, and the connection lives", async () => {
      const l = await builder("server").bind(at(0));
      try {
        const heap0 = await settledHeap();
        const accepted = l.accept({ timeoutMs: STEP_MS });
        accepted.catch(() => {}); // awaited below unless an assertion fails first
        let sock: net.Socket | null = null;
        const p = await RawAgentPeer.connect(peerDev, l.port, { afterReady: (s) => (sock = s) });
        try {
          const sent = await stream(sock!, LINE, LIMIT);
          assert.ok(sent < LIMIT, `the server read all ${sent / MiB} MiB sent after the handshake without closing the side channel`);
          const rdma = await accepted;
          assert.ok(await p.probe(() => rdma.isClosed, STEP_MS), "the connection lives");
          await eventually(() => l.stats().sockets === 0, STEP_MS, "the server to close the side channel");
          const grown = (await settledHeap()) - heap0;
          assert.ok(grown < 16 * MiB, `the heap grew by ${(grown / MiB).toFixed(1)} MiB`);
          await rdma.close();
        } finally {
          // (a listener closes once its sockets are gone)
          (sock as net.Socket | null)?.destroy();
          p.close();
        }
      } finally {
        await l.close();
      }
    });

    it("issue 19 point 5: a server streaming lines into the side channel after the client's 'ready' is cut off: the client keeps nothing, closes the socket, and its connection works", async () => {
      const l = await builder("server").bind(at(0));
      let streamed: Promise<number> | null = null;
      const socks = new Set<net.Socket>();
      // A man in the middle that forwards the handshake, then streams lines to the client.
      const proxy = net.createServer({ allowHalfOpen: true }, (down) => {
        const up = net.connect(l.port, "127.0.0.1");
        socks.add(down).add(up);
        up.on("error", () => {});
        down.on("error", () => {});
        let seen = "";
        down.on("data", (d: Buffer) => {
          if (!up.destroyed) up.write(d);
          if (streamed) return;
          seen += d.toString("latin1");
          if (seen.includes('"ready":true')) streamed = stream(down, LINE, LIMIT);
        });
        up.on("data", (d: Buffer) => {
          if (!streamed && !down.destroyed) down.write(d);
        });
      });
      await new Promise<void>((r) => proxy.listen(0, "127.0.0.1", r));
      try {
        const heap0 = await settledHeap();
        const [c, s] = await Promise.all([builder("client").connect(`127.0.0.1:${(proxy.address() as net.AddressInfo).port}`), l.accept({ timeoutMs: STEP_MS })]);
        try {
          await eventually(() => streamed !== null, STEP_MS, "the client's ready");
          const sent = await streamed!;
          assert.ok(sent < LIMIT, `the client read all ${sent / MiB} MiB sent after the handshake without closing the side channel`);
          using m = c.allocLocalMr(32);
          m.bytes.set(pattern(32, 5));
          await c.send(m);
          using r = await s.receive();
          assert.deepEqual([...r.bytes], [...pattern(32, 5)]);
          const grown = (await settledHeap()) - heap0;
          assert.ok(grown < 16 * MiB, `the heap grew by ${(grown / MiB).toFixed(1)} MiB`);
        } finally {
          await Promise.all([c.close(), s.close()]);
        }
      } finally {
        for (const x of socks) x.destroy();
        await new Promise<void>((r) => proxy.close(() => r()));
        await l.close();
      }
    });

    it("issue 19 point 5: clients that keep their finished side channels open never fill the listener's socket limit (16 with setMaxHandshakes(1))", async () => {
      const l = await builder("server").setMaxHandshakes(1).bind(at(0));
      const kept: net.Socket[] = [];
      const fd0 = fdCount();
      try {
        for (let i = 0; i < 20; i++) {
          const accepted = l.accept({ timeoutMs: STEP_MS });
          accepted.catch(() => {}); // awaited below unless the connect fails first
          const p = await RawAgentPeer.connect(peerDev, l.port, { afterReady: (s) => void kept.push(s) });
          const rdma = await accepted;
          // the connection goes; its side channel stays open on the client's side
          p.close();
          await rdma.close();
        }
        await eventually(() => l.stats().sockets === 0, STEP_MS, "the server to close every finished side channel");
        // descriptors: the clients' sockets, none of the server's (the connections' own are closed too)
        await eventually(() => fdCount() <= fd0 + kept.length, STEP_MS, `the descriptors to come back to ${fd0} + the ${kept.length} the clients keep`).catch(() => {});
        assert.ok(fdCount() <= fd0 + kept.length, `${fdCount() - fd0} descriptors more than before, with ${kept.length} held by the clients`);
        await legit(l, 7);
      } finally {
        for (const s of kept) s.destroy();
        await l.close();
      }
    });
  });

  describe("issue 19 point 12: a connection that fails during setup", () => {
    const M = PROVIDER === "verbs" ? 30 : 200;
    it(`issue 19 point 12: ${M} clients that send a malformed control message before 'ready': everything released, none reaches accept()`, async () => {
      const l = await builder("server").setConnectTimeout(10_000 * SLOW).bind(at(0));
      try {
        const dev = await legit(l, 1);
        const same = (a: Tables, b: Tables): boolean => JSON.stringify(a) === JSON.stringify(b);
        await eventually(() => held.size === 0, STEP_MS, "earlier streams to close");
        const base = tables(dev);
        const r0 = l.stats().rejected;
        const limits = { type: MsgType.LIMITS, a: 0xffffffff, b: 0xffffffff, addr: 2 ** 40, rkey: 0xffffffff };
        const cases: [string, (p: RawAgentPeer) => void][] = [
          ["a message shorter than a header", (p) => p.sendRaw(new Uint8Array([0xee, 1, 2]))],
          ["an unknown message type", (p) => p.send({ type: 0x7e })],
          ["LIMITS, then a message shorter than a header", (p) => (p.send(limits), p.sendRaw(new Uint8Array([0xee, 1, 2])))],
        ];
        for (let i = 0; i < M; i++) {
          const [, junk] = cases[i % cases.length]!;
          const p = await RawAgentPeer.connect(peerDev, l.port, {
            beforeReady: async (q) => {
              junk(q);
              await q.whenSent();
            },
          });
          p.close();
        }
        await eventually(() => l.stats().rejected >= r0 + M && l.stats().handshakes === 0 && held.size === 0 && same(tables(dev), base), STEP_MS, "every failed setup to be refused and released").catch(() => {});
        assert.deepEqual(tables(dev), base, "contexts (PD + pool), QPs, CQs and registrations back to the baseline");
        assert.equal(l.stats().rejected, r0 + M, "every failed setup recorded as refused");
        for (const e of l.rejected.slice(-Math.min(M, 100))) assert.equal(e.code, "PROTOCOL", e.message);
        assert.equal(l.stats().connections, 0, "no connection held");
        await legit(l, 2);
      } finally {
        await l.close();
      }
    });
  });

  describe("issue 19 point 13: handshake slots are shared fairly between source addresses", () => {
    it("issue 19 point 13: one address holds at most half of the handshake slots; a client from another address still gets through", async () => {
      const l = await builder("server").setConnectTimeout(60_000 * SLOW).setMaxHandshakes(4).bind(at(0));
      const squatters: RawClient[] = [];
      try {
        const answers: Record<string, unknown>[] = [];
        // valid hellos from 127.0.0.2 that never confirm, until one is refused
        for (let i = 0; i < 4; i++) {
          const r = await RawClient.open(l.port, "127.0.0.1", "127.0.0.2");
          squatters.push(r);
          r.send({ asyncRdma: 1, provider: PROVIDER, endpoint: endpointFor("127.0.0.2"), recvDepth: 32, eagerMax: 4096 });
          const a = await r.json(STEP_MS);
          answers.push(a);
          if (typeof a.error === "string") break;
        }
        assert.equal(answers.filter((a) => a.endpoint !== undefined).length, 2, `two hellos from one address set up, then: ${JSON.stringify(answers.at(-1))}`);
        assert.match(String(answers.at(-1)?.error), /busy.*127\.0\.0\.2/);
        // a client from 127.0.0.1 is served while 127.0.0.2 holds its share
        await legit(l, 3);
        assert.equal(l.stats().handshakes, 2, "the squatters still hold their slots");
      } finally {
        for (const r of squatters) r.destroy();
        await l.close();
      }
    });
  });
});
