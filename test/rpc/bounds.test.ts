/**
 * async-rdma/rpc against hostile and careless peers (issue 19): what a
 * client can make an RpcServer hold (point 7), a call the server would
 * refuse must not poison the RpcClient (point 15), and a handler's
 * structured error details reach the caller (point 19).
 *
 * The hostile client is a raw Rdma connection sending hand-built frames
 * (the format in src/rpc/index.ts's opening comment), so it can do what an
 * RpcClient never does: put thousands of calls in one message, and never
 * read a reply. Provider-neutral: these run in the verbs suite too.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, type Rdma } from "../../src/index.js";
import { RpcClient, RpcError, RpcServer } from "../../src/rpc/index.js";
import { CM, PROVIDER, apiPair, eventually } from "../support/api.js";
import { gc } from "../support/fuzz.js";

const SLOW = PROVIDER === "verbs" ? 4 : 1;
const WAIT_MS = 60_000 * SLOW;
const MiB = 2 ** 20;

/** CALL frames of `method`, ids `first`.., each with `payload` (the wire format of src/rpc/index.ts). */
function callFrames(method: string, first: number, count: number, payload = new Uint8Array(0)): Uint8Array {
  const m = new TextEncoder().encode(method);
  const one = 12 + m.length + payload.length;
  const out = new Uint8Array(one * count);
  const v = new DataView(out.buffer);
  for (let i = 0; i < count; i++) {
    const o = i * one;
    v.setUint8(o, 0x52);
    v.setUint8(o + 1, 1);
    v.setUint16(o + 2, m.length);
    v.setUint32(o + 4, first + i);
    v.setUint32(o + 8, payload.length);
    out.set(m, o + 12);
    out.set(payload, o + 12 + m.length);
  }
  return out;
}

/** Sends `bytes` as one message on the raw connection. */
function sendRaw(rdma: Rdma, bytes: Uint8Array): Promise<void> {
  const lmr = rdma.allocLocalMr(bytes.length);
  lmr.bytes.set(bytes);
  return rdma.send(lmr).finally(() => lmr[Symbol.dispose]());
}

/** Reads replies on the raw connection, counting their frames, until it closes. */
async function countReplies(rdma: Rdma, seen: { frames: number }): Promise<void> {
  for (;;) {
    let msg;
    try {
      msg = await rdma.receive();
    } catch {
      return;
    }
    const b = msg.bytes;
    const v = new DataView(b.buffer, b.byteOffset, b.byteLength);
    for (let off = 0; off + 12 <= b.length; off += 12 + v.getUint16(off + 2) + v.getUint32(off + 8)) seen.frames++;
    msg[Symbol.dispose]();
  }
}

/** Heap and external memory (ArrayBuffers, registered memory) after full GCs, in MiB. */
async function heldMiB(): Promise<number> {
  for (let i = 0; i < 4; i++) {
    gc();
    await new Promise((r) => setImmediate(r));
  }
  const u = process.memoryUsage();
  return (u.heapUsed + u.external) / MiB;
}

/** A gate that handlers wait on until the test opens it. */
function gate(): { wait: Promise<void>; open(): void } {
  let open!: () => void;
  const wait = new Promise<void>((r) => (open = r));
  return { wait, open };
}

describe(`rpc bounds [${PROVIDER}, ${CM}]`, { timeout: 300_000 * SLOW }, () => {
  it("issue 19 point 7: the server's bounds are checked when it is made", () => {
    const bad = (opts: Record<string, unknown>): void => assert.throws(() => new RpcServer({}, opts), (e: unknown) => e instanceof RdmaError && e.code === "INVALID_ARGUMENT", JSON.stringify(opts));
    for (const v of [0, -1, 1.5, Number.NaN, "1"]) {
      bad({ maxInFlight: v });
      bad({ maxQueuedBytes: v });
    }
    for (const v of [-1, 1.5, 2 ** 32, "1"]) bad({ replyTimeoutMs: v });
    assert.ok(new RpcServer({}, { maxInFlight: 1, maxQueuedBytes: 1, replyTimeoutMs: 0 }));
  });

  it("issue 19 point 7: maxInFlight holds per call: one message of 5,000 CALL frames runs at most 128 handlers at once (the default), the rest wait", async () => {
    const p = await apiPair();
    let running = 0;
    let peak = 0;
    let handled = 0;
    const g = gate();
    const server = new RpcServer({
      hold: async () => {
        running++;
        peak = Math.max(peak, running);
        await g.wait;
        running--;
        handled++;
        return new Uint8Array([1]);
      },
    });
    const served = server.serve(p.server);
    const replies = { frames: 0 };
    const reading = countReplies(p.client, replies);
    try {
      const N = 5000;
      await sendRaw(p.client, callFrames("hold", 1, N));
      await eventually(() => running >= 128, WAIT_MS, "128 handlers to start");
      // The server starts the frames of a message one by one: had it ignored the limit, all
      // 5,000 would have started in the same turn that started these.
      assert.equal(peak, 128, "handlers running at once");
      g.open();
      await eventually(() => replies.frames === N, WAIT_MS, "every call to be answered");
      assert.equal(handled, N);
      assert.ok(peak <= 128, `at most 128 handlers ran at once (peak ${peak})`);
      const s = server.stats();
      assert.ok(s.peakInFlight <= 128, `at most 128 calls counted at once, replies unsent included (peak ${s.peakInFlight})`);
    } finally {
      await p.close();
    }
    await served;
    await reading;
    await eventually(() => server.stats().connections === 0, WAIT_MS, "the server to let the connection go");
  });

  it("issue 19 point 7: a client that never reads its replies is held back, not buffered: the server stops reading its calls once unsent replies reach maxQueuedBytes, and frees everything when it goes", async () => {
    const REPLY = 64 * 1024;
    const maxInFlight = 32;
    const maxQueuedBytes = 1 * MiB;
    // 2,000 calls whose replies, all held, would be 125 MiB.
    const MESSAGES = 40;
    const PER_MESSAGE = 50;
    const total = MESSAGES * PER_MESSAGE;
    const before = await heldMiB();
    const p = await apiPair();
    let handled = 0;
    const server = new RpcServer(
      {
        big: () => {
          handled++;
          return new Uint8Array(REPLY).fill(handled & 0xff);
        },
      },
      // no reply deadline here: the client is held back for as long as the test looks
      { maxInFlight, maxQueuedBytes, replyTimeoutMs: 0 },
    );
    const served = server.serve(p.server);
    // The hostile client sends every call and never calls receive(); its sends wait for credits
    // once the server stops reading.
    const sends: Promise<unknown>[] = [];
    for (let i = 0; i < MESSAGES; i++) sends.push(sendRaw(p.client, callFrames("big", 1 + i * PER_MESSAGE, PER_MESSAGE)).catch((e: unknown) => e));
    try {
      // The server stopped reading: the client's messages pile up unread at the server, up to
      // what the connection keeps unread (half the receive depth).
      await eventually(() => p.server.stats().unread >= 16, WAIT_MS, "the server to stop reading the client's messages");
      // The steady state: the client's receive buffers are all taken (the server has fewer
      // credits than a data message needs), replies wait for credits, and the server waits
      // for room. Nothing moves until the client reads.
      await eventually(() => p.server.stats().credits < 5 && server.stats().waiting === 1 && server.stats().queuedBytes >= maxQueuedBytes, WAIT_MS, "the server to wait for the client to read");
      const s = server.stats();
      assert.ok(handled < total / 4, `the server stopped taking calls (${handled} of ${total} handled)`);
      assert.ok(s.peakInFlight <= maxInFlight, `calls in flight stayed within maxInFlight (peak ${s.peakInFlight})`);
      const bound = maxQueuedBytes + maxInFlight * (REPLY + 12);
      assert.ok(s.peakQueuedBytes <= bound, `unsent reply bytes stayed within maxQueuedBytes plus maxInFlight replies (peak ${s.peakQueuedBytes}, bound ${bound})`);
      const held = (await heldMiB()) - before;
      // Both ends are in this process: the server's bounded replies, what the client's connection
      // keeps unread, buffers and pools; unbounded, the replies alone would be 125 MiB.
      assert.ok(held < 40, `memory held while the client does not read: ${held.toFixed(1)} MiB`);
    } finally {
      await p.client.close();
    }
    await served;
    await eventually(() => server.stats().connections === 0, WAIT_MS, "the server to free the connection's replies");
    const s = server.stats();
    assert.equal(s.queuedBytes, 0);
    assert.equal(s.unsentReplies, 0);
    assert.equal(s.running, 0);
    await p.close();
    await Promise.all(sends);
    const after = (await heldMiB()) - before;
    assert.ok(after < 16, `memory after the connection ended: ${after.toFixed(1)} MiB over the start`);
  });

  it("a peer's large eager threshold does not size the server's reply buffers: small replies the client never takes hold 4 KiB batches, not 1 MiB ones", async () => {
    // The client advertises the largest eager threshold (1 MiB) and never reads; each call is
    // its own message and each reply is sent in its own turn, so each is a batch of its own.
    const p = await apiPair({ client: (b) => b.setEagerThreshold(MiB) });
    const server = new RpcServer({ small: async () => (await new Promise((r) => setImmediate(r)), new Uint8Array(8)) }, { replyTimeoutMs: 0 });
    const served = server.serve(p.server);
    const CALLS = 120;
    const sends: Promise<unknown>[] = [];
    try {
      const base = p.server.stats().memory.poolBytes;
      for (let i = 0; i < CALLS; i++) sends.push(sendRaw(p.client, callFrames("small", 1 + i, 1)).catch((e: unknown) => e));
      // Past what the client's receive buffers take, replies wait in the server's send queue
      // for credits the client never returns, each holding its batch buffer.
      await eventually(() => server.stats().unsentReplies >= 40, WAIT_MS, "replies waiting for the client");
      const held = p.server.stats().memory.poolBytes - base;
      assert.ok(held < 4 * MiB, `the server's pool grew by ${(held / MiB).toFixed(1)} MiB for ${server.stats().unsentReplies} unsent 8-byte replies`);
    } finally {
      await p.client.close();
    }
    await served;
    await p.close();
    await Promise.all(sends);
  });

  it("issue 19 point 7: a client that takes none of its waiting replies within replyTimeoutMs loses its connection (serve() rejects TIMEOUT); everything is freed", async () => {
    const p = await apiPair();
    const server = new RpcServer({ big: () => new Uint8Array(64 * 1024) }, { maxInFlight: 8, maxQueuedBytes: 256 * 1024, replyTimeoutMs: 300 });
    const served = server.serve(p.server);
    const sends: Promise<unknown>[] = [];
    for (let i = 0; i < 40; i++) sends.push(sendRaw(p.client, callFrames("big", 1 + i * 50, 50)).catch((e: unknown) => e));
    try {
      await assert.rejects(served, (e: unknown) => e instanceof RdmaError && e.code === "TIMEOUT" && /replyTimeoutMs/.test(e.message));
      await eventually(() => p.server.isClosed, WAIT_MS, "the server to close the connection");
      await eventually(() => server.stats().connections === 0, WAIT_MS, "the server to free the connection's replies");
      assert.equal(server.stats().queuedBytes, 0);
    } finally {
      await p.close();
    }
    await Promise.all(sends);
  });

  it("issue 19 point 7: a connection that ends while every call slot is taken by a handler that never returns ends its serve(); the handlers' signals abort", async () => {
    const p = await apiPair();
    let started = 0;
    let aborted = 0;
    const server = new RpcServer(
      {
        wait: (_b, ctx) =>
          new Promise<void>((resolve) => {
            started++;
            ctx.signal.addEventListener("abort", () => {
              aborted++;
              resolve();
            });
          }),
      },
      { maxInFlight: 4 },
    );
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    const calls = Array.from({ length: 10 }, () => client.call("wait").catch((e: unknown) => e));
    await eventually(() => started >= 4 && server.stats().waiting === 1, WAIT_MS, "every call slot to be taken");
    assert.equal(started, 4, "handlers started");
    await client.close();
    await served;
    await eventually(() => aborted === 4, WAIT_MS, "the handlers to see the connection end");
    for (const r of await Promise.all(calls)) assert.ok(r instanceof RdmaError && r.code === "CONNECTION_CLOSED", String(r));
    assert.equal(server.stats().connections, 0);
    await p.close();
  });

  it("issue 19 point 15: a call larger than the server's maxMessageSize fails alone (OUT_OF_RANGE); a 5-byte call after it succeeds", async () => {
    const p = await apiPair({ server: (b) => b.setMaxMessageSize(64 * 1024) });
    const server = new RpcServer({ echo: (b) => b });
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    try {
      const big = client.call("echo", new Uint8Array(100 * 1024));
      const small = client.call("echo", new Uint8Array([1, 2, 3, 4, 5]));
      await assert.rejects(big, (e: unknown) => e instanceof RdmaError && e.code === "OUT_OF_RANGE" && /maxMessageSize/.test(e.message));
      assert.deepEqual([...(await small)], [1, 2, 3, 4, 5]);
      assert.deepEqual([...(await client.call("echo", new Uint8Array([6, 7, 8, 9, 10])))], [6, 7, 8, 9, 10]);
      // the largest call that fits still goes through
      const fits = new Uint8Array(64 * 1024 - 12 - 4).fill(3);
      assert.equal((await client.call("echo", fits)).length, fits.length);
    } finally {
      await p.close();
    }
    await served;
  });

  it("issue 19 point 15: a reply larger than the client's maxMessageSize fails that call only (OUT_OF_RANGE); the connection lives on", async () => {
    const p = await apiPair({ client: (b) => b.setMaxMessageSize(64 * 1024) });
    const server = new RpcServer({ big: () => new Uint8Array(100 * 1024), echo: (b) => b });
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    try {
      await assert.rejects(client.call("big"), (e: unknown) => e instanceof RpcError && e.code === "OUT_OF_RANGE" && /maxMessageSize/.test(e.message));
      assert.deepEqual([...(await client.call("echo", new Uint8Array([1, 2, 3, 4, 5])))], [1, 2, 3, 4, 5]);
      assert.equal(p.client.isClosed, false);
    } finally {
      await p.close();
    }
    await served;
  });

  it("issue 19 point 19: a handler error's details reach the caller as rpcError.details; too large or not JSON: left out, code and message intact", async () => {
    const p = await apiPair();
    const cyclic: Record<string, unknown> = { a: 1 };
    cyclic.self = cyclic;
    const server = new RpcServer({
      quota: () => {
        throw Object.assign(new Error("over quota"), { code: "EQUOTA", details: { used: 5, limit: 4, files: ["a", "b"], nested: { ok: true, none: null } } });
      },
      list: () => {
        throw Object.assign(new Error("listed"), { code: "ELIST", details: [1, "two", 3] });
      },
      huge: () => {
        throw Object.assign(new Error("huge details"), { code: "EHUGE", details: { blob: "x".repeat(20_000) } });
      },
      cycle: () => {
        throw Object.assign(new Error("cyclic details"), { code: "ECYCLE", details: cyclic });
      },
      plain: () => {
        // fields of its own that are not `details` stay on the server (a system error's path, say)
        throw Object.assign(new Error("plain"), { code: "ENOENT", path: "/srv/secret/file", errno: -2 });
      },
    });
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    const caught = async (method: string): Promise<RpcError> => {
      const e = await client.call(method).then(
        () => null,
        (x: unknown) => x,
      );
      assert.ok(e instanceof RpcError, `${method}: expected an RpcError, got ${String(e)}`);
      return e;
    };
    try {
      const q = await caught("quota");
      assert.equal(q.code, "EQUOTA");
      assert.match(q.message, /over quota/);
      assert.deepEqual(q.details, { used: 5, limit: 4, files: ["a", "b"], nested: { ok: true, none: null } });
      assert.deepEqual((await caught("list")).details, [1, "two", 3]);
      const h = await caught("huge");
      assert.equal(h.code, "EHUGE");
      assert.match(h.message, /huge details/);
      assert.equal(h.details, undefined);
      const c = await caught("cycle");
      assert.equal(c.code, "ECYCLE");
      assert.equal(c.details, undefined);
      const pl = await caught("plain");
      assert.equal(pl.code, "ENOENT");
      assert.equal(pl.details, undefined);
      assert.ok(!JSON.stringify(pl).includes("/srv/secret"));
      assert.equal((await caught("nope")).details, undefined);
    } finally {
      await p.close();
    }
    await served;
  });
});
