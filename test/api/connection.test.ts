/**
 * Connections: listener, one-shot listen, newConnection, connect errors,
 * builder validation, malformed control messages; the listener's connection
 * limit (issue 19 point 10), siblings dialing the address reached (point
 * 13), a port in use (point 19).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import dns from "node:dns";
import { constants } from "node:os";
import { RdmaBuilder, RdmaError, type Rdma, type RdmaListener } from "../../src/index.js";
import { contextStats } from "../../src/api/context.js";
import { SendFlags, WrOpcode } from "../../src/transport/types.js";
import { CM, HOST, PROVIDER, apiPair, at, builder, eventually } from "../support/api.js";
import { SLOW } from "../support/seam.js";

function code(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

/** A TCP server that answers the handshake with `reply` (or nothing). */
async function fakeServer(reply: string | null): Promise<{ port: number; close: () => Promise<void> }> {
  const socks: net.Socket[] = [];
  const srv = net.createServer((s) => {
    socks.push(s);
    s.on("error", () => {});
    s.once("data", () => {
      if (reply !== null) s.write(reply);
    });
  });
  await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
  return {
    port: (srv.address() as net.AddressInfo).port,
    close: () => {
      for (const s of socks) s.destroy();
      return new Promise<void>((r) => srv.close(() => r()));
    },
  };
}

describe(`API connections [${PROVIDER}, ${CM}]`, () => {
  it("bind yields any number of connections with for await; they share the listener's pool", async () => {
    const listener = await builder("server").bind(at(0));
    const clients = await Promise.all([0, 1, 2].map(() => builder("client").connect(at(listener.port))));
    const servers: Rdma[] = [];
    for await (const rdma of listener) {
      servers.push(rdma);
      if (servers.length === 3) break;
    }
    await listener.close();
    // each connection works on its own
    await Promise.all(
      clients.map(async (c, i) => {
        using m = c.allocLocalMr(4);
        m.bytes.fill(i + 1);
        await c.send(m);
      }),
    );
    const got = await Promise.all(servers.map(async (s) => (await s.receive()).bytes[0]));
    assert.deepEqual(got.sort(), [1, 2, 3]);
    await Promise.all([...clients, ...servers].map((r) => r.close()));
  });

  it("listen() is the seed's one-shot form; newConnection() shares PD and pool with its own QP", async () => {
    const listener = await builder("server").bind(at(0));
    const client = await builder("client").connect(at(listener.port));
    const server = await listener.accept({ timeoutMs: 5000 });
    const c2p = client.newConnection();
    const server2 = await listener.accept({ timeoutMs: 5000 });
    const client2 = await c2p;
    assert.equal(client2.deviceName, client.deviceName);
    using m = client2.allocLocalMr(3);
    m.bytes.set([7, 8, 9]);
    await client2.send(m);
    using r = await server2.receive();
    assert.deepEqual([...r.bytes], [7, 8, 9]);
    await client.close();
    // the second connection outlives the first
    await client2.send(m);
    using r2 = await server2.receive();
    assert.deepEqual([...r2.bytes], [7, 8, 9]);
    await Promise.all([client2.close(), server.close(), server2.close(), listener.close()]);
    await assert.rejects(server.newConnection(), code("CONNECTION_CLOSED"));

    // one-shot listen
    const port = await new Promise<number>((resolve) => {
      const s = net.createServer();
      s.listen(0, "127.0.0.1", () => {
        const p = (s.address() as net.AddressInfo).port;
        s.close(() => resolve(p));
      });
    });
    const lp = builder("server").listen(at(port));
    let c: Rdma | null = null;
    for (let i = 0; i < 100 && !c; i++) {
      // the listener may not be up yet: retry on refusal only (an event, not a guess)
      c = await builder("client")
        .connect(at(port))
        .catch((e: unknown) => {
          if (e instanceof RdmaError && e.code === "CONNECTION_REFUSED") return null;
          throw e;
        });
    }
    const s = await lp;
    await assert.rejects(builder("client").connect(at(port)), code("CONNECTION_REFUSED"), "one-shot: the port is closed after the first client");
    await Promise.all([c!.close(), s.close()]);
  });

  it("connect errors are typed: refused, version mismatch, not an async-rdma server, timeout, abort", async () => {
    const closed = await fakeServer(null);
    const port = closed.port;
    await closed.close();
    await assert.rejects(builder().connect(at(port)), code("CONNECTION_REFUSED"));
    await assert.rejects(builder().connect("no-port-here"), code("INVALID_ARGUMENT"));
    // The rest speaks the TCP side channel's protocol; test/api/rdmacm.test.ts has the RDMA CM equivalents.
    if (CM !== "tcp") return;

    const v99 = await fakeServer(JSON.stringify({ asyncRdma: 99 }) + "\n");
    await assert.rejects(builder().connect(`127.0.0.1:${v99.port}`), (e: unknown) => code("PROTOCOL")(e) && /version mismatch/.test((e as Error).message));
    await v99.close();

    const http = await fakeServer("HTTP/1.1 400 Bad Request\r\n\r\n");
    await assert.rejects(builder().connect(`127.0.0.1:${http.port}`), code("PROTOCOL"));
    await http.close();

    const silent = await fakeServer(null);
    await assert.rejects(builder().setConnectTimeout(100).connect(`127.0.0.1:${silent.port}`), code("TIMEOUT"));
    await assert.rejects(builder().connect(`127.0.0.1:${silent.port}`, { signal: AbortSignal.timeout(50) }), code("ABORTED"));
    await silent.close();
  });

  it("a server rejects a bad client handshake and keeps serving", { skip: CM !== "tcp" && "side-channel handshake (the RDMA CM equivalent is in test/api/rdmacm.test.ts)" }, async () => {
    const listener = await builder("server").bind(at(0));
    const raw = net.connect(listener.port, "127.0.0.1");
    raw.on("error", () => {});
    raw.write('{"asyncRdma":1,"provider":"tcp","endpoint":{"qpNum":"x"}}\n');
    const answer = await new Promise<string>((r) => raw.once("data", (d) => r(d.toString())));
    assert.match(answer, /error/);
    raw.destroy();
    const c = await builder("client").connect(at(listener.port));
    const s = await listener.accept({ timeoutMs: 5000 });
    assert.equal(listener.rejected.length, 1);
    await Promise.all([c.close(), s.close(), listener.close()]);
  });

  it("settings are validated against the device, naming the setting and the limit", async () => {
    await assert.rejects(builder().setQpCaps({ maxSendWr: 2 ** 30 }).connect(at(1)), (e: unknown) => code("INVALID_ARGUMENT")(e) && /maxSendWr.*max_qp_wr/.test((e as Error).message));
    assert.throws(() => new RdmaBuilder().setMtu(1000), code("INVALID_ARGUMENT"));
    assert.throws(() => new RdmaBuilder().setProvider("ib" as never), code("INVALID_ARGUMENT"));
    assert.throws(() => new RdmaBuilder().setRnrRetry(8), code("INVALID_ARGUMENT"));
    await assert.rejects(builder().setCqSize(4).connect(at(1)), (e: unknown) => code("INVALID_ARGUMENT")(e) && /cqSize/.test((e as Error).message));
  });

  it("a malformed control message closes that connection with a clear error; others live on", async () => {
    const a = await apiPair();
    const b = await apiPair();
    try {
      const failed = assert.rejects(a.server.receive(), (e: unknown) => code("PROTOCOL")(e) && /malformed control message/.test((e as Error).message));
      // Hand-craft a SEND with a garbage header on the client's QP (what a buggy peer would do).
      const qp = a.client.conn.qp;
      const junk = a.client.allocLocalMr(24);
      junk.bytes.fill(0x42);
      qp.postSend([{ wrId: 999999, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [junk.sge()] }]);
      await failed;
      using m = b.client.allocLocalMr(2);
      m.bytes.set([5, 6]);
      await b.client.send(m);
      using r = await b.server.receive();
      assert.deepEqual([...r.bytes], [5, 6]);
    } finally {
      await a.close();
      await b.close();
    }
  });

  it("Symbol.asyncDispose closes connections and listeners", async () => {
    let port = 0;
    {
      await using listener = await builder("server").bind(at(0));
      port = listener.port;
      await using c = await builder("client").connect(at(port));
      await using s = await listener.accept();
      assert.equal(c.isClosed || s.isClosed, false);
    }
    await assert.rejects(builder().connect(at(port)), code("CONNECTION_REFUSED"));
  });

  it("READs and atomics in flight never exceed what the peer accepts (maxRdAtomic differs on each side)", async () => {
    const p = await apiPair({ server: (b) => b.setMaxRdAtomic(1) });
    try {
      const rmr = await p.client.requestRemoteMr(64 * 32);
      using lmr = p.client.allocLocalMr(64 * 32);
      // 32 reads at once: the client's QP may have only 1 outstanding (the server's responder resources)
      await Promise.all(Array.from({ length: 32 }, (_, i) => p.client.read(lmr.slice(i * 64, i * 64 + 64), rmr.slice(i * 64, i * 64 + 64))));
      await Promise.all(Array.from({ length: 16 }, () => p.client.fetchAndAdd(rmr.slice(0, 8), 1n)));
      assert.equal(p.client.isClosed, false);
      assert.equal(p.server.isClosed, false);
    } finally {
      await p.close();
    }
  });

  it("issue 19 point 10: a listener holds at most setMaxConnections(n) (default 1024); past it a client is refused as full before anything is allocated; a slot that frees serves the next client", async () => {
    assert.equal((new RdmaBuilder() as unknown as { s: { maxConnections: number } }).s.maxConnections, 1024);
    assert.throws(() => new RdmaBuilder().setMaxConnections(0), code("INVALID_ARGUMENT"));
    const l = await builder("server").setMaxConnections(2).bind(at(0));
    const open: Rdma[] = [];
    try {
      for (let i = 0; i < 2; i++) {
        const [c, s] = await Promise.all([builder("client").connect(at(l.port)), l.accept({ timeoutMs: 60_000 * SLOW })]);
        open.push(c, s);
      }
      assert.equal(l.stats().connections, 2);
      const live = contextStats().live;
      await assert.rejects(builder("client").connect(at(l.port)), (e: unknown) => code("CONNECTION_REFUSED")(e) && /full/.test((e as Error).message));
      assert.equal(contextStats().live, live, "the refused client cost the server nothing");
      assert.equal(l.stats().connections, 2);
      // one connection ends (its client closes it): its place serves the next client
      await open[0]!.close();
      await eventually(() => l.stats().connections === 1, 60_000 * SLOW, "the closed connection's place to free");
      const [c, s] = await Promise.all([builder("client").connect(at(l.port)), l.accept({ timeoutMs: 60_000 * SLOW })]);
      open.push(c, s);
      using m = c.allocLocalMr(8);
      await c.send(m);
      using r = await s.receive();
      assert.equal(r.length, 8);
    } finally {
      await Promise.all(open.map((r) => r.close()));
      await l.close();
    }
  });

  it("issue 19 point 13: newConnection() dials the address the first connection reached, not the name again (which may now name another server)", { skip: CM !== "tcp" && "a name resolved by Node's dns.lookup (RDMA CM dials the address it resolved too)" }, async () => {
    const a = await builder("server").bind("127.0.0.1:0");
    let b: RdmaListener | null = null;
    const real = dns.lookup;
    try {
      b = await builder("server").bind(`127.0.0.2:${a.port}`);
      // "twins.test" names server a once, then server b
      let asked = 0;
      const fake = (host: string, opts: unknown, cb?: unknown): void => {
        const done = (typeof opts === "function" ? opts : cb) as (err: Error | null, a: unknown, f?: number) => void;
        if (host !== "twins.test") return void (real as (...x: unknown[]) => void)(host, opts, cb);
        const address = asked++ === 0 ? "127.0.0.1" : "127.0.0.2";
        if (typeof opts === "object" && opts !== null && (opts as { all?: boolean }).all) done(null, [{ address, family: 4 }]);
        else done(null, address, 4);
      };
      (dns as unknown as { lookup: unknown }).lookup = fake;
      const [c, s] = await Promise.all([builder("client").connect(`twins.test:${a.port}`), a.accept({ timeoutMs: 60_000 * SLOW })]);
      const others: Rdma[] = [c, s];
      try {
        const sibling = await c.newConnection();
        others.push(sibling);
        const there = await Promise.race([a.accept({ timeoutMs: 60_000 * SLOW }).then((x) => ["a", x] as const), b.accept({ timeoutMs: 60_000 * SLOW }).then((x) => ["b", x] as const)]);
        others.push(there[1]);
        assert.equal(there[0], "a", "the sibling reached the first connection's server");
        assert.equal(sibling.peer.address, "127.0.0.1");
      } finally {
        await Promise.all(others.map((r) => r.close()));
      }
    } finally {
      (dns as unknown as { lookup: unknown }).lookup = real;
      await b?.close();
      await a.close();
    }
  });

  it("issue 19 point 19: a port in use is ADDRESS_IN_USE, with errno, errnoName and syscall as Node reports them", async () => {
    const l = await builder("server").bind(at(0));
    try {
      const e = await builder("server")
        .bind(at(l.port))
        .then(
          async (x) => {
            await x.close();
            assert.fail("bound a port in use");
          },
          (err: unknown) => err,
        );
      code("ADDRESS_IN_USE")(e);
      const r = e as RdmaError;
      assert.equal(r.errnoName, "EADDRINUSE");
      assert.equal(r.errno, -constants.errno.EADDRINUSE);
      assert.match(String(r.syscall), CM === "tcp" ? /^listen$/ : /^rdma_bind_addr$/);
      assert.ok(r.message.includes(`${HOST}:${l.port}`) && /in use/.test(r.message), r.message);
    } finally {
      await l.close();
    }
  });
});
