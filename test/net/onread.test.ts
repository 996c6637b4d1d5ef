/**
 * issue 21: `connect({ onread })` on async-rdma/net, as `net.connect`'s:
 * incoming bytes are copied into the caller's buffer and handed to its
 * callback instead of 'data' events, nothing allocated per chunk; a callback
 * that returns false pauses the socket until resume(), and bytes not yet
 * delivered wait in the receive ring (the writer is held back by the ring
 * credit, not by memory growing here).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { once } from "node:events";
import { RdmaError } from "../../src/index.js";
import { connect, createServer, type OnRead, type RdmaStream, type Server } from "../../src/net/index.js";
import { RING } from "../../src/api/stream.js";
import { CM, HOST, PROVIDER, apiPair, builder, eventually } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const DEADLINE = 20_000 * SLOW;

/** `n` deterministic bytes (byte i = (i * 31 + seed) mod 251). */
function bytesOf(n: number, seed = 3): Buffer {
  const b = Buffer.allocUnsafe(n);
  for (let i = 0; i < n; i++) b[i] = (i * 31 + seed) % 251;
  return b;
}

const sha = (b: Uint8Array): string => createHash("sha256").update(b).digest("hex");

/** A server whose every socket writes `data` (in 64 KiB writes, respecting back-pressure) and ends. */
async function serveBytes(data: Buffer): Promise<{ server: Server; port: number; sockets: RdmaStream[] }> {
  const sockets: RdmaStream[] = [];
  const served = await serveWith((s) => {
    sockets.push(s);
    void (async () => {
      for (let off = 0; off < data.length; off += 64 * 1024) {
        if (!s.write(data.subarray(off, Math.min(data.length, off + 64 * 1024)))) await once(s, "drain");
      }
      s.end();
    })().catch(() => {});
  });
  return { ...served, sockets };
}

/** A server whose sockets `onSocket` handles (their errors ignored). */
async function serveWith(onSocket: (s: RdmaStream) => void): Promise<{ server: Server; port: number }> {
  const server = createServer({ builder: builder("server") }, (s) => {
    s.on("error", () => {});
    onSocket(s);
  });
  server.listen(0, HOST);
  await once(server, "listening");
  return { server, port: server.address()!.port };
}

function closeServer(server: Server): Promise<void> {
  return new Promise((r) => server.close(() => r()));
}

describe(`issue 21: async-rdma/net connect({ onread }) [${PROVIDER}, ${CM}]`, () => {
  it("issue 21: onread with one buffer: every byte arrives in order through the callback, never more than the buffer holds, no 'data'; 'end' and 'close' as usual", { timeout: 120_000 * SLOW }, async () => {
    const data = bytesOf(3 * RING + 12_345);
    const { server, port } = await serveBytes(data);
    try {
      const buffer = new Uint8Array(10_000);
      const got = Buffer.alloc(data.length);
      let at = 0;
      let calls = 0;
      let wrongBuffer = 0;
      const s = connect(port, HOST, {
        builder: builder("client"),
        onread: {
          buffer,
          callback: (n, buf) => {
            calls++;
            if (buf !== buffer) wrongBuffer++;
            assert.ok(n >= 1 && n <= buffer.length, `nread ${n}`);
            got.set(buf.subarray(0, n), at);
            at += n;
          },
        },
      });
      let dataEvents = 0;
      s.on("data", () => dataEvents++);
      const ended = once(s, "end");
      await ended;
      assert.equal(at, data.length);
      assert.equal(sha(got), sha(data), "bytes in order");
      assert.equal(wrongBuffer, 0, "the callback is handed the caller's buffer");
      assert.ok(calls >= Math.ceil(data.length / buffer.length), `${calls} calls`);
      assert.equal(dataEvents, 0, "no 'data' with onread (as net)");
      assert.equal(s.bytesRead, data.length);
      await eventually(() => s.destroyed, DEADLINE, "the socket to close after both ends");
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: onread with buffer(): asked before each delivery, and each callback gets the buffer it returned", { timeout: 120_000 * SLOW }, async () => {
    const data = bytesOf(RING + 777, 9);
    const { server, port } = await serveBytes(data);
    try {
      const pool = [new Uint8Array(4096), new Uint8Array(65536), new Uint8Array(1)];
      let asked = 0;
      let handedOut: Uint8Array | null = null;
      const parts: Buffer[] = [];
      const s = connect({
        port,
        host: HOST,
        builder: builder("client"),
        onread: {
          buffer: () => (handedOut = pool[asked++ % pool.length]!),
          callback: (n, buf) => {
            assert.equal(buf, handedOut, "the buffer buffer() returned last");
            assert.ok(n <= buf.length);
            parts.push(Buffer.from(buf.subarray(0, n)));
          },
        },
      });
      await once(s, "end");
      assert.equal(asked, parts.length, "one buffer() per delivery");
      assert.equal(sha(Buffer.concat(parts)), sha(data));
      assert.ok(parts.some((p) => p.length === 1), "the 1-byte buffer was filled too");
      s.destroy();
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: a callback returning false pauses the socket: nothing more is delivered, the writer is held back by the ring (not by memory here), and resume() delivers the rest", { timeout: 120_000 * SLOW }, async () => {
    const data = bytesOf(4 * RING, 5);
    const { server, port, sockets } = await serveBytes(data);
    try {
      const buffer = new Uint8Array(32 * 1024);
      const got = Buffer.alloc(data.length);
      let at = 0;
      let pauseAt = 100_000;
      const s = connect(port, HOST, {
        builder: builder("client"),
        onread: {
          buffer,
          callback: (n, buf) => {
            got.set(buf.subarray(0, n), at);
            at += n;
            if (at >= pauseAt) {
              pauseAt = Infinity;
              return false;
            }
            return true;
          },
        },
      });
      await eventually(() => s.isPaused(), DEADLINE, "the callback's false to pause the socket");
      const atPause = at;
      // the writer fills this side's ring (the credit it was given reaches at least 3/4 of a ring past
      // what was delivered), then waits for credit with its own buffer full
      await eventually(() => s.bytesRead - at > (RING * 3) / 4 && sockets.length === 1 && sockets[0]!.writableNeedDrain, DEADLINE, "the ring to fill and the writer to be held back");
      assert.equal(at, atPause, "nothing was delivered while paused");
      assert.ok(s.bytesRead - at <= RING, `at most the ring waits undelivered (${s.bytesRead - at} bytes)`);
      assert.ok(s.bytesRead < data.length, "the writer has not sent everything");
      s.resume();
      await once(s, "end");
      assert.equal(at, data.length);
      assert.equal(sha(got), sha(data));
      s.destroy();
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: pause() and resume() from outside the callback stop and restart delivery", { timeout: 120_000 * SLOW }, async () => {
    const data = bytesOf(2 * RING, 7);
    const { server, port, sockets } = await serveBytes(data);
    try {
      let at = 0;
      const s = connect(port, HOST, { builder: builder("client"), onread: { buffer: new Uint8Array(8192), callback: (n) => void (at += n) } });
      s.pause();
      // nothing is consumed, so the first ring's worth of credit is all the writer gets
      await eventually(() => s.bytesRead === RING && sockets.length === 1 && sockets[0]!.writableNeedDrain, DEADLINE, "the ring to fill and the writer to be held back by a paused reader");
      assert.equal(at, 0, "nothing delivered while paused from the start");
      s.resume();
      await once(s, "end");
      assert.equal(at, data.length);
      s.destroy();
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: a callback that throws destroys the socket with that error; the process lives on", async () => {
    const { server, port } = await serveBytes(bytesOf(1000));
    try {
      const boom = new Error("callback failed");
      const s = connect(port, HOST, {
        builder: builder("client"),
        onread: {
          buffer: new Uint8Array(100),
          callback: () => {
            throw boom;
          },
        },
      });
      const [e] = (await once(s, "error")) as [Error];
      assert.equal(e, boom);
      await eventually(() => s.destroyed, DEADLINE, "the socket to close");
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: buffer() returning something other than a non-empty Uint8Array destroys the socket with INVALID_ARGUMENT", async () => {
    const { server, port } = await serveBytes(bytesOf(1000));
    try {
      const s = connect(port, HOST, { builder: builder("client"), onread: { buffer: () => new Uint8Array(0), callback: () => true } });
      const [e] = (await once(s, "error")) as [RdmaError];
      assert.ok(e instanceof RdmaError && e.code === "INVALID_ARGUMENT", String(e));
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: rdma.createStream({ onread }) over an existing connection: the bytes come through the callback, then 'end'", { timeout: 120_000 * SLOW }, async () => {
    const p = await apiPair();
    try {
      const data = bytesOf(RING / 2 + 99, 11);
      const parts: Buffer[] = [];
      const a = p.client.createStream({ onread: { buffer: new Uint8Array(50_000), callback: (n, buf) => void parts.push(Buffer.from(buf.subarray(0, n))) } });
      const b = p.server.createStream();
      b.end(data);
      await once(a, "end");
      assert.equal(sha(Buffer.concat(parts)), sha(data));
      await eventually(() => p.client.isClosed && p.server.isClosed, DEADLINE, "both connections closed once both ends");
    } finally {
      await p.close();
    }
  });

  // From review: the peer's end, and its close, while the socket is paused with bytes not yet delivered.

  /** The FIN's total the stream has taken from the peer (-1: none yet); the stream does not expose it. */
  const finAt = (s: RdmaStream): number => (s as unknown as { credit: { peerFinAt: number } }).credit.peerFinAt;

  /**
   * Dials with an onread whose callback returns false once `pauseAt` bytes were delivered; once `ready(s)`
   * holds (waited for with a deadline) checks that no 'end', 'close' or 'error' came while paused, resumes,
   * and resolves with what was delivered and the events after.
   */
  async function pausedReader(port: number, pauseAt: number, ready: (s: RdmaStream) => boolean, opts: { endFirst?: boolean } = {}): Promise<{ delivered: number; events: string[] }> {
    let delivered = 0;
    const events: string[] = [];
    let paused = false;
    const s = connect(port, HOST, {
      builder: builder("client"),
      onread: {
        buffer: new Uint8Array(16 * 1024),
        callback: (n) => {
          delivered += n;
          if (!paused && delivered >= pauseAt) {
            paused = true;
            return false;
          }
          return true;
        },
      },
    });
    if (opts.endFirst) s.once("connect", () => s.end("request"));
    s.on("error", (e) => events.push(`error ${e.message} @${delivered}`));
    s.on("end", () => events.push(`end @${delivered}`));
    s.on("close", () => events.push("close"));
    const closed = once(s, "close");
    await eventually(() => paused && ready(s), DEADLINE, "the paused socket's condition");
    assert.equal(events.join(", "), "", "nothing ends a socket while its delivery is stopped");
    events.push("resume");
    s.resume();
    await closed;
    return { delivered, events };
  }

  it("issue 21: the peer replies and ends after our end (its side then closes the connection) while we are paused: every byte, then 'end' (no reset)", { timeout: 120_000 * SLOW }, async () => {
    const N = 300_000;
    let closedAtServer = false;
    const { server, port } = await serveWith((s) => {
      s.resume();
      s.on("end", () => s.end(Buffer.alloc(N, 7)));
      s.on("close", () => (closedAtServer = true));
    });
    try {
      const r = await pausedReader(port, 1, (s) => s.bytesRead === N && closedAtServer, { endFirst: true });
      assert.deepEqual(r, { delivered: N, events: ["resume", `end @${N}`, "close"] });
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: the peer ends then destroys while we are paused (its end still reaches us, as net's): every byte, then 'end'", { timeout: 120_000 * SLOW }, async () => {
    const N = 300_000;
    let closedAtServer = false;
    const { server, port } = await serveWith((s) => {
      s.end(Buffer.alloc(N, 7), () => s.destroy());
      s.on("close", () => (closedAtServer = true));
    });
    try {
      const r = await pausedReader(port, 1, (s) => s.bytesRead === N && closedAtServer);
      assert.deepEqual(r, { delivered: N, events: ["resume", `end @${N}`, "close"] });
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: the peer's end arrives (connection open) while bytes wait undelivered: 'end' only once all are delivered", { timeout: 120_000 * SLOW }, async () => {
    const N = 300_000;
    const { server, port } = await serveWith((s) => s.end(Buffer.alloc(N, 7)));
    try {
      const r = await pausedReader(port, 1, (s) => s.bytesRead === N && finAt(s) === N);
      assert.deepEqual(r, { delivered: N, events: ["resume", `end @${N}`, "close"] });
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: as net, a socket paused by the callback's false on the last byte sees no 'end' before resume(), though the end has arrived", { timeout: 120_000 * SLOW }, async () => {
    let ender: (() => void) | null = null;
    const { server, port } = await serveWith((s) => {
      s.write(Buffer.alloc(1000, 7));
      ender = () => s.end();
    });
    try {
      let asked = false;
      const r = await pausedReader(port, 1000, (s) => {
        if (!asked && ender) {
          asked = true;
          ender(); // the end goes once the socket paused on its last byte
        }
        return finAt(s) === 1000;
      });
      assert.deepEqual(r, { delivered: 1000, events: ["resume", "end @1000", "close"] });
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: a 'readable' listener does not stop onread's delivery (as net's)", { timeout: 120_000 * SLOW }, async () => {
    const N = 300_000;
    const { server, port } = await serveWith((s) => s.end(Buffer.alloc(N, 7)));
    try {
      let delivered = 0;
      const s = connect(port, HOST, { builder: builder("client"), onread: { buffer: new Uint8Array(8192), callback: (n) => void (delivered += n) } });
      s.on("readable", () => {});
      await eventually(() => delivered === N, DEADLINE, `every byte delivered (${delivered} of ${N}, ${s.bytesRead} arrived)`);
      await eventually(() => s.readableEnded, DEADLINE, "'end'");
      s.destroy();
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: read() goes on with a delivery the callback's false stopped (as net's)", { timeout: 120_000 * SLOW }, async () => {
    const N = 200_000;
    const { server, port } = await serveWith((s) => s.end(Buffer.alloc(N, 7)));
    try {
      let delivered = 0;
      let first = true;
      const s = connect(port, HOST, {
        builder: builder("client"),
        onread: {
          buffer: new Uint8Array(8192),
          callback: (n) => {
            delivered += n;
            if (first) return (first = false);
            return true;
          },
        },
      });
      await eventually(() => !first && s.bytesRead === N, DEADLINE, "the stop and every byte arrived");
      assert.equal(delivered, 8192, "stopped after the first call");
      s.read(0);
      await eventually(() => delivered === N && s.readableEnded, DEADLINE, `the rest delivered after read(0) (${delivered})`);
      s.destroy();
    } finally {
      await closeServer(server);
    }
  });

  it("issue 21: closeConnection: false: ring credit for bytes delivered after the peer's stream ended never reaches the next stream on the connection", { timeout: 120_000 * SLOW }, async () => {
    const p = await apiPair();
    try {
      let calls = 0;
      const a = p.client.createStream({ closeConnection: false, allowHalfOpen: true, onread: { buffer: new Uint8Array(64 << 10), callback: () => ++calls > 1 } });
      const b = p.server.createStream({ closeConnection: false, allowHalfOpen: true });
      b.resume();
      a.end();
      b.end(Buffer.alloc(600_000, 1));
      await eventually(() => b.closed, DEADLINE, `the writer's stream to close (a: ${a.bytesRead} arrived)`);
      a.resume();
      await eventually(() => a.closed, DEADLINE, `the paused reader to end and close once resumed (${a.bytesRead} arrived, ended ${a.readableEnded})`);
      const b2 = p.server.createStream();
      const a2 = p.client.createStream();
      const errors: Error[] = [];
      b2.on("error", (e) => errors.push(e));
      a2.on("error", (e) => errors.push(e));
      a2.end(Buffer.alloc(1000, 2));
      a2.resume();
      let got = 0;
      b2.on("data", (d: Buffer) => (got += d.length));
      await eventually(() => b2.readableEnded || errors.length > 0, DEADLINE, "the next stream's end");
      assert.deepEqual(errors, []);
      assert.equal(got, 1000);
    } finally {
      await p.close();
    }
  });

  it("issue 21: a malformed onread is refused at connect() (and createStream()) with INVALID_ARGUMENT, before anything is dialed", async () => {
    const bad: unknown[] = [
      {},
      { buffer: new Uint8Array(8) },
      { callback: () => true },
      { buffer: new Uint8Array(0), callback: () => true },
      { buffer: "abc", callback: () => true },
      { buffer: new Uint8Array(8), callback: 1 },
      42,
    ];
    for (const onread of bad) {
      assert.throws(
        () => connect(1, HOST, { builder: builder("client"), onread: onread as OnRead }),
        (e: unknown) => e instanceof RdmaError && e.code === "INVALID_ARGUMENT",
        JSON.stringify(onread),
      );
    }
    const p = await apiPair();
    try {
      assert.throws(
        () => p.client.createStream({ onread: { buffer: new Uint8Array(0), callback: () => true } }),
        (e: unknown) => e instanceof RdmaError && e.code === "INVALID_ARGUMENT",
      );
      // the refused stream did not take the connection: another may still be opened on it
      const s = p.client.createStream();
      s.destroy();
    } finally {
      await p.close();
    }
  });
});
