/**
 * Two hosts: scripts/netns/two-hosts.sh builds two network namespaces joined
 * by a veth pair and moves 8 MiB each way with SEND, RDMA WRITE and RDMA READ
 * over the tcp provider between a seam-peer server and client, checking
 * sha256 on both sides and the veth's rx_bytes counters.
 *
 * Needs root and `ip netns`; otherwise the test is skipped, loudly, with the reason.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { fileURLToPath } from "node:url";

const ROOT = fileURLToPath(new URL("../../../", import.meta.url));
const SCRIPT = `${ROOT}scripts/netns/two-hosts.sh`;
const BYTES = 8 * 1024 * 1024;
/** Above the script's own bounds (60 s per process), so a failure inside it is reported with its diagnostics. */
const DEADLINE_MS = 150_000;

/** Why this machine cannot run the test, or null. */
function unavailable(): string | null {
  if (typeof process.getuid === "function" && process.getuid() !== 0) return `needs root to create network namespaces (running as uid ${process.getuid()})`;
  const ip = spawnSync("ip", ["netns", "list"], { encoding: "utf8" });
  if (ip.error) return `iproute2 'ip' is not available (${ip.error.message}); install it with: apt-get install -y iproute2`;
  if (ip.status !== 0) return `'ip netns' is not usable here: ${ip.stderr.trim()}`;
  if (!existsSync(SCRIPT)) return `${SCRIPT} is missing`;
  return null;
}

function run(): Promise<{ code: number | null; out: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn("bash", [SCRIPT, String(BYTES)], { stdio: ["ignore", "pipe", "pipe"], env: { ...process.env, NODE: process.execPath } });
    let out = "";
    child.stdout.on("data", (c: Buffer) => (out += c.toString()));
    child.stderr.on("data", (c: Buffer) => (out += c.toString()));
    const t = setTimeout(() => {
      // TERM lets the script's trap remove the namespaces.
      child.kill("SIGTERM");
      reject(new Error(`two-hosts.sh did not finish within ${DEADLINE_MS} ms:\n${out}`));
    }, DEADLINE_MS);
    child.on("exit", (code) => {
      clearTimeout(t);
      resolve({ code, out });
    });
  });
}

describe("two hosts (network namespaces + veth) [tcp]", () => {
  it("8 MiB each way with SEND, RDMA WRITE and RDMA READ, checksummed, across a veth pair", async (t) => {
    const why = unavailable();
    if (why !== null) {
      const msg = `SKIPPED two-hosts: ${why}`;
      console.error(`\n*** ${msg} ***\n`);
      t.diagnostic(msg);
      t.skip(msg);
      return;
    }
    const { code, out } = await run();
    if (code === 77) {
      const msg = `SKIPPED two-hosts: ${out.trim().split("\n").pop()}`;
      console.error(`\n*** ${msg} ***\n`);
      t.skip(msg);
      return;
    }
    assert.equal(code, 0, `two-hosts.sh failed:\n${out}`);
    const ok = out.split("\n").find((l) => l.startsWith("two-hosts: OK"));
    assert.ok(ok, `no summary line:\n${out}`);
    t.diagnostic(ok);
    const m = /veth rx_bytes server \+(\d+) client \+(\d+)/.exec(ok);
    assert.ok(m, ok);
    assert.ok(Number(m[1]) >= 3 * BYTES, `server-side veth received ${m[1]} bytes`);
    assert.ok(Number(m[2]) >= 3 * BYTES, `client-side veth received ${m[2]} bytes`);
    const summary = JSON.parse(out.split("\n").find((l) => l.startsWith("client summary: "))!.slice("client summary: ".length)) as {
      ok: boolean;
      bytes: number;
      client: { verify: Record<string, boolean>; traffic: { statuses: Record<string, number> } };
      server: { verify: Record<string, boolean>; traffic: { statuses: Record<string, number> } };
    };
    assert.equal(summary.ok, true);
    assert.equal(summary.bytes, BYTES);
    for (const side of [summary.client, summary.server]) {
      assert.deepEqual(side.verify, { recv: true, write: true, read: true });
      assert.deepEqual(Object.keys(side.traffic.statuses), ["SUCCESS"]);
    }
  });
});
