/**
 * agent/queue.ts's one abortable wait: it ends exactly once, by the event, an
 * abort or the timeout, and its listener, timer and cleanup go with it.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { getEventListeners } from "node:events";
import { RdmaError } from "../../src/index.js";
import { abortableWait, type Settle } from "../../src/agent/queue.js";
import * as lowest from "../../src/transport/wait.js";

describe("abortableWait (agent/queue.ts)", () => {
  it("the event settles it once; cleanup runs once and the abort listener is removed", async () => {
    const ac = new AbortController();
    let cleanups = 0;
    let end!: Settle<number>;
    const p = abortableWait<number>((s) => (end = s), { signal: ac.signal, cleanup: () => cleanups++ });
    assert.equal(getEventListeners(ac.signal, "abort").length, 1);
    end.resolve(1);
    end.resolve(2);
    end.reject(new Error("late"));
    ac.abort();
    assert.equal(await p, 1);
    assert.equal(cleanups, 1);
    assert.equal(getEventListeners(ac.signal, "abort").length, 0);
  });

  it("a start that throws rejects with its error, and the timer, listener and cleanup go with it", async () => {
    const ac = new AbortController();
    let cleanups = 0;
    const boom = new Error("boom");
    const p = abortableWait<number>(
      () => {
        throw boom;
      },
      { signal: ac.signal, timeoutMs: 2 ** 31 - 1, cleanup: () => cleanups++ },
    );
    await assert.rejects(p, (e) => e === boom);
    assert.equal(cleanups, 1);
    assert.equal(getEventListeners(ac.signal, "abort").length, 0, "the abort listener is removed");
    // the timer is gone too: with it, this test's process would be kept alive (checked by the count of active timers)
    assert.equal(process.getActiveResourcesInfo().filter((r) => r === "Timeout").length, 0);
  });

  it("an abort rejects with ABORTED and runs cleanup; an already aborted signal never starts the wait", async () => {
    const ac = new AbortController();
    let cleanups = 0;
    const p = abortableWait<number>(() => {}, { signal: ac.signal, cleanup: () => cleanups++ });
    ac.abort(new Error("stop"));
    await assert.rejects(p, (e: RdmaError) => e.code === "ABORTED" && /stop/.test(e.message));
    assert.equal(cleanups, 1);
    let started = false;
    await assert.rejects(
      abortableWait(() => (started = true), { signal: AbortSignal.abort() }),
      (e: RdmaError) => e.code === "ABORTED",
    );
    assert.equal(started, false);
  });

  it("the timeout rejects with TIMEOUT naming the wait (or runs onTimeout), and is cleared when the event comes first", async () => {
    let cleanups = 0;
    await assert.rejects(
      abortableWait<void>(() => {}, { timeoutMs: 1, what: "the thing", cleanup: () => cleanups++ }),
      (e: RdmaError) => e.code === "TIMEOUT" && /the thing/.test(e.message),
    );
    assert.equal(cleanups, 1);
    assert.equal(await abortableWait<string>(() => {}, { timeoutMs: 1, onTimeout: (s) => s.resolve("woken") }), "woken");
    // Settled by the event: the timer must not keep the process alive or fire later.
    const before = process.getActiveResourcesInfo().filter((r) => r === "Timeout").length;
    let end!: Settle<void>;
    const p = abortableWait<void>((s) => (end = s), { timeoutMs: 3_600_000 });
    assert.equal(process.getActiveResourcesInfo().filter((r) => r === "Timeout").length, before + 1);
    end.resolve();
    await p;
    assert.equal(process.getActiveResourcesInfo().filter((r) => r === "Timeout").length, before);
  });
});

describe("one abortable wait for every site (issue 20 point 3: transport/wait.ts)", () => {
  it("agent/queue.ts re-exports the one helper from transport/wait.ts (the lowest layer that waits: the verbs provider's RDMA CM)", () => {
    assert.equal(abortableWait, lowest.abortableWait);
  });

  it("onAbort replaces the default ABORTED error (the RDMA CM's and the RPC client's own messages), also for a signal already aborted; the wait still ends once", async () => {
    const ac = new AbortController();
    let cleanups = 0;
    let told = 0;
    const p = lowest.abortableWait<number>(() => {}, {
      signal: ac.signal,
      timeoutMs: 3_600_000,
      onAbort: (s) => {
        told++;
        s.reject(new RdmaError("ABORTED", "the step aborted"));
      },
      cleanup: () => cleanups++,
    });
    ac.abort();
    await assert.rejects(p, (e: RdmaError) => e.code === "ABORTED" && e.message === "the step aborted");
    assert.equal(told, 1);
    assert.equal(cleanups, 1);
    assert.equal(getEventListeners(ac.signal, "abort").length, 0);
    let started = false;
    await assert.rejects(
      lowest.abortableWait(() => (started = true), { signal: AbortSignal.abort(), onAbort: (s) => s.reject(new RdmaError("ABORTED", "early")) }),
      (e: RdmaError) => e.code === "ABORTED" && e.message === "early",
    );
    assert.equal(started, false, "a signal already aborted ends the wait before it starts");
  });

  it("an onAbort that does not settle leaves the wait to its event (an RPC call whose answer already came)", async () => {
    const ac = new AbortController();
    let end!: Settle<string>;
    const p = lowest.abortableWait<string>((s) => (end = s), { signal: ac.signal, onAbort: () => {} });
    ac.abort();
    end.resolve("answered");
    assert.equal(await p, "answered");
  });
});
