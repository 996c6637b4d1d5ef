/**
 * The seed lab (async-rdma lab manual §4.6) as two processes, exactly as the
 * README's demo command runs it, and the async-rdma README example.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { PROVIDER } from "../support/api.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");

describe(`seed lab and README example [${PROVIDER}]`, () => {
  it("the lab's server and client run in two processes and agree on every step", () => {
    const r = spawnSync(process.execPath, [join(root, "dist", "examples", "lab", "run.js")], {
      encoding: "utf8",
      timeout: 120_000,
      env: { ...process.env, ASYNC_RDMA_PROVIDER: PROVIDER },
    });
    assert.equal(r.status, 0, `lab failed:\n${r.stdout}\n${r.stderr}`);
    for (const line of ["[server] server done", "[client] client done", "demo: lab finished on both ends", `(provider ${PROVIDER})`]) {
      assert.ok(r.stdout.includes(line), `missing "${line}" in:\n${r.stdout}`);
    }
    // the data each step of the manual asserts
    assert.equal((r.stdout.match(/\[server\] \[0, 0, 0, 0, 1, 1, 1, 1\]/g) ?? []).length, 2);
    assert.ok(r.stdout.includes("[server] [1, 1, 1, 1, 2, 2, 2, 2]"));
  });
});
