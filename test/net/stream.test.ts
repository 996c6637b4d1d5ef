/**
 * issue 22 point 1: async-rdma/net and rdma.createStream(): a stream.Duplex
 * over one RDMA connection, held to Node's own expectations of a socket.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { Readable, Writable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { once } from "node:events";
import { spawn, type ChildProcess } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { RdmaError } from "../../src/index.js";
import { connect, createServer, type RdmaStream, type Server } from "../../src/net/index.js";
import { MAX_CHUNK, RING } from "../../src/api/stream.js";
import type { Rdma } from "../../src/api/rdma.js";
import { CM, HOST, PROVIDER, apiPair, at, builder, eventually } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const DEADLINE = 20_000 * SLOW;
/** The large pipeline: 200 MiB on tcp; 32 MiB on verbs in the (slow, emulated) guest. */
const LARGE = PROVIDER === "verbs" ? 32 << 20 : 200 << 20;

/** `n` deterministic bytes in 64 KiB chunks (byte i = (i * 31 + seed) mod 251). */
function source(n: number, seed = 1): Readable {
  let off = 0;
  return new Readable({
    read() {
      if (off >= n) return void this.push(null);
      const len = Math.min(64 * 1024, n - off);
      const b = Buffer.allocUnsafe(len);
      for (let i = 0; i < len; i++) b[i] = ((off + i) * 31 + seed) % 251;
      off += len;
      this.push(b);
    },
  });
}

function expectedHash(n: number, seed = 1): Promise<string> {
  return sink(source(n, seed)).then((r) => r.hash);
}

/** A hostile writer's side of the ring protocol: asks the stream on the peer for its ring (RING?) and opens it. */
async function openPeerRing(rdma: Rdma): Promise<import("../../src/index.js").RemoteMr> {
  await rdma.send(Buffer.of(0x04));
  const m = await rdma.receive();
  const name = Buffer.from(m.bytes).toString("utf8", 1);
  assert.equal(m.bytes[0], 0x05);
  m.dispose();
  return rdma.openSharedMr(name);
}

/** Reads a stream to its end: byte count and sha256. */
async function sink(s: Readable): Promise<{ bytes: number; hash: string }> {
  const h = createHash("sha256");
  let bytes = 0;
  await pipeline(
    s,
    new Writable({
      write(c: Buffer, _e, cb) {
        bytes += c.length;
        h.update(c);
        cb();
      },
    }),
  );
  return { bytes, hash: h.digest("hex") };
}

async function listen(onConn: (s: RdmaStream) => void, opts: { allowHalfOpen?: boolean } = {}): Promise<{ server: Server; port: number }> {
  const server = createServer({ builder: builder("server"), ...opts }, onConn);
  server.listen(0, HOST);
  await once(server, "listening");
  return { server, port: server.address()!.port };
}

function dial(port: number, opts: { allowHalfOpen?: boolean } = {}): RdmaStream {
  return connect(port, HOST, { builder: builder("client"), ...opts });
}

function closeServer(server: Server): Promise<void> {
  return new Promise((r) => server.close(() => r()));
}

describe(`issue 22 point 1: async-rdma/net stream [${PROVIDER}, ${CM}]`, () => {
  for (const n of [0, 1, LARGE]) {
    it(`issue 22 point 1: pipeline() file-like source → socket → sink, ${n} bytes, checksum equal (client → server, then server → client)`, { timeout: 600_000 }, async () => {
      const want = await expectedHash(n);
      const got: Promise<{ bytes: number; hash: string }>[] = [];
      // allowHalfOpen: both directions run at once, and with the default (false, as net) the side
      // whose readable ends first would end its writable while its own pipeline still writes
      const { server, port } = await listen(
        (s) => {
          got.push(sink(s));
          void pipeline(source(n), s).catch(() => {});
        },
        { allowHalfOpen: true },
      );
      try {
        const c = dial(port, { allowHalfOpen: true });
        const [up, down] = await Promise.all([pipeline(source(n), c), sink(c)]);
        void up;
        await eventually(() => got.length === 1, DEADLINE, "the server's connection");
        const atServer = await got[0]!;
        assert.deepEqual(atServer, { bytes: n, hash: want });
        assert.deepEqual(down, { bytes: n, hash: want });
        await eventually(() => c.closed && c.connection?.isClosed === true, DEADLINE, "the client to close after both ends");
      } finally {
        await closeServer(server);
      }
    });
  }

  for (const first of ["client", "server"] as const) {
    it(`issue 22 point 1: half-close, ${first} ends first: the other side reads everything, sees 'end', and still writes until it ends`, async () => {
      const N = 3 << 20;
      const want = await expectedHash(N);
      const atServer: Promise<{ bytes: number; hash: string }>[] = [];
      const { server, port } = await listen((s) => {
        if (first === "client") {
          atServer.push(
            sink(s).then(async (r) => {
              await pipeline(source(N), s); // writes after its peer ended
              return r;
            }),
          );
        } else {
          atServer.push(pipeline(source(N), s).then(() => sink(s)));
        }
      }, { allowHalfOpen: true });
      try {
        const c = dial(port, { allowHalfOpen: true });
        let atClient: { bytes: number; hash: string };
        if (first === "client") {
          await pipeline(source(N), c); // ends the client's side
          atClient = await sink(c);
        } else {
          atClient = await sink(c); // the server ended first
          assert.equal(c.writable, true, "the client may still write after the server's end");
          await pipeline(source(N), c);
        }
        await eventually(() => atServer.length === 1, DEADLINE, "the server's connection");
        assert.deepEqual(await atServer[0]!, { bytes: N, hash: want });
        assert.deepEqual(atClient, { bytes: N, hash: want });
        await eventually(() => c.destroyed, DEADLINE, "the client to close after both ends");
      } finally {
        await closeServer(server);
      }
    });
  }

  it("issue 22 point 1: allowHalfOpen false (the default, as net): the peer's end ends this side too, and both close", async () => {
    const closed: RdmaStream[] = [];
    const { server, port } = await listen((s) => {
      s.resume();
      s.once("close", () => closed.push(s));
    });
    try {
      const c = dial(port);
      await once(c, "connect");
      c.end("bye");
      const r = await sink(c);
      assert.equal(r.bytes, 0);
      await eventually(() => closed.length === 1 && c.destroyed, DEADLINE, "both sides to close");
    } finally {
      await closeServer(server);
    }
  });

  it("issue 22 point 1: back-pressure: a reader that does not read bounds what the writer holds (write() returns false, 'drain' once read)", { timeout: 120_000 * SLOW }, async () => {
    const TOTAL = 64 << 20;
    let srv: RdmaStream | null = null;
    const { server, port } = await listen((s) => void (srv = s)); // never reads until told
    try {
      const c = dial(port);
      await once(c, "connect");
      const chunk = Buffer.alloc(64 * 1024, 9);
      let accepted = 0;
      let falses = 0;
      let writing = true;
      const writer = (async () => {
        while (accepted < TOTAL) {
          accepted += chunk.length;
          if (!c.write(chunk)) {
            falses++;
            await once(c, "drain");
          }
        }
        c.end();
        writing = false;
      })();
      // The reader never read: the writer stalls once the reader holds its whole window.
      await eventually(() => srv !== null && srv.bytesRead >= RING && c.writableNeedDrain, DEADLINE, "the writer to fill the reader's window");
      // Give a writer that would not stop every chance to go on: round trips on the same
      // connection (FIFO), each one after everything the writer had posted before it.
      for (let i = 0; i < 20; i++) (await c.connection!.requestRemoteMr(8)).dispose();
      assert.ok(srv!.bytesRead <= RING, `the reader was sent ${srv!.bytesRead} bytes with nothing read (ring ${RING})`);
      const bound = RING + 256 * 1024 + 2 * 64 * 1024; // the ring, the writable buffer, one chunk
      assert.ok(srv!.readableLength <= RING, `the reader holds ${srv!.readableLength} bytes`);
      assert.ok(writing, "the writer must not have finished while nothing was read");
      assert.ok(accepted <= bound, `the writer took ${accepted} bytes with nothing read (bound ${bound})`);
      assert.ok(falses > 0);
      // Now read: everything arrives, and 'drain' lets the writer finish.
      const r = await sink(srv!);
      await writer;
      assert.equal(r.bytes, TOTAL);
    } finally {
      await closeServer(server);
    }
  });

  for (const side of ["client", "server"] as const) {
    it(`issue 22 point 1: destroy() mid-transfer by the ${side}: both sides see 'close', the connections are freed`, { timeout: 120_000 * SLOW }, async () => {
      let srv: RdmaStream | null = null;
      const srvClosed = { v: false };
      const { server, port } = await listen((s) => {
        srv = s;
        s.on("error", () => {});
        s.once("close", () => (srvClosed.v = true));
        s.resume();
        void pipeline(source(256 << 20), s).catch(() => {});
      });
      try {
        const c = dial(port);
        c.on("error", () => {});
        let cliClosed = false;
        c.once("close", () => (cliClosed = true));
        let got = 0;
        c.on("data", (d: Buffer) => (got += d.length));
        void pipeline(source(256 << 20), c).catch(() => {});
        await eventually(() => got > 1 << 20 && srv !== null, DEADLINE, "data flowing");
        const conn = c.connection!;
        if (side === "client") c.destroy();
        else srv!.destroy();
        await eventually(() => cliClosed && srvClosed.v, DEADLINE, "'close' on both sides");
        assert.equal(conn.isClosed, true);
        assert.equal(srv!.connection!.isClosed, true);
        let n = -1;
        server.getConnections((_e, k) => (n = k));
        await eventually(() => n === 0, DEADLINE, "the server to hold no connection");
      } finally {
        await closeServer(server);
      }
    });
  }

  it("issue 21: destroy() right after end(), every byte posted: the peer still reads everything and a clean end (as a net.Socket's peer does)", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream();
      const b = p.server.createStream();
      const errors: Error[] = [];
      b.on("error", (e) => errors.push(e));
      const got = sink(b);
      // the ring is open once a first write has arrived
      a.write(Buffer.alloc(10, 1));
      await eventually(() => b.bytesRead === 10, DEADLINE, "the first write to arrive");
      // 256 KiB: posted at once (within the ring credit), its WRITEs still in flight when end() is followed by destroy()
      const last = Buffer.alloc(256 << 10, 2);
      a.end(last);
      assert.equal(a.writableLength, 0, "every byte was posted before destroy()");
      a.destroy();
      const r = await got;
      assert.deepEqual(errors, [], "the peer saw no reset");
      assert.equal(r.bytes, 10 + (256 << 10));
      assert.equal(b.readableEnded, true);
    } finally {
      await p.close();
    }
  });

  it("issue 21: end() then destroy() with nothing in flight (the end already posted by end() itself): the peer sees a clean end", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream();
      const b = p.server.createStream();
      const errors: Error[] = [];
      b.on("error", (e) => errors.push(e));
      const got = sink(b);
      await new Promise<void>((r) => a.write(Buffer.alloc(10, 1), () => r()));
      await eventually(() => b.bytesRead === 10 && a.writableLength === 0, DEADLINE, "the write to arrive and complete");
      a.end();
      a.destroy();
      const r = await got;
      assert.deepEqual(errors, [], "the peer saw no reset");
      assert.equal(r.bytes, 10);
    } finally {
      await p.close();
    }
  });

  it("issue 21: destroy() right after end() with closeConnection: false: the peer's ring is given up once the WRITEs and the end completed", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream({ closeConnection: false });
      const b = p.server.createStream({ closeConnection: false, allowHalfOpen: true });
      b.on("error", () => {});
      const got = sink(b);
      a.write(Buffer.alloc(10, 1));
      await eventually(() => b.bytesRead === 10, DEADLINE, "the first write to arrive");
      const ring = (a as unknown as { peerRing: { rmr: { released: boolean } } }).peerRing.rmr;
      a.end(Buffer.alloc(256 << 10, 2));
      a.destroy();
      assert.equal((await got).bytes, 10 + (256 << 10));
      await eventually(() => ring.released, DEADLINE, "the peer's ring to be given up");
    } finally {
      await p.close();
    }
  });

  it("issue 21: resetAndDestroy() after end(), every byte posted: the peer sees a reset (as for a reset socket)", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream();
      const b = p.server.createStream();
      const errors: Error[] = [];
      b.on("error", (e) => errors.push(e));
      b.resume();
      a.write(Buffer.alloc(10, 1));
      await eventually(() => b.bytesRead === 10, DEADLINE, "the first write to arrive");
      a.end(Buffer.alloc(256 << 10, 2));
      a.resetAndDestroy();
      await eventually(() => b.destroyed, DEADLINE, "the peer's stream to end");
      assert.equal(errors.length, 1, "the peer saw a reset");
      assert.equal(b.readableEnded, false);
    } finally {
      await p.close();
    }
  });

  for (const half of [true, false]) {
    it(`issue 21: the peer ends and closes at once; this side (allowHalfOpen ${half}) ends its own side before reading, then reads everything (as a net.Socket does)`, async () => {
      const p = await apiPair();
      try {
        const a = p.client.createStream();
        const b = p.server.createStream({ allowHalfOpen: half });
        const errors: Error[] = [];
        b.on("error", (e) => errors.push(e));
        b.pause();
        a.write(Buffer.alloc(10, 1));
        await eventually(() => b.bytesRead === 10, DEADLINE, "the first write to arrive");
        a.end(Buffer.alloc(100_000, 2));
        a.destroy();
        const inner = b as unknown as { peerFin: boolean; loops: number };
        await eventually(() => inner.peerFin && inner.loops === 0, DEADLINE, "this side to have the peer's end and its close");
        b.end();
        const r = await sink(b);
        assert.equal(r.bytes, 100_010);
        assert.deepEqual(errors, []);
      } finally {
        await p.close();
      }
    });
  }

  it("issue 21: destroy() while writes wait for ring credit calls every write's callback (with an error), as a net.Socket does", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream();
      const b = p.server.createStream(); // never reads: the ring fills
      b.on("error", () => {});
      a.on("error", () => {});
      const results: (Error | null | undefined)[] = [];
      for (let i = 0; i < 24; i++) a.write(Buffer.alloc(64 << 10, i), (e) => results.push(e));
      const inner = a as unknown as { waiting: unknown; inflight: number };
      await eventually(() => inner.waiting !== null && inner.inflight === 0 && b.bytesRead >= RING, DEADLINE, "the writer to wait for ring credit");
      a.destroy();
      await eventually(() => results.length === 24, DEADLINE, "every write's callback");
      assert.ok(results.some((e) => e instanceof Error), "the writes not sent failed");
    } finally {
      await p.close();
    }
  });

  it("issue 21: destroy() after end() with bytes not yet posted: the peer sees a reset, never a clean end of truncated data", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream();
      const b = p.server.createStream();
      const errors: Error[] = [];
      b.on("error", (e) => errors.push(e));
      b.resume();
      // no ring yet: the write waits for it, unposted, when destroy() comes
      a.end(Buffer.alloc(100_000, 3));
      assert.ok(a.writableLength > 0, "the bytes are still in the stream's buffer");
      a.destroy();
      await eventually(() => b.destroyed, DEADLINE, "the peer's stream to end");
      assert.equal(b.readableEnded, false, "no clean end");
      assert.equal(errors.length, 1);
      assert.ok(errors[0] instanceof RdmaError && errors[0].code === "CONNECTION_CLOSED", String(errors[0]));
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 1: a dead peer (SIGKILL) mid-transfer gives 'error' then 'close' within the liveness bound", { timeout: 120_000 * SLOW }, async () => {
    const peer = join(dirname(fileURLToPath(import.meta.url)), "..", "support", "net-peer.js");
    let srv: RdmaStream | null = null;
    const server = createServer({ builder: builder("server").setKeepalive(100).setPeerTimeout(1_000 * SLOW) }, (s) => {
      srv = s;
      s.resume();
    });
    server.listen(0, HOST);
    await once(server, "listening");
    let child: ChildProcess | null = null;
    try {
      child = spawn(process.execPath, [peer, HOST, String(server.address()!.port)], { stdio: ["ignore", "pipe", "inherit"] });
      await new Promise<void>((res, rej) => {
        child!.stdout!.on("data", (d: Buffer) => d.toString().includes("connected") && res());
        child!.once("exit", (c) => rej(new Error(`peer exited early (${c})`)));
      });
      await eventually(() => srv !== null && srv.bytesRead > 1 << 20, DEADLINE, "data from the peer");
      const errors: unknown[] = [];
      let closed = false;
      srv!.on("error", (e) => errors.push(e));
      srv!.once("close", () => (closed = true));
      child.kill("SIGKILL");
      // keepalive (100 ms) + peer timeout (1 s, scaled): well inside DEADLINE
      await eventually(() => closed, DEADLINE, "'close' after the peer died");
      assert.equal(errors.length, 1);
      assert.ok(errors[0] instanceof RdmaError, String(errors[0]));
    } finally {
      child?.kill("SIGKILL");
      await closeServer(server);
    }
  });

  it("issue 22 point 1: rdma.createStream() over an existing connection; one stream at a time; its end closes the connection", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream({ allowHalfOpen: true });
      assert.throws(() => p.client.createStream(), (e: unknown) => e instanceof RdmaError && e.code === "INVALID_STATE");
      const b = p.server.createStream({ allowHalfOpen: true });
      assert.equal(a.remoteAddress, p.client.peer.address);
      const [, atB, atA] = await Promise.all([
        pipeline(source(1 << 20), a),
        sink(b).then((r) => (b.end(), r)),
        sink(a),
      ]);
      assert.deepEqual(atB, { bytes: 1 << 20, hash: await expectedHash(1 << 20) });
      assert.equal(atA.bytes, 0);
      await eventually(() => p.client.isClosed && p.server.isClosed, DEADLINE, "both connections closed");
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 1: hostile peer: WRITEs past the ring credit it was given give a PROTOCOL error, and the stream holds no more than the ring", async () => {
    const p = await apiPair();
    try {
      const s = p.server.createStream();
      const errs: unknown[] = [];
      s.on("error", (e) => errs.push(e));
      // never read: a well-behaved writer would stop at RING
      const rmr = await openPeerRing(p.client);
      const m = p.client.allocLocalMr(MAX_CHUNK);
      for (let sent = 0; sent <= RING && errs.length === 0; sent += MAX_CHUNK) await p.client.writeWithImm(m, rmr.slice(sent % RING, (sent % RING) + MAX_CHUNK), MAX_CHUNK).catch(() => {});
      await eventually(() => s.destroyed && errs.length === 1, DEADLINE, "the stream to fail");
      assert.ok(errs[0] instanceof RdmaError && errs[0].code === "PROTOCOL", String(errs[0]));
      assert.ok(s.bytesRead <= RING);
    } finally {
      await p.close();
    }
  });

  for (const [what, len] of [
    ["a chunk longer than MAX_CHUNK", MAX_CHUNK + 1],
    ["a chunk longer than the ring", RING + 1],
    ["a chunk of 0 bytes", 0],
  ] as const) {
    it(`issue 22 point 1: hostile peer: an immediate announcing ${what} gives a PROTOCOL error, not a crash`, async () => {
      const p = await apiPair();
      try {
        const s = p.server.createStream();
        const errs: unknown[] = [];
        s.on("error", (e) => errs.push(e));
        s.resume();
        const rmr = await openPeerRing(p.client);
        await p.client.writeWithImm(p.client.allocLocalMr(1), rmr.slice(0, 1), len);
        await eventually(() => s.destroyed && errs.length === 1, DEADLINE, "the stream to fail");
        assert.ok(errs[0] instanceof RdmaError && errs[0].code === "PROTOCOL", String(errs[0]));
        assert.equal(s.bytesRead, 0);
      } finally {
        await p.close();
      }
    });
  }

  it("issue 22 point 1: hostile peer: a ring name that cannot be opened gives the writer a PROTOCOL error", async () => {
    const p = await apiPair();
    try {
      const c = p.client.createStream();
      const errs: unknown[] = [];
      c.on("error", (e) => errs.push(e));
      c.write(Buffer.alloc(1000, 1));
      const req = await p.server.receive();
      assert.deepEqual([...req.bytes], [0x04]);
      await p.server.send(Buffer.from("\x05no-such-ring", "latin1"));
      await eventually(() => c.destroyed && errs.length === 1, DEADLINE, "the stream to fail");
      assert.ok(errs[0] instanceof RdmaError && errs[0].code === "PROTOCOL", String(errs[0]));
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 1: a stream's ring opens only from its own connection (its own share table): another client of the same listener that learns the name gets NOT_FOUND", async () => {
    const listener = await builder("server").bind(at(0));
    const [a, sa] = await Promise.all([builder().connect(at(listener.port)), listener.accept()]);
    const [b, sb] = await Promise.all([builder().connect(at(listener.port)), listener.accept()]);
    try {
      const stream = sa.createStream();
      stream.on("error", () => {});
      await a.send(Buffer.of(0x04)); // RING?: the stream shares its ring and answers with the name
      const m = await a.receive();
      assert.equal(m.bytes[0], 0x05);
      const name = Buffer.from(m.bytes).toString("utf8", 1);
      m.dispose();
      await assert.rejects(b.openSharedMr(name), (e: unknown) => e instanceof RdmaError && e.code === "NOT_FOUND");
      const ring = await a.openSharedMr(name);
      assert.equal(ring.length, RING);
      ring.dispose();
      stream.destroy();
    } finally {
      await Promise.allSettled([a.close(), b.close(), sa.close(), sb.close()]);
      await listener.close();
    }
  });

  it("issue 22 point 1: data moves by RDMA WRITE with immediate into the reader's ring (one ring, lent once; control messages only)", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream();
      const b = p.server.createStream();
      const regsBefore = p.client.stats().pool.registrations;
      const [, got] = await Promise.all([pipeline(source(8 << 20), a), sink(b), sink(a)]);
      assert.equal(got.bytes, 8 << 20);
      assert.equal(got.hash, await expectedHash(8 << 20));
      // issue 21: every chunk is copied into the send ring, registered once: no memory registered or staged per write
      const regs = p.client.stats().pool.registrations - regsBefore;
      assert.ok(regs < 8, `the writer registered pool memory ${regs} times for 8 MiB of 64 KiB writes`);
      // 8 MiB in chunks of at most 256 KiB, each one WRITE: no chunk goes as a message (a rendezvous each, before)
      const st = p.client.stats();
      assert.equal(st.rendezvousSent, 0, "no chunk went by rendezvous");
      assert.ok(st.messagesSent < 16, `the writer sent ${st.messagesSent} two-sided messages for 8 MiB`);
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 1: createStream({ closeConnection: false }): once the stream ends, the connection stays open and its next message reaches receive()", async () => {
    const p = await apiPair();
    try {
      const a = p.client.createStream({ closeConnection: false });
      const b = p.server.createStream({ closeConnection: false });
      const [, got] = await Promise.all([pipeline(source(100_000), a), sink(b), sink(a)]);
      void got;
      await eventually(() => a.closed && b.closed, DEADLINE, "both streams closed");
      assert.equal(p.client.isClosed, false);
      assert.equal(p.server.isClosed, false);
      const m = p.client.allocLocalMr(3);
      m.bytes.set([1, 2, 3]);
      await p.client.send(m);
      const r = await p.server.receive();
      assert.deepEqual([...r.bytes], [1, 2, 3]);
      // and a new stream may run on it
      const a2 = p.client.createStream();
      const b2 = p.server.createStream();
      const [, r2] = await Promise.all([pipeline(source(1000), a2), sink(b2), sink(a2)]);
      assert.equal(r2.bytes, 1000);
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 1: the receive rings are freed when streams close and the connection stays (closeConnection: false), also after a destroy mid-transfer", async () => {
    const held = (r: Rdma): number => r.stats().memory.poolBytes + r.stats().memory.registeredBytes;
    // no ring (1 MiB) held any more; receive buffers and the pool's small caches may move a little
    const freed = (p: { client: Rdma; server: Rdma }, before: [number, number]) => (): boolean => held(p.client) < before[0] + RING && held(p.server) < before[1] + RING;
    const p = await apiPair();
    try {
      const before: [number, number] = [held(p.client), held(p.server)];
      // allowHalfOpen: both directions at once (see the pipeline test)
      const a = p.client.createStream({ closeConnection: false, allowHalfOpen: true });
      const b = p.server.createStream({ closeConnection: false, allowHalfOpen: true });
      await Promise.all([pipeline(source(4 << 20), a), pipeline(source(4 << 20), b), sink(b), sink(a)]);
      await eventually(() => a.closed && b.closed, DEADLINE, "both streams closed");
      await eventually(freed(p, before), DEADLINE, "the rings freed");
    } finally {
      await p.close();
    }
    // a destroy while data flows both ways (a fresh connection: a destroyed stream's last window
    // updates may still reach the other side, and a next stream on that connection would take them)
    const q = await apiPair();
    try {
      const before: [number, number] = [held(q.client), held(q.server)];
      const a2 = q.client.createStream({ closeConnection: false });
      const b2 = q.server.createStream({ closeConnection: false });
      a2.on("error", () => {});
      b2.on("error", () => {});
      b2.resume();
      a2.resume();
      void pipeline(source(64 << 20), a2).catch(() => {});
      void pipeline(source(64 << 20, 2), b2).catch(() => {});
      await eventually(() => a2.bytesRead > 2 << 20 && b2.bytesRead > 2 << 20, DEADLINE, "data flowing both ways");
      a2.destroy();
      b2.destroy();
      await eventually(() => a2.closed && b2.closed, DEADLINE, "both streams closed");
      await eventually(freed(q, before), DEADLINE, "the rings freed after destroy");
    } finally {
      await q.close();
    }
  });

  for (const [what, bytes] of [
    ["an unknown kind", [0x7f, 1, 2]],
    ["an empty message", []],
    ["DATA without bytes", [0x01]],
    ["FIN with bytes", [0x02, 0]],
    ["a window update of 0", [0x03, 0, 0, 0, 0]],
    ["a window update past the window", [0x03, 0xff, 0xff, 0xff, 0xff]],
    ["a short window update", [0x03, 0, 1]],
    ["a window update returning more than was written", [0x03, 0, 0, 0, 1]],
    ["a RING nobody asked for", [0x05, 0x61]],
    ["a one-byte FIN (it must count the bytes written)", [0x02]],
    ["a FIN counting more than the ring credit", [0x02, 0, 0, 0, 0, 0, 0x20, 0, 0]],
    ["a RING? with bytes", [0x04, 0x04]],
  ] as const) {
    it(`issue 22 point 1: hostile peer: ${what} gives the stream a PROTOCOL error, not a crash`, async () => {
      const p = await apiPair();
      try {
        const s = p.server.createStream();
        const errs: unknown[] = [];
        s.on("error", (e) => errs.push(e));
        s.resume();
        const m = p.client.allocLocalMr(bytes.length);
        m.bytes.set(bytes);
        await p.client.send(m);
        await eventually(() => s.destroyed && errs.length === 1, DEADLINE, "the stream to fail");
        assert.ok(errs[0] instanceof RdmaError && errs[0].code === "PROTOCOL", String(errs[0]));
      } finally {
        await p.close();
      }
    });
  }
});
