/**
 * A peer process that dies (kill -9) fails the connection: the survivor's
 * pending waits reject with a typed error within a bounded time, even when it
 * was only receiving (keepalive probes find out).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { RdmaError } from "../../src/index.js";
import { CM, PROVIDER, at, builder } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const peer = join(dirname(fileURLToPath(import.meta.url)), "..", "support", "api-peer.js");

describe(`API peer death [${PROVIDER}, ${CM}]`, () => {
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
});
