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
  const server = createServer({ builder: builder("server") }, (s) => {
    sockets.push(s);
    s.on("error", () => {});
    void (async () => {
      for (let off = 0; off < data.length; off += 64 * 1024) {
        if (!s.write(data.subarray(off, Math.min(data.length, off + 64 * 1024)))) await once(s, "drain");
      }
      s.end();
    })().catch(() => {});
  });
  server.listen(0, HOST);
  await once(server, "listening");
  return { server, port: server.address()!.port, sockets };
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
