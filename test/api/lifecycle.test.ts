/**
 * Issue 22 point 2: a connection's life as a Node developer sees it.
 *
 * - messages() yields every message in order and ends (no error) when the
 *   peer closes; a failure throws its typed error;
 * - `closed` resolves for a clean close (either side), rejects with the typed
 *   error for a failure, and never is an unhandled rejection;
 * - unref() lets a process with an open, idle connection (a receive pending)
 *   exit by itself;
 * - close({ flush: true }) loses nothing under a slow reader: it resolves
 *   once the peer received everything sent before, eager and rendezvous.
 *
 * Runs on tcp, and on rxe in the verbs suite (api/ files).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { RdmaError, peerMemoryUsage, setPeerMemoryLimit, type LocalMr } from "../../src/index.js";
import { CM, PROVIDER, apiPair, at, builder, eventually, pattern } from "../support/api.js";
import { SLOW } from "../support/seam.js";
import { spawnNode } from "../support/procs.js";

const here = dirname(fileURLToPath(import.meta.url));
const childJs = join(here, "..", "support", "lifecycle-child.js");
const DEADLINE = 60_000 * SLOW;

function isCode(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

/** Eager, empty and rendezvous sizes (the default eager threshold is 4 KiB). */
const SIZES = [16, 0, 4096, 100_000, 1, 70_000, 512, 1_000_000, 33];

describe(`connection lifecycle [${PROVIDER}, ${CM}]`, { timeout: 10 * DEADLINE }, () => {
  it("issue 22 point 2: messages() yields every message in order and ends cleanly when the peer closes", async () => {
    const p = await apiPair();
    try {
      const { client, server } = p;
      await Promise.all(SIZES.map((n, i) => client.send(pattern(n, i + 1))));
      await client.close();
      const got: Buffer[] = [];
      for await (const msg of server.messages()) {
        using m = msg;
        got.push(Buffer.from(m.bytes));
      }
      assert.equal(got.length, SIZES.length);
      SIZES.forEach((n, i) => assert.ok(got[i]!.equals(pattern(n, i + 1)), `message ${i} (${n} bytes)`));
      // The loop ended because the connection did; the end is clean on both sides.
      await server.closed;
      await client.closed;
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 2: messages() ends cleanly when this side closes while it waits", async () => {
    const p = await apiPair();
    try {
      const loop = (async () => {
        let n = 0;
        for await (const m of p.server.messages()) (n++, m.dispose());
        return n;
      })();
      await p.client.send(Buffer.from("one"));
      await eventually(() => p.server.stats().messagesReceived === 1, DEADLINE, "the message to arrive");
      await p.server.close();
      assert.equal(await loop, 1);
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 2: a failure ends messages() with its typed error and rejects closed with it, never unhandled", async () => {
    const unhandled: unknown[] = [];
    const onUnhandled = (e: unknown): void => void unhandled.push(e);
    process.on("unhandledRejection", onUnhandled);
    const p = await apiPair();
    try {
      const { client } = p;
      const loop = (async () => {
        for await (const m of client.messages()) m.dispose();
      })();
      // The agent's own failure path (as a liveness expiry takes it).
      const failure = new RdmaError("RETRY_EXCEEDED", "test: the peer made no progress");
      client.conn.fail(failure);
      await assert.rejects(loop, (e) => e === failure);
      await assert.rejects(client.closed, (e) => e === failure);
      // The server's end is not observed at all: it must not surface as an unhandled rejection.
      await eventually(() => p.server.isClosed, DEADLINE, "the server to notice");
      for (let i = 0; i < 3; i++) await new Promise((r) => setImmediate(r));
      assert.deepEqual(unhandled, []);
      await p.server.closed.catch(() => {});
    } finally {
      process.off("unhandledRejection", onUnhandled);
      await p.close();
    }
  });

  it("issue 22 point 2: closed resolves (undefined) on both sides after a clean close", async () => {
    const p = await apiPair();
    try {
      assert.equal(p.client.isClosed, false);
      await p.server.close();
      assert.equal(await p.server.closed, undefined);
      assert.equal(await p.client.closed, undefined);
      assert.equal(p.client.isClosed, true);
    } finally {
      await p.close();
    }
  });

  for (const mode of PROVIDER === "verbs" ? ["unref", "unref-busy"] : ["unref"]) {
    it(`issue 22 point 2: unref() lets a process with an open, idle connection exit (${mode})`, async () => {
      const listener = await builder("server").bind(at(0));
      const kid = spawnNode(childJs, [at(listener.port), mode], `lifecycle child (${mode})`);
      try {
        const server = await listener.accept({ timeoutMs: DEADLINE });
        await kid.waitFor(/^ready$/m, DEADLINE);
        // The child's script has ended; only an open connection could keep it running.
        assert.equal(await kid.exited(DEADLINE), 0);
        await server.close();
      } finally {
        kid.child.kill("SIGKILL");
        await listener.close();
      }
    });
  }

  it("issue 22 point 2: close({ flush: true }) loses nothing under a slow reader (eager and rendezvous)", async () => {
    // A small receive depth: the sender runs out of credits long before it is done.
    const p = await apiPair({ server: (b) => b.setRecvDepth(8) });
    try {
      const { client, server } = p;
      const N = 120;
      const size = (i: number): number => (i % 20 === 7 ? 50_000 + i : 200 + i);
      const sends = Array.from({ length: N }, (_, i) => client.send(pattern(size(i), i + 7)));
      sends.forEach((s) => s.catch(() => {})); // checked below
      await eventually(() => client.stats().creditStalls > 0, DEADLINE, "the sender to wait for credits");
      const closing = client.close({ flush: true, timeoutMs: 4 * DEADLINE });
      // The reader starts only now, and reads one message per event-loop turn.
      const got: LocalMr[] = [];
      for await (const m of server.messages()) {
        got.push(m);
        await new Promise((r) => setImmediate(r));
      }
      await closing;
      const settled = await Promise.allSettled(sends);
      assert.deepEqual(settled.filter((s) => s.status === "rejected"), [], "every send resolved");
      assert.equal(got.length, N, "every message reached the reader");
      got.forEach((m, i) => assert.ok(Buffer.from(m.bytes).equals(pattern(size(i), i + 7)), `message ${i}`));
      for (const m of got) m.dispose();
      await client.closed;
      await server.closed;
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 2: a flushing close whose peer never reads gives up at timeoutMs with TIMEOUT; the sends not taken reject", async () => {
    const p = await apiPair({ server: (b) => b.setRecvDepth(8) });
    try {
      const { client } = p;
      const sends = Array.from({ length: 60 }, (_, i) => client.send(pattern(100, i)));
      sends.forEach((s) => s.catch(() => {}));
      await eventually(() => client.stats().creditStalls > 0, DEADLINE, "the sender to wait for credits");
      let failure: unknown;
      await assert.rejects(client.close({ flush: true, timeoutMs: 300 }), (e) => ((failure = e), isCode("TIMEOUT")(e)));
      const settled = await Promise.allSettled(sends);
      assert.ok(settled.some((s) => s.status === "rejected"), "what the peer did not take is reported on its send");
      // issue 22 point 2 (review): the connection did not end cleanly, and `closed` says so with the same error;
      // a later close() (as `await using` makes) does not repeat it.
      await assert.rejects(client.closed, (e) => e === failure);
      await client.close();
      await client.close({ flush: true });
    } finally {
      await p.close();
    }
  });

  it("issue 22 point 2 (review): while a flushing close waits the connection stays live: a peer that stopped answering fails it (RETRY_EXCEEDED), not the close's timeout", async () => {
    const p = await apiPair({ client: (b) => b.setKeepalive(50).setPeerTimeout(500 * SLOW).setRendezvousTimeout(0) });
    const limit = peerMemoryUsage().limit;
    setPeerMemoryLimit(peerMemoryUsage().used); // the receiver cannot take the message: the flush waits
    try {
      const { client, server } = p;
      // The server's agent stops answering (as SIGSTOP would; the device may still ACK).
      (server.conn as unknown as { arrivals: { onControl: (m: unknown) => void } }).arrivals.onControl = () => {};
      (server.conn as unknown as { live: { stop: () => void } }).live.stop();
      const sent = client.send(pattern(100_000, 3));
      sent.catch(() => {});
      await eventually(() => client.stats().rendezvousOut === 1, DEADLINE, "the rendezvous message to be announced");
      const closing = client.close({ flush: true, timeoutMs: 2 ** 31 - 1 });
      await assert.rejects(closing, isCode("RETRY_EXCEEDED"));
      await assert.rejects(client.closed, isCode("RETRY_EXCEEDED"));
      await assert.rejects(sent, (e: unknown) => e instanceof RdmaError);
    } finally {
      setPeerMemoryLimit(limit);
      await p.close();
    }
  });

  it("issue 22 point 2 (review): a rendezvous send aborted while a flushing close waits is cancelled with the peer, and the close completes", async () => {
    const p = await apiPair();
    const limit = peerMemoryUsage().limit;
    setPeerMemoryLimit(peerMemoryUsage().used); // the receiver cannot take the message
    try {
      const { client, server } = p;
      const ac = new AbortController();
      const sent = client.send(pattern(100_000, 5), { signal: ac.signal });
      sent.catch(() => {});
      await eventually(() => server.stats().unread === 1, DEADLINE, "the announcement");
      const closing = client.close({ flush: true, timeoutMs: DEADLINE });
      ac.abort();
      await assert.rejects(sent, isCode("ABORTED"));
      await closing; // the peer answered the cancel: nothing sent is left untaken
      await client.closed;
    } finally {
      setPeerMemoryLimit(limit);
      await p.close();
    }
  });

  it("issue 22 point 2: close() options are checked; a closed connection's flushing close resolves", async () => {
    const p = await apiPair();
    try {
      await assert.rejects(p.client.close({ flush: 1 as unknown as boolean }), isCode("INVALID_ARGUMENT"));
      await assert.rejects(p.client.close({ timeoutMs: 0 }), isCode("INVALID_ARGUMENT"));
      await p.server.close();
      await p.client.closed;
      await p.client.close({ flush: true });
    } finally {
      await p.close();
    }
  });
});
