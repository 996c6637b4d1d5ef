/**
 * A peer process that dies (kill -9) fails the connection: the survivor's
 * pending waits reject with a typed error within a bounded time, even when it
 * was only receiving (keepalive probes find out).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { RdmaError } from "../../src/index.js";
import { CM, PROVIDER, at, builder } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const peer = join(dirname(fileURLToPath(import.meta.url)), "..", "support", "api-peer.js");

function startPeer(port: number, mode = "wait"): Promise<ChildProcess> {
  const child = spawn(process.execPath, [peer, at(port), mode], { stdio: ["ignore", "pipe", "inherit"] });
  return new Promise<ChildProcess>((resolve, reject) => {
    child.stdout!.on("data", (d: Buffer) => d.toString().includes("connected") && resolve(child));
    child.once("exit", (c) => reject(new Error(`peer exited early (${c})`)));
  });
}

describe(`API peer death [${PROVIDER}, ${CM}]`, () => {
  it("a stopped peer (SIGSTOP) settles every pending operation within keepalive + peer timeout, and the survivor keeps serving", async () => {
    const listener = await builder("server").setKeepalive(100).setPeerTimeout(1_000 * SLOW).bind(at(0));
    const children: ChildProcess[] = [];
    try {
      const child = await startPeer(listener.port);
      children.push(child);
      const rdma = await listener.accept({ timeoutMs: 10_000 * SLOW });
      child.kill("SIGSTOP");
      const t0 = performance.now();
      using big = rdma.allocLocalMr(8 << 20);
      const ops = [rdma.receive(), rdma.send(big), rdma.requestRemoteMr(8)];
      for (const p of ops) {
        await assert.rejects(p, (e: unknown) => {
          assert.ok(e instanceof RdmaError);
          assert.ok(["CONNECTION_CLOSED", "RETRY_EXCEEDED", "FLUSHED"].includes(e.code), `${e.code}: ${e.message}`);
          return true;
        });
      }
      const ms = performance.now() - t0;
      assert.ok(ms < 10_000 * SLOW, `took ${ms.toFixed(0)} ms`);
      await rdma.close();
      assert.equal(rdma.stats().rendezvousOut, 0);
      // the survivor keeps serving: a new peer connects and gets its echo
      const next = await startPeer(listener.port, "echo");
      children.push(next);
      const r2 = await listener.accept({ timeoutMs: 10_000 * SLOW });
      using m = r2.allocLocalMr(64 * 1024);
      m.bytes.fill(5);
      await r2.send(m);
      using back = await r2.receive();
      assert.equal(back.length, 64 * 1024);
      assert.equal(back.bytes[100], 5);
      await r2.close();
    } finally {
      for (const c of children) {
        c.kill("SIGCONT");
        c.kill("SIGKILL");
      }
      await listener.close();
    }
  });

  it("kill -9 of the peer rejects pending receives with a typed error, in bounded time", async () => {
    const listener = await builder("server").setKeepalive(100).setAckTimeout(12).setRetryCount(3).bind(at(0));
    const child = spawn(process.execPath, [peer, at(listener.port)], { stdio: ["ignore", "pipe", "inherit"] });
    try {
      await new Promise<void>((resolve, reject) => {
        child.stdout.on("data", (d: Buffer) => d.toString().includes("connected") && resolve());
        child.once("exit", (c) => reject(new Error(`peer exited early (${c})`)));
      });
      const rdma = await listener.accept({ timeoutMs: 10_000 * SLOW });
      const pending = rdma.receive();
      const t0 = performance.now();
      child.kill("SIGKILL");
      await assert.rejects(pending, (e: unknown) => {
        assert.ok(e instanceof RdmaError);
        assert.ok(["CONNECTION_CLOSED", "RETRY_EXCEEDED", "FLUSHED"].includes(e.code), `${e.code}: ${e.message}`);
        return true;
      });
      const ms = performance.now() - t0;
      assert.ok(ms < 5_000 * SLOW, `took ${ms.toFixed(0)} ms`);
      await rdma.close();
    } finally {
      child.kill("SIGKILL");
      await listener.close();
    }
  });
  it("this process's own blocked event loop (longer than the peer timeout) does not fail a healthy connection", async () => {
    // Found by the 10,000-call RPC test with the suite running twice at once: handlers ran for
    // seconds in one turn, and the liveness timer (timers run before I/O) blamed the peer.
    const T = 400 * SLOW;
    const listener = await builder("server").setPeerTimeout(T).bind(at(0));
    try {
      const accepted = listener.accept();
      const client = await builder().setPeerTimeout(T).connect(at(listener.port));
      const server = await accepted;
      const m = client.allocLocalMr(16);
      const sent = client.send(m);
      // Block this process (the peer's too: both ends live here) for three peer timeouts.
      const until = performance.now() + 3 * T;
      while (performance.now() < until) {
        /* a long synchronous task */
      }
      await sent;
      (await server.receive()).dispose();
      // Still healthy both ways.
      const back = server.allocLocalMr(8);
      await server.send(back);
      assert.equal((await client.receive()).length, 8);
      await client.close();
      await server.close();
    } finally {
      await listener.close();
    }
  });
});
