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
import { CM, PROVIDER, apiPair } from "../support/api.js";

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
});
