/**
 * Issue 21 point 1: a user operation costs one promise. The promises that
 * receive() and send() create while they run are counted with async_hooks
 * (a count, not a time: it holds on any machine).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { createHook } from "node:async_hooks";
import { CM, PROVIDER, eventually, withApiPair } from "../support/api.js";
import { RdmaError } from "../../src/index.js";

/** Promises created while `fn` runs (synchronously), and its result. */
function counted<T>(fn: () => T): { n: number; v: T } {
  let n = 0;
  const h = createHook({ init: (_id, type) => void (type === "PROMISE" && n++) }).enable();
  try {
    const v = fn();
    return { n, v };
  } finally {
    h.disable();
  }
}

describe(`one promise per operation [${PROVIDER}, ${CM}]`, { timeout: 60_000 * (PROVIDER === "verbs" ? 4 : 1) }, () => {
  it("issue 21 point 1: receive() creates one promise, whether the message is there already or is waited for; send() creates one, of a LocalMr or of a plain buffer (copied)", () =>
    withApiPair(async ({ server, client }) => {
      const src = client.allocLocalMr(16);
      // Waited for: the receive is posted before the message comes.
      const waiting = counted(() => server.receive());
      assert.equal(waiting.n, 1, `a waiting receive() created ${waiting.n} promises`);
      const sent = counted(() => client.send(src));
      assert.equal(sent.n, 1, `send() created ${sent.n} promises`);
      await sent.v;
      (await waiting.v).dispose();
      // A plain buffer is copied into registered memory, freed when the send settles: still one promise.
      const waiting2 = server.receive();
      const live = client.stats().pool.liveAllocations;
      const copied = counted(() => client.send(new Uint8Array([1, 2, 3])));
      assert.equal(copied.n, 1, `send() of a Uint8Array created ${copied.n} promises`);
      await copied.v;
      const m = await waiting2;
      assert.deepEqual(m.bytes, new Uint8Array([1, 2, 3]));
      m.dispose();
      await eventually(() => client.stats().pool.liveAllocations === live, 30_000, "the staged copy to be freed once its send completed");
      // There already: the message arrived before receive() is called.
      await client.send(src);
      await eventually(() => server.stats().unread === 1, 30_000, "the message to arrive");
      const ready = counted(() => server.receive());
      assert.equal(ready.n, 1, `receive() of a message already there created ${ready.n} promises`);
      (await ready.v).dispose();
      src.dispose();
    }));

  it("issue 21 point 1: sendListened (the RPC outbox's sends) creates no promise and tells its listener exactly once: null when sent, the error when the connection ends first or was closed", () =>
    withApiPair(
      async ({ server, client }) => {
        const told = new Map<number, unknown[]>();
        const listener = (i: number) => ({ sent: (err: unknown) => void told.set(i, [...(told.get(i) ?? []), err]) });
        const src = client.allocLocalMr(64);
        src.bytes.fill(7);
        // Sent and received: told null, and no promise was made for it.
        const waiting = server.receive();
        const one = counted(() => client.sendListened(src, listener(0)));
        assert.equal(one.n, 0, `sendListened created ${one.n} promises`);
        const m = await waiting;
        assert.deepEqual(m.bytes, src.bytes);
        m.dispose();
        await eventually(() => told.has(0), 30_000, "the listener to be told");
        assert.deepEqual(told.get(0), [null]);
        // More than the peer's credits, never read: some complete, the rest wait queued; the peer
        // then closes and every one of them is told once, those still queued with the error.
        const n = 40;
        for (let i = 1; i <= n; i++) client.sendListened(src, listener(i));
        await eventually(() => server.stats().unread > 0, 30_000, "messages to arrive unread");
        await server.close();
        await eventually(() => told.size === n + 1, 60_000, `every listener to be told (${told.size - 1} of ${n})`);
        let errors = 0;
        for (let i = 1; i <= n; i++) {
          const t = told.get(i)!;
          assert.equal(t.length, 1, `listener ${i} told ${t.length} times`);
          if (t[0] !== null) {
            errors++;
            assert.ok(t[0] instanceof RdmaError, `listener ${i} told ${String(t[0])}`);
          }
        }
        assert.ok(errors > 0, "the sends queued beyond the peer's credits were told the error");
        // On a closed connection: refused, told later (not during the call), with CONNECTION_CLOSED.
        await eventually(() => client.isClosed, 30_000, "the client to see the close");
        const late: { told: boolean; err: unknown } = { told: false, err: undefined };
        client.sendListened(src, { sent: (err) => void Object.assign(late, { told: true, err }) });
        assert.equal(late.told, false, "a refusal is told asynchronously");
        await eventually(() => late.told, 30_000, "the refusal to be told");
        assert.ok(late.err instanceof RdmaError && late.err.code === "CONNECTION_CLOSED", `told ${String(late.err)}`);
        // The teardown came meanwhile: still told once each.
        for (let i = 0; i <= n; i++) assert.equal(told.get(i)!.length, 1, `listener ${i} told ${told.get(i)!.length} times by the end`);
      },
      { server: (b) => b.setRecvDepth(8) },
    ));
});

