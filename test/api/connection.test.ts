/**
 * Connections: listener, one-shot listen, newConnection, connect errors,
 * builder validation, malformed control messages.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import { RdmaBuilder, RdmaError, type Rdma } from "../../src/index.js";
import { SendFlags, WrOpcode } from "../../src/transport/types.js";
import { CM, PROVIDER, apiPair, at, builder } from "../support/api.js";

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
      assert.equal(c.closed || s.closed, false);
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
      assert.equal(p.client.closed, false);
      assert.equal(p.server.closed, false);
    } finally {
      await p.close();
    }
  });
});
