/**
 * The side channel against hostile clients (issue 9, points 4 and 5):
 *
 * - the server dials only the side channel's peer: a tcp hello naming any
 *   other host is refused (PROTOCOL) before anything is allocated; a verbs
 *   hello must name a unicast GID in IPv6 form; the client applies the same
 *   rule to the server's reply;
 * - handshakes abandoned at every stage (no hello, garbage, a valid hello then
 *   silence until the connect timeout, a hello then a bad or no "ready") give
 *   back everything they allocated — contexts (PD + pool), QPs, registered
 *   memory — while a legitimate client is served throughout.
 *
 * Side channel only (the RDMA CM paths are in rdmacm.test.ts).
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import v8 from "node:v8";
import vm from "node:vm";
import { RdmaError, type RdmaListener } from "../../src/index.js";
import { contextStats } from "../../src/api/context.js";
import type { Endpoint } from "../../src/transport/types.js";
import type { TcpDevice } from "../../src/transport/tcp/device.js";
import { CM, PROVIDER, at, builder, eventually, pattern } from "../support/api.js";
import { GID_INDEX } from "../support/seam.js";
import { Connection } from "../../src/agent/connection.js";

v8.setFlagsFromString("--expose-gc");
const gc = vm.runInNewContext("gc") as () => void;

/** Connect timeout of the server under attack: silent handshakes end after this. */
const TIMEOUT_MS = 1500;
/** Abandoned handshakes per stage (the issue measured 1,500); fewer on emulated rxe, where a QP costs more. */
const N = Number(process.env.ABANDON_N ?? (PROVIDER === "verbs" ? 100 : 1000));
const BATCH = PROVIDER === "verbs" ? 25 : 250;

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

/** A raw side-channel client: lines in, with a deadline on each wait. */
class Raw {
  readonly sock: net.Socket;
  private buf = "";
  private closed = false;
  private wake: (() => void) | null = null;

  private constructor(sock: net.Socket) {
    this.sock = sock;
    sock.setEncoding("utf8");
    sock.on("data", (d: string) => {
      this.buf += d;
      this.wake?.();
    });
    sock.on("error", () => {});
    sock.on("close", () => {
      this.closed = true;
      this.wake?.();
    });
  }

  /** `from`: the local address (another loopback address is another source to the server). */
  static open(port: number, from?: string): Promise<Raw> {
    return new Promise((resolve, reject) => {
      const s = net.connect({ port, host: "127.0.0.1", ...(from === undefined ? {} : { localAddress: from }) });
      s.once("connect", () => resolve(new Raw(s)));
      s.once("error", reject);
    });
  }

  write(line: string): void {
    this.sock.write(line);
  }

  /** The next line from the server, or null when it closed first. */
  async line(ms = 60_000): Promise<string | null> {
    const end = performance.now() + ms;
    for (;;) {
      const i = this.buf.indexOf("\n");
      if (i >= 0) {
        const l = this.buf.slice(0, i);
        this.buf = this.buf.slice(i + 1);
        return l;
      }
      if (this.closed) return null;
      const left = end - performance.now();
      if (left <= 0) throw new Error(`no line from the server within ${ms} ms`);
      await new Promise<void>((r) => {
        const t = setTimeout(r, left);
        this.wake = () => {
          clearTimeout(t);
          r();
        };
      });
      this.wake = null;
    }
  }

  /** Resolves once the server closed the side channel. */
  async closedByServer(ms = 60_000): Promise<void> {
    while ((await this.line(ms)) !== null) {
      /* drain */
    }
  }

  destroy(): void {
    this.sock.destroy();
  }
}

function helloLine(endpoint: Record<string, unknown> | Endpoint, extra: Record<string, unknown> = {}): string {
  return JSON.stringify({ asyncRdma: 1, provider: PROVIDER, endpoint, recvDepth: 32, eagerMax: 4096, ...extra }) + "\n";
}

/** A legitimate client served end to end: connect, one message each way, close. */
let slowestLegit = 0;

async function legit(listener: RdmaListener, seed: number): Promise<void> {
  const t0 = performance.now();
  const [c, s] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
  slowestLegit = Math.max(slowestLegit, performance.now() - t0);
  try {
    using m = c.allocLocalMr(32);
    m.bytes.set(pattern(32, seed));
    await c.send(m);
    using r = await s.receive();
    assert.deepEqual([...r.bytes], [...pattern(32, seed)]);
    await s.send(r);
    using back = await c.receive();
    assert.deepEqual([...back.bytes], [...pattern(32, seed)]);
  } finally {
    await Promise.all([c.close(), s.close()]);
  }
}

interface Counts {
  contexts: number;
  qps: number;
  keys: number;
}

describe(`side channel against hostile clients [${PROVIDER}]`, { skip: CM !== "tcp" && "side-channel handshake (RDMA CM: rdmacm.test.ts)", timeout: 600_000 }, () => {
  let listener: RdmaListener;
  /** A TCP port that accepts and holds streams (what a tcp QP named in a fake hello dials). */
  let sink: net.Server;
  const held = new Set<net.Socket>();
  /** An endpoint that a QP can be connected to: the sink on tcp, a real QP's GID on verbs. */
  let validEndpoint: Endpoint;
  let device: TcpDevice | null = null;

  function counts(): Counts {
    return { contexts: contextStats().live, qps: device?.qps.size ?? 0, keys: device?.keys.size ?? 0 };
  }

  before(async () => {
    // One source address holds at most half of the handshake slots (issue 19 point 13): room for a
    // whole batch of abandoned handshakes and the legitimate client, all from 127.0.0.1.
    listener = await builder("server").setConnectTimeout(TIMEOUT_MS).setMaxHandshakes(4 * BATCH).bind(at(0));
    sink = net.createServer((s) => {
      held.add(s);
      s.on("error", () => {});
      s.on("close", () => held.delete(s));
      s.resume();
    });
    await new Promise<void>((r) => sink.listen(0, "127.0.0.1", r));
    const [c, s] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
    const ep = c.conn.qp.localEndpoint({ gidIndex: GID_INDEX });
    validEndpoint = PROVIDER === "tcp" ? { ...ep, qpNum: 0x4242, gid: "0.0.0.0", port: (sink.address() as net.AddressInfo).port } : { ...ep, qpNum: 0x4242 };
    if (PROVIDER === "tcp") device = c.ctx.device as TcpDevice;
    await Promise.all([c.close(), s.close()]);
  });

  after(async () => {
    await listener.close();
    for (const s of held) s.destroy();
    await new Promise<void>((r) => sink.close(() => r()));
  });

  describe("the server dials only the side channel's peer", () => {
    const foreign =
      PROVIDER === "tcp"
        ? ["127.0.0.2", "10.255.255.1", "::1", "::ffff:127.0.0.2", "localhost", "example.com", "127.0.0.1.nip.io", ""]
        : ["not-a-gid", "10.0.0.1", "::", "ff02::1", "ff0e::1:2", ""];
    for (const gid of foreign) {
      it(`a hello naming ${JSON.stringify(gid)} is refused (PROTOCOL) before anything is allocated`, async () => {
        const before = counts();
        const rejected = listener.stats().rejected;
        const r = await Raw.open(listener.port);
        try {
          r.write(helloLine({ ...validEndpoint, gid }));
          const answer = await r.line();
          assert.ok(answer !== null, "the server answers");
          const msg = JSON.parse(answer) as { error?: string; endpoint?: unknown };
          assert.equal(msg.endpoint, undefined, "no endpoint: the server did not set up a connection");
          assert.equal(typeof msg.error, "string");
          // answered before any resource was allocated, and nothing was allocated since
          assert.deepEqual(counts(), before);
          await r.closedByServer();
        } finally {
          r.destroy();
        }
        await eventually(() => listener.stats().rejected === rejected + 1, 60_000, "the refusal to be recorded");
        const e = listener.rejected[listener.rejected.length - 1];
        code("PROTOCOL")(e);
        assert.deepEqual(counts(), before);
      });
    }

    it("a hello naming the peer's own address, or a wildcard, is accepted", { skip: PROVIDER !== "tcp" && "tcp addresses" }, async () => {
      for (const gid of ["127.0.0.1", "::ffff:127.0.0.1", "0.0.0.0", "::"]) {
        const r = await Raw.open(listener.port);
        try {
          r.write(helloLine({ ...validEndpoint, gid }));
          const answer = await r.line();
          assert.ok(answer !== null);
          const msg = JSON.parse(answer) as { error?: string; endpoint?: unknown };
          assert.equal(msg.error, undefined, `gid ${gid}: ${msg.error}`);
          assert.ok(msg.endpoint);
        } finally {
          r.destroy();
        }
      }
      await eventually(() => listener.stats().handshakes === 0, 60_000, "the abandoned handshakes to end");
    });

    it("other hello misfits are refused before allocation: provider, endpoint provider, port, mtu", async () => {
      const other = PROVIDER === "tcp" ? "verbs" : "tcp";
      const bad = [
        helloLine(validEndpoint, { provider: other }),
        helloLine({ ...validEndpoint, provider: other }),
        helloLine({ ...validEndpoint, mtu: 1000 }),
        helloLine({ ...validEndpoint, qpNum: -1 }),
        helloLine({ ...validEndpoint, port: PROVIDER === "tcp" ? 0 : 70000 }),
        helloLine(validEndpoint, { recvDepth: 1 }),
        JSON.stringify({ asyncRdma: 1, provider: PROVIDER, endpoint: [1, 2], recvDepth: 32, eagerMax: 0 }) + "\n",
      ];
      for (const line of bad) {
        const before = counts();
        const r = await Raw.open(listener.port);
        try {
          r.write(line);
          const answer = await r.line();
          assert.ok(answer !== null);
          assert.equal(typeof (JSON.parse(answer) as { error?: string }).error, "string", line);
          assert.deepEqual(counts(), before, line);
        } finally {
          r.destroy();
        }
      }
    });

    it("the client refuses a server reply naming another host, and frees what it set up", { skip: PROVIDER !== "tcp" && "tcp addresses" }, async () => {
      const before = counts();
      const fake = net.createServer((s) => {
        s.on("error", () => {});
        s.once("data", () => s.write(helloLine({ ...validEndpoint, gid: "127.0.0.2" })));
      });
      await new Promise<void>((r) => fake.listen(0, "127.0.0.1", r));
      try {
        await assert.rejects(builder("client").connect(`127.0.0.1:${(fake.address() as net.AddressInfo).port}`), (e: unknown) => code("PROTOCOL")(e) && /only the side channel's peer/.test((e as Error).message));
      } finally {
        await new Promise<void>((r) => fake.close(() => r()));
      }
      assert.deepEqual(counts(), before);
    });
  });

  describe("abandoned handshakes give back everything", () => {
    type Stage = [string, (r: Raw) => Promise<void>];
    const valid = (): string => helloLine(validEndpoint);
    const stages: Stage[] = [
      ["connect, then close (no hello)", async (r) => r.destroy()],
      ["connect, then silence until the connect timeout", (r) => r.closedByServer()],
      [
        "garbage instead of a hello",
        async (r) => {
          r.write("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
          await r.closedByServer();
        },
      ],
      [
        "a valid hello, then close",
        async (r) => {
          r.write(valid());
          assert.ok(await r.line());
          r.destroy();
        },
      ],
      [
        "a valid hello, then silence until the connect timeout",
        async (r) => {
          r.write(valid());
          assert.ok(await r.line());
          await r.closedByServer();
        },
      ],
      [
        "a valid hello, then garbage instead of ready",
        async (r) => {
          r.write(valid());
          assert.ok(await r.line());
          r.write('{"ready":"maybe"}\n');
          await r.closedByServer();
        },
      ],
    ];

    async function abandon(stage: Stage, n: number, served: { n: number }): Promise<void> {
      for (let done = 0; done < n; ) {
        const k = Math.min(BATCH, n - done);
        const batch = Array.from({ length: k }, async () => {
          const r = await Raw.open(listener.port);
          try {
            await stage[1](r);
          } finally {
            r.destroy();
          }
        });
        // a legitimate client is served while the batch is under way
        await Promise.all([...batch, legit(listener, served.n++)]);
        done += k;
      }
    }

    async function settled(): Promise<Counts> {
      await eventually(() => listener.stats().handshakes === 0, 60_000, "every abandoned handshake to end");
      // the tcp QPs' streams close asynchronously
      await eventually(() => held.size === 0, 60_000, "the streams of abandoned QPs to close");
      gc();
      return counts();
    }

    let rssGrowth = 0;
    let served = 0;

    it(`${N} per stage: contexts (PD + pool), QPs and registered memory back to the baseline; a legitimate client served throughout`, async () => {
      const sv = { n: 0 };
      // warm-up: lazily created state (device tables, JIT) is not a leak
      for (const st of stages) await abandon(st, Math.min(N, BATCH), sv);
      const base = await settled();
      const rss0 = process.memoryUsage().rss;
      for (const st of stages) {
        const before = await settled();
        const t0 = performance.now();
        await abandon(st, N, sv);
        const now = await settled();
        const mu = process.memoryUsage();
        if (process.env.ABANDON_DEBUG) console.log(`# ${st[0]}: ${(performance.now() - t0).toFixed(0)} ms, rss ${(mu.rss / 2 ** 20).toFixed(1)} heap ${(mu.heapUsed / 2 ** 20).toFixed(1)} external ${(mu.external / 2 ** 20).toFixed(1)} arrayBuffers ${(mu.arrayBuffers / 2 ** 20).toFixed(1)}`);
        assert.deepEqual(now, before, `after ${N} × "${st[0]}"`);
      }
      assert.deepEqual(await settled(), base);
      rssGrowth = (process.memoryUsage().rss - rss0) / 2 ** 20;
      served = sv.n;
      if (process.env.ABANDON_DEBUG) console.log(`# slowest legitimate handshake: ${slowestLegit.toFixed(0)} ms`);
      assert.ok(served >= stages.length);
    });

    it("RSS stays bounded", (t) => {
      // Leaking the receive buffers alone would be ~130 KiB per handshake past the hello: 3 × N of them.
      const leak = (3 * N * 130) / 1024;
      console.log(`# ${stages.length * N} abandoned handshakes, ${served} legitimate clients served; RSS ${rssGrowth >= 0 ? "+" : ""}${rssGrowth.toFixed(1)} MiB (leaking the receive buffers would be ~${leak.toFixed(0)} MiB)`);
      const staleCqs = device ? [...device.cqs].filter((cq) => (cq as unknown as { destroyed?: boolean }).destroyed).length : 0;
      if (staleCqs > 0) t.todo(`the tcp device still holds ${staleCqs} destroyed CQs (issue 9 point 6, tcp provider): RSS is asserted once they are dropped`);
      assert.ok(rssGrowth < 64, `RSS grew by ${rssGrowth.toFixed(1)} MiB`);
    });
  });

  describe("failed client setups give back everything", () => {
    const M = PROVIDER === "verbs" ? 30 : 200;

    /** A server that answers every hello with `reply` (a line), or proxies the first `proxied` connections to the listener. */
    async function fakeServer(reply: string, proxied = 0): Promise<{ port: number; close(): Promise<void> }> {
      const socks = new Set<net.Socket>();
      let n = 0;
      const srv = net.createServer((s) => {
        socks.add(s);
        s.on("close", () => socks.delete(s));
        s.on("error", () => {});
        if (n++ < proxied) {
          const up = net.connect(listener.port, "127.0.0.1");
          up.on("error", () => s.destroy());
          socks.add(up);
          s.pipe(up).pipe(s);
          return;
        }
        s.once("data", () => s.end(reply));
      });
      await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
      return {
        port: (srv.address() as net.AddressInfo).port,
        close: () => {
          for (const x of socks) x.destroy();
          return new Promise<void>((r) => srv.close(() => r()));
        },
      };
    }

    it(`connect(): ${M} handshakes failing after the client set up its QP free it all`, async () => {
      const replies = [
        "not json\n",
        JSON.stringify({ asyncRdma: 1, error: "go away" }) + "\n",
        helloLine({ ...validEndpoint, gid: PROVIDER === "tcp" ? "10.1.2.3" : "ff02::1" }),
        "",
      ];
      const before = counts();
      for (const reply of replies) {
        const fake = await fakeServer(reply);
        try {
          for (let i = 0; i < M; i++) {
            await assert.rejects(builder("client").connect(`127.0.0.1:${fake.port}`), (e: unknown) => e instanceof RdmaError);
          }
        } finally {
          await fake.close();
        }
        assert.deepEqual(counts(), before, `after ${M} × reply ${JSON.stringify(reply)}`);
      }
    });

    it(`newConnection(): ${M} failed siblings leave the family's pool as it was`, async () => {
      const fake = await fakeServer("not json\n", 1);
      try {
        // no keepalive: a PING's control buffer (taken from this same pool) is not a sibling's leak
        const [c, s] = await Promise.all([builder("client").setKeepalive(0).connect(`127.0.0.1:${fake.port}`), listener.accept({ timeoutMs: 60_000 })]);
        try {
          // live memory only: `registrations` counts every registration ever made
          // (minus the connection's own recycled control and receive buffers, which a PING or PONG may add to)
          const own = () => {
            type Spare = { alloc: { length: number } }[];
            const k = c.conn as unknown as { headers: { free: Spare }; recvs: { spare: Spare } };
            const l = [...k.headers.free, ...k.recvs.spare];
            return { n: l.length, bytes: l.reduce((t, m) => t + m.alloc.length, 0) };
          };
          const live = () => ({ liveAllocations: c.stats().pool.liveAllocations - own().n, liveBytes: c.stats().pool.liveBytes - own().bytes, contexts: contextStats().live });
          const base = live();
          for (let i = 0; i < M; i++) await assert.rejects(c.newConnection(), (e: unknown) => e instanceof RdmaError && e.code === "PROTOCOL");
          assert.deepEqual(live(), base);
          await legit(listener, 77);
        } finally {
          await Promise.all([c.close(), s.close()]);
        }
      } finally {
        await fake.close();
      }
    });
  });

  describe("connections being set up are bounded per listener (setMaxHandshakes)", () => {
    it("past the bound a valid hello is refused as busy, before anything is allocated; a slot that frees serves the next client", async () => {
      const small = await builder("server").setConnectTimeout(60_000).setMaxHandshakes(2).bind(at(0));
      const squatters: Raw[] = [];
      // where the tcp QP set up for a hello from 127.0.0.2 dials (its endpoint names a wildcard: the side channel's peer)
      const held2 = new Set<net.Socket>();
      const sink2 = net.createServer((x) => {
        held2.add(x);
        x.on("error", () => {});
        x.resume();
      });
      await new Promise<void>((r) => sink2.listen(0, "127.0.0.2", r));
      const endpointFrom = (from: string): Endpoint => (PROVIDER === "tcp" && from === "127.0.0.2" ? { ...validEndpoint, port: (sink2.address() as net.AddressInfo).port } : validEndpoint);
      try {
        // two clients (from two addresses: one address holds at most half the slots) that send a
        // valid hello and then never confirm: each holds a QP on the server
        for (const from of ["127.0.0.1", "127.0.0.2"]) {
          const r = await Raw.open(small.port, from);
          squatters.push(r);
          r.write(helloLine(endpointFrom(from)));
          const answer = await r.line();
          assert.ok(answer !== null && (JSON.parse(answer) as { endpoint?: unknown }).endpoint, "the first two get an endpoint");
        }
        const before = counts();
        await assert.rejects(builder("client").connect(at(small.port)), (e: unknown) => code("CONNECTION_REFUSED")(e) && /busy/.test((e as Error).message));
        assert.deepEqual(counts(), before, "the refused client cost the server nothing");
        squatters.shift()!.destroy();
        await eventually(() => small.stats().handshakes <= 1, 60_000, "the abandoned handshake to end");
        await legit(small, 91);
      } finally {
        for (const r of squatters) r.destroy();
        await small.close();
        for (const x of held2) x.destroy();
        await new Promise<void>((r) => sink2.close(() => r()));
      }
    });
  });
});
