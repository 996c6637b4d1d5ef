/**
 * The RPC outbox writes a frame into its message's registered buffer when
 * the call is made and sends the message at the next microtask checkpoint.
 * A connection that fails in between (its memory freed with it) must end
 * the calls with a typed error and leave the process running.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { RpcClient, RpcServer } from "../../src/rpc/index.js";
import type { RdmaBuilder } from "../../src/index.js";
import type { Outbox } from "../../src/rpc/outbox.js";
import { CM, PROVIDER, apiPair, pattern } from "../support/api.js";

/** 4 KiB calls made in one turn, echoed; returns the client's messages sent for them. */
async function burst(eager: number | null, calls: number, watch?: (c: RpcClient) => void): Promise<number> {
  const set = (b: RdmaBuilder): RdmaBuilder => (eager === null ? b : b.setEagerThreshold(eager));
  const p = await apiPair({ server: set, client: set });
  try {
    const served = new RpcServer({ echo: (b) => b }).serve(p.server).catch(() => {});
    const c = new RpcClient(p.client);
    assert.deepEqual(await c.call("echo", new Uint8Array([9])), new Uint8Array([9]));
    const before = p.client.stats().messagesSent;
    const payloads = Array.from({ length: calls }, (_, i) => pattern(4096, i));
    const replies = payloads.map((x) => c.call("echo", x));
    watch?.(c);
    const got = await Promise.all(replies);
    got.forEach((r, i) => assert.deepEqual(r, payloads[i], `call ${i}'s reply is its own payload`));
    const sent = p.client.stats().messagesSent - before;
    await c.close();
    await p.close();
    await served;
    return sent;
  } finally {
    await p.close().catch(() => {});
  }
}

describe(`rpc outbox [${PROVIDER}, ${CM}]`, { timeout: 120_000 * (PROVIDER === "verbs" ? 4 : 1) }, () => {
  it("issue 21 point 3: a connection that fails between a call's push and its flush ends the call with an RdmaError, no uncaught exception", async () => {
    const p = await apiPair();
    const served = new RpcServer({ echo: (b) => b }).serve(p.server).catch(() => {});
    const c = new RpcClient(p.client);
    // A full round first: the client's batch buffers and pool are in use.
    assert.deepEqual(await c.call("echo", new Uint8Array([1, 2, 3])), new Uint8Array([1, 2, 3]));
    const calls = [c.call("echo", new Uint8Array(100)), c.call("echo", new Uint8Array(200))];
    // Same turn, before the outbox's flush: the connection fails (and may free its memory at once).
    (p.client as unknown as { conn: { fail(e: RdmaError): void } }).conn.fail(new RdmaError("DEVICE", "test: failed between push and flush"));
    for (const call of calls) {
      await assert.rejects(call, (e: unknown) => e instanceof RdmaError, "the call ends with a typed error");
    }
    await p.close().catch(() => {});
    await served;
  });

  it("issue 21: a connection that fails after a batch was posted, before its send completed, ends the calls it carried with the connection's own error, not the flush's", async () => {
    const p = await apiPair();
    const served = new RpcServer({ echo: (b) => b }).serve(p.server).catch(() => {});
    const c = new RpcClient(p.client);
    assert.deepEqual(await c.call("echo", new Uint8Array([1, 2, 3])), new Uint8Array([1, 2, 3]));
    const calls = [c.call("echo", new Uint8Array(100)), c.call("echo", new Uint8Array(200)), c.call("echo", new Uint8Array(300))];
    // The outbox flushes in a microtask and the lanes post at the end of that checkpoint
    // (process.nextTick): fail right after the post, before the peer could acknowledge it.
    const conn = (p.client as unknown as { conn: { protocolError(reason: string): void } }).conn;
    queueMicrotask(() => process.nextTick(() => conn.protocolError("test: failed after the post")));
    for (const call of calls) {
      await assert.rejects(
        call,
        (e: unknown) => e instanceof RdmaError && e.code === "PROTOCOL",
        "the call ends with the connection's error (PROTOCOL), not FLUSHED",
      );
    }
    await p.close().catch(() => {});
    await served;
  });

  it("issue 21: with a 16 KiB eager threshold on both sides, 64 concurrent 4 KiB calls travel three to a message (one each at the default), every reply its own", async () => {
    // A frame is 12 + 4 (method) + 4,096 bytes: three fit in 16,360, one in the default 4,160.
    assert.equal(await burst(16360, 64), 22, "ceil(64 / 3) messages");
    assert.equal(await burst(null, 64), 64, "the default threshold: one call per message");
  });

  it("issue 21: large batch buffers pin at most 512 KiB whatever the burst; past it, frames go in small buffers and still arrive", async () => {
    let peak = -1;
    const sent = await burst(65512, 200, (c) => {
      peak = (c as unknown as { outbox: Outbox }).outbox.largeBatchBytes;
    });
    // Eight 65,512-byte buffers fit in 512 KiB, 15 frames each (120 calls); the other 80 go one per small buffer.
    assert.equal(peak, 8 * 65512, "large batch buffers hold eight buffers' bytes, within 512 KiB");
    assert.equal(sent, 8 + 80, "messages for 200 calls");
  });
});
