/**
 * Issue 22 point 4: observability.
 *
 * - NODE_DEBUG=async-rdma logs connection setup, errors and teardown (and
 *   nothing without it);
 * - diagnostics_channel: connection open/close/error and each operation's
 *   start/end, under "async-rdma:";
 * - rdma.stats() and listener.stats() count what they say.
 *
 * Runs on tcp, and on rxe in the verbs suite (api/ files).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { subscribe, unsubscribe } from "node:diagnostics_channel";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { spawn } from "node:child_process";
import { CHANNELS, RdmaError, type ConnectionEndMessage, type OperationMessage, type Rdma } from "../../src/index.js";
import { CM, PROVIDER, apiPair, at, builder, eventually, pattern } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const here = dirname(fileURLToPath(import.meta.url));
const childJs = join(here, "..", "support", "lifecycle-child.js");
const DEADLINE = 60_000 * SLOW;

/** Runs the "talk" child against a fresh listener; resolves with its exit code and stderr. */
async function talkChild(env: NodeJS.ProcessEnv): Promise<{ code: number | null; err: string }> {
  const listener = await builder("server").bind(at(0));
  try {
    const child = spawn(process.execPath, [childJs, at(listener.port), "talk"], { env, stdio: ["ignore", "pipe", "pipe"] });
    let err = "";
    let out = "";
    child.stderr.on("data", (d: Buffer) => (err += d));
    child.stdout.on("data", (d: Buffer) => (out += d));
    const exited = new Promise<number | null>((resolve, reject) => {
      const t = setTimeout(() => (child.kill("SIGKILL"), reject(new Error(`the child did not exit within ${DEADLINE} ms:\n${out}\n${err}`))), DEADLINE);
      child.once("exit", (c) => (clearTimeout(t), resolve(c)));
    });
    exited.catch(() => {});
    // The child exiting first (a failed connect) ends the wait with what it printed.
    const server = await Promise.race([listener.accept({ timeoutMs: DEADLINE }), exited.then((c) => Promise.reject(new Error(`the child exited (${c}) before connecting:\n${out}\n${err}`)))]);
    (await server.receive()).dispose();
    const code = await exited;
    await server.close();
    return { code, err };
  } finally {
    await listener.close();
  }
}

describe(`observability [${PROVIDER}, ${CM}]`, { timeout: 10 * DEADLINE }, () => {
  it("issue 22 point 4: NODE_DEBUG=async-rdma logs setup and teardown; without it nothing", async () => {
    const on = await talkChild({ ...process.env, NODE_DEBUG: "async-rdma" });
    assert.equal(on.code, 0, on.err);
    assert.match(on.err, /ASYNC-RDMA \d+: connect to \S+:\d+ \(/);
    assert.match(on.err, /ASYNC-RDMA \d+: connection open: (tcp|verbs) provider, device \S+, peer \S+:\d+/);
    assert.match(on.err, /ASYNC-RDMA \d+: close: peer/);
    assert.match(on.err, /ASYNC-RDMA \d+: connection closed: peer/);
    const env = { ...process.env };
    delete env.NODE_DEBUG;
    const off = await talkChild(env);
    assert.equal(off.code, 0, off.err);
    assert.doesNotMatch(off.err, /ASYNC-RDMA/);
  });

  it("issue 22 point 4: a failed connect is logged with its code", async () => {
    const listener = await builder("server").bind(at(0));
    const port = listener.port;
    await listener.close();
    const child = spawn(process.execPath, ["--input-type=module", "-e", `import { builder } from ${JSON.stringify(join(here, "..", "support", "api.js"))}; await builder("client").setConnectTimeout(2000).connect(${JSON.stringify(at(port))}).catch((e) => console.log("refused", e.code));`], { env: { ...process.env, NODE_DEBUG: "async-rdma" }, stdio: ["ignore", "pipe", "pipe"] });
    let err = "";
    let out = "";
    child.stderr.on("data", (d: Buffer) => (err += d));
    child.stdout.on("data", (d: Buffer) => (out += d));
    const code = await new Promise<number | null>((resolve) => child.once("exit", resolve));
    assert.equal(code, 0, err);
    assert.match(out, /^refused /m);
    assert.match(err, /ASYNC-RDMA \d+: connect to \S+ failed: [A-Z_]+: /);
  });

  it("issue 22 point 4: diagnostics_channel publishes connection open/close/error and each operation's start and end", async () => {
    // The operation message is one object published at start and at end: each event is recorded as it was then.
    const events: { ch: string; msg: unknown; at: Record<string, unknown> }[] = [];
    const subs = Object.values(CHANNELS).map((name) => {
      const fn = (msg: unknown): void => void events.push({ ch: name, msg, at: { ...(msg as object) } });
      subscribe(name, fn);
      return () => unsubscribe(name, fn);
    });
    try {
      const p = await apiPair();
      const { client, server } = p;
      const opened = events.filter((e) => e.ch === CHANNELS.open).map((e) => (e.msg as { rdma: Rdma }).rdma);
      assert.ok(opened.includes(client) && opened.includes(server), "open for both ends");
      await client.send(pattern(100, 1));
      (await server.receive()).dispose();
      await assert.rejects(client.send(pattern(1, 1), { signal: AbortSignal.abort() }));
      const ops = events.filter((e) => e.ch === CHANNELS.operationStart || e.ch === CHANNELS.operationEnd).map((e) => ({ ch: e.ch, ...(e.at as unknown as OperationMessage) }));
      const mine = ops.filter((o) => o.rdma === client || o.rdma === server).map((o) => `${o.ch.split(":").pop()} ${o.operation} ${o.bytes}${o.error ? ` ${(o.error as RdmaError).code}` : ""}`);
      assert.deepEqual(mine, ["start send 100", "end send 100", "start receive 0", "end receive 100", "start send 1", "end send 1 ABORTED"]);
      // A clean close: close, no error; then a failure: close and error, with the typed error.
      await server.close();
      await eventually(() => client.isClosed, DEADLINE, "the client to see the close");
      const ends = events.filter((e) => e.ch === CHANNELS.close).map((e) => e.msg as ConnectionEndMessage);
      assert.deepEqual(ends.filter((m) => m.rdma === server || m.rdma === client).map((m) => m.error), [undefined, undefined]);
      const q = await apiPair();
      const failure = new RdmaError("RETRY_EXCEEDED", "test: the peer made no progress");
      q.client.conn.fail(failure);
      await q.client.closed.catch(() => {});
      const errs = events.filter((e) => e.ch === CHANNELS.error).map((e) => e.msg as ConnectionEndMessage);
      assert.deepEqual(errs.filter((m) => m.rdma === q.client).map((m) => m.error), [failure]);
      await q.close();
      await p.close();
    } finally {
      for (const u of subs) u();
    }
  });

  it("issue 22 point 4: rdma.stats() counts messages, bytes, rendezvous, stalls and memory; listener.stats() counts connections", async () => {
    const listener = await builder("server").setRecvDepth(8).bind(at(0));
    try {
      assert.deepEqual(listener.stats(), { handshakes: 0, rejected: 0, sockets: 0, connections: 0, accepted: 0, waiting: 0 });
      const client = await builder("client").connect(at(listener.port));
      await eventually(() => listener.stats().accepted === 1, DEADLINE, "the listener to count the connection");
      assert.equal(listener.stats().waiting, 1);
      assert.equal(listener.stats().connections, 1);
      const server = await listener.accept();
      assert.equal(listener.stats().waiting, 0);
      try {
        const sizes = [10, 0, 4096, 200_000, 33];
        for (const n of sizes) await client.send(pattern(n, n));
        for (let i = 0; i < sizes.length; i++) (await server.receive()).dispose();
        const total = sizes.reduce((a, b) => a + b, 0);
        const c = client.stats();
        const s = server.stats();
        assert.equal(c.messagesSent, 5);
        assert.equal(c.bytesSent, total);
        assert.equal(c.rendezvousSent, 1);
        assert.equal(s.messagesReceived, 5);
        assert.equal(s.bytesReceived, total);
        assert.equal(s.rendezvousReceived, 1);
        assert.equal(c.messagesReceived, 0);
        assert.equal(c.rnrRetries, PROVIDER === "tcp" ? 0 : null);
        // A reader that does not read: the sender stalls on credits, with operations in flight.
        const sends = Array.from({ length: 40 }, (_, i) => client.send(pattern(64, i)));
        await eventually(() => client.stats().creditStalls > 0, DEADLINE, "a credit stall");
        assert.ok(client.stats().operationsInFlight > 0);
        await eventually(() => server.stats().memory.unreadMessages > 0, DEADLINE, "unread messages at the server");
        for (let i = 0; i < 40; i++) (await server.receive()).dispose();
        await Promise.all(sends);
        await eventually(() => client.stats().operationsInFlight === 0, DEADLINE, "nothing in flight");
        using mine = client.registerMr(new ArrayBuffer(3000));
        assert.equal(client.stats().memory.registeredBytes, 3000);
        assert.ok(client.stats().memory.poolBytes > 0);
        mine.dispose();
        assert.equal(client.stats().memory.registeredBytes, 0);
      } finally {
        await Promise.all([client.close(), server.close()]);
      }
      await eventually(() => listener.stats().connections === 0, DEADLINE, "the listener to count the end");
    } finally {
      await listener.close();
    }
  });
});
