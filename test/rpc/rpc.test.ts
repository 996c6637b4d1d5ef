/**
 * async-rdma/rpc on the provider under test: calls, concurrency, sizes,
 * typed errors, cancellation that reaches the server, connection loss and a
 * peer that breaks the framing.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, type RdmaBuilder } from "../../src/index.js";
import { RpcClient, RpcError, RpcServer } from "../../src/rpc/index.js";
import { CM, PROVIDER, apiPair, eventually, pattern } from "../support/api.js";

const SLOW = PROVIDER === "verbs" ? 4 : 1;

function rdmaCode(c: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError ${c}, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    return true;
  };
}

describe(`rpc [${PROVIDER}, ${CM}]`, { timeout: 300_000 * SLOW }, () => {
  it("echo, many calls in flight, payloads from 0 bytes to 16 MiB", async () => {
    const p = await apiPair();
    const server = new RpcServer({
      echo: (b) => b,
      len: (b) => new Uint8Array(new Uint32Array([b.length]).buffer),
      empty: () => undefined,
    });
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    try {
      assert.deepEqual([...(await client.call("echo", new Uint8Array([1, 2, 3])))], [1, 2, 3]);
      assert.equal((await client.call("empty")).length, 0);
      // 500 calls at once, each answered with its own bytes
      const N = PROVIDER === "verbs" ? 200 : 500;
      const replies = await Promise.all(Array.from({ length: N }, (_, i) => client.call("echo", pattern(16 + (i % 64), i))));
      replies.forEach((r, i) => assert.deepEqual(r, pattern(16 + (i % 64), i)));
      for (const n of [0, 4000, 4096, 70_000, 1 << 20, 16 << 20]) {
        const big = pattern(n, n);
        const back = await client.call("echo", big);
        assert.equal(back.length, n);
        assert.ok(Buffer.from(back).equals(Buffer.from(big)), `${n} bytes round-trip`);
      }
      assert.equal(client.inFlight, 0);
    } finally {
      await p.close();
    }
    await served;
  });

  // At the default eager threshold, and at one that lets the RPC layer batch up to 64 KiB (large batch buffers, their budget, one-frame buffers).
  for (const eager of [0, 65512]) it(`10,000 calls in flight at once, sizes 0 B–1 MiB: handled in call order, every byte intact (eager threshold ${eager === 0 ? "default" : eager})`, async () => {
    // Fewer in the Soft-RoCE guest (software emulation, one slow CPU): the same mix, 1,000 calls.
    const N = PROVIDER === "verbs" ? 1000 : 10_000;
    let seed = 0x9e3779b9;
    const rnd = (): number => {
      seed ^= seed << 13;
      seed ^= seed >>> 17;
      seed ^= seed << 5;
      return (seed >>> 0) / 2 ** 32;
    };
    // 90% small (0–4 KiB, eager), 10% log-uniform 4 KiB–1 MiB (rendezvous), both ends included.
    const sizes = Array.from({ length: N }, (_, i) => (i === 0 ? 0 : i === 1 ? 1 << 20 : rnd() < 0.9 ? Math.floor(rnd() * 4097) : Math.min(1 << 20, Math.floor(4096 * 2 ** (rnd() * 8.0001)))));
    const set = (b: RdmaBuilder): RdmaBuilder => (eager === 0 ? b : b.setEagerThreshold(eager));
    const p = await apiPair({ server: set, client: set });
    let next = 0;
    const server = new RpcServer({
      check: (b) => {
        // The server sees the calls in the order they were made, each with its own bytes.
        const k = next++;
        if (b.length !== sizes[k] || !Buffer.from(b).equals(Buffer.from(pattern(sizes[k]!, k)))) throw Object.assign(new Error(`call ${k} arrived out of order or damaged (${b.length} bytes)`), { code: "EORDER" });
        return b;
      },
    });
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    try {
      let bad = 0;
      await Promise.all(
        sizes.map((n, i) =>
          client.call("check", pattern(n, i)).then((r) => {
            if (r.length !== n || !Buffer.from(r).equals(Buffer.from(pattern(n, i)))) bad++;
          }),
        ),
      );
      assert.equal(bad, 0, "replies that did not match their call");
      assert.equal(next, N);
      assert.equal(client.inFlight, 0);
    } finally {
      await p.close();
    }
    await served;
  });

  it("a handler's error comes back typed; an unknown method is NOT_FOUND; the connection lives on", async () => {
    const p = await apiPair();
    const server = new RpcServer({
      fail: () => {
        throw Object.assign(new Error("no such account"), { code: "ENOACCOUNT" });
      },
      reject: async () => Promise.reject(new Error("plain")),
      rdma: () => {
        throw new RdmaError("QUOTA_EXCEEDED", "full");
      },
      ok: () => new Uint8Array([7]),
    });
    void server.serve(p.server);
    const client = new RpcClient(p.client);
    try {
      await assert.rejects(client.call("fail"), (e: unknown) => e instanceof RpcError && e.code === "ENOACCOUNT" && /no such account/.test(e.message) && e.method === "fail");
      await assert.rejects(client.call("reject"), (e: unknown) => e instanceof RpcError && e.code === "HANDLER_ERROR");
      await assert.rejects(client.call("rdma"), (e: unknown) => e instanceof RpcError && e.code === "QUOTA_EXCEEDED");
      await assert.rejects(client.call("nope"), (e: unknown) => e instanceof RpcError && e.code === "NOT_FOUND");
      assert.deepEqual([...(await client.call("ok"))], [7]);
      await assert.rejects(client.call(""), rdmaCode("INVALID_ARGUMENT"));
      await assert.rejects(client.call("ok", "x" as never), rdmaCode("INVALID_ARGUMENT"));
    } finally {
      await p.close();
    }
  });

  it("abort and timeout reach the server: the handler's signal aborts and no reply is delivered", async () => {
    const p = await apiPair();
    const seen: string[] = [];
    let started = 0;
    const server = new RpcServer({
      wait: (_b, ctx) =>
        new Promise<Uint8Array>((resolve, reject) => {
          started++;
          ctx.signal.addEventListener("abort", () => {
            seen.push("aborted");
            reject(ctx.signal.reason);
          });
        }),
      ok: () => new Uint8Array([1]),
    });
    void server.serve(p.server);
    const client = new RpcClient(p.client);
    try {
      const ac = new AbortController();
      const call = client.call("wait", new Uint8Array(0), { signal: ac.signal });
      await eventually(() => started === 1, 30_000 * SLOW, "the handler to start");
      ac.abort();
      await assert.rejects(call, rdmaCode("ABORTED"));
      await eventually(() => seen.length === 1, 30_000 * SLOW, "the server to see the cancellation");
      await assert.rejects(client.call("wait", new Uint8Array(0), { timeoutMs: 100 }), rdmaCode("TIMEOUT"));
      await eventually(() => seen.length === 2, 30_000 * SLOW, "the server to see the timeout's cancellation");
      assert.deepEqual([...(await client.call("ok"))], [1]);
      const pre = new AbortController();
      pre.abort();
      await assert.rejects(client.call("ok", new Uint8Array(0), { signal: pre.signal }), rdmaCode("ABORTED"));
    } finally {
      await p.close();
    }
  });

  it("calls in flight reject when the connection ends; the server's handlers see their signals abort", async () => {
    const p = await apiPair();
    let aborted = 0;
    const server = new RpcServer({
      hang: (_b, ctx) =>
        new Promise<void>((resolve) => {
          ctx.signal.addEventListener("abort", () => {
            aborted++;
            resolve();
          });
        }),
    });
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    const calls = Array.from({ length: 5 }, () => client.call("hang"));
    const settled = Promise.allSettled(calls);
    await eventually(() => client.inFlight === 5, 30_000 * SLOW, "the calls to be sent");
    // let them reach the server before the client goes away
    await client.call("hang", new Uint8Array(0), { timeoutMs: 200 }).catch(() => {});
    await client.close();
    for (const r of await settled) {
      assert.equal(r.status, "rejected");
      assert.ok(r.status === "rejected" && r.reason instanceof RdmaError && r.reason.code === "CONNECTION_CLOSED", String((r as PromiseRejectedResult).reason));
    }
    await served;
    await eventually(() => aborted >= 5, 30_000 * SLOW, "the handlers to see the connection end");
    await p.close();
  });

  it("a peer that breaks the framing gets its connection closed (PROTOCOL), not a crash", async () => {
    const p = await apiPair();
    const server = new RpcServer({ ok: () => new Uint8Array([1]) });
    // The rejection is watched before anything is sent: the server may end serve() before the
    // client's send completes (a slow completion in the guest), and an unwatched rejection fails the test.
    const served = assert.rejects(server.serve(p.server), rdmaCode("PROTOCOL"));
    using junk = p.client.allocLocalMr(20);
    junk.bytes.set([0x52, 9, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]);
    await p.client.send(junk).catch(() => {});
    await served;
    await eventually(() => p.server.isClosed, 30_000 * SLOW, "the server to close the connection");
    await p.close();
  });
});

describe(`examples/rpc [${PROVIDER}]`, { skip: CM !== "tcp" && "the example uses the side channel" }, () => {
  it("runs to the end and shows every step", async () => {
    const { spawnSync } = await import("node:child_process");
    const { fileURLToPath } = await import("node:url");
    const { dirname, join } = await import("node:path");
    const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
    const r = spawnSync(process.execPath, [join(root, "dist", "examples", "rpc", "run.js")], { encoding: "utf8", timeout: 120_000 * SLOW, env: { ...process.env, ASYNC_RDMA_PROVIDER: PROVIDER } });
    assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`);
    for (const line of ["HELLO, RDMA", "100 concurrent calls: WORD99", "typed error: EDOM", "server: slow call cancelled by the client", "timed out after 200 ms", "rpc example done"]) {
      assert.ok(r.stdout.includes(line), `missing "${line}" in:\n${r.stdout}`);
    }
  });
});
