/**
 * Issue 21 point 1: a user operation costs one promise. The promises that
 * receive() and send() create while they run are counted with async_hooks
 * (a count, not a time: it holds on any machine).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { createHook } from "node:async_hooks";
import { CM, PROVIDER, eventually, withApiPair } from "../support/api.js";

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
});
