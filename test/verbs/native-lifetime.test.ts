/**
 * Lifetimes inside the native addons (verbs provider only): references
 * dropped in the bad order and collected by forced GC, environment teardown
 * (worker and process exit) over a context whose handle was collected while
 * its children live, a CQ armed when its device closes, a grant registered
 * over a slab that outlives the slab, a device closed from its own CQ's
 * callback, and RDMA CM ids destroyed or left to teardown with events
 * pending. Each scenario runs in its own child process (node --expose-gc
 * native-lifetime-child.js <scenario>), so a crash or a sanitizer report
 * (scripts/softroce/memcheck.sh runs these under ASan) fails exactly that
 * scenario; the child must also exit by itself, promptly, with status 0.
 *
 * On the tcp provider there is no native addon to test: skipped, loudly.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { PROVIDER, SLOW } from "../support/seam.js";

const SKIP = PROVIDER === "verbs" ? false : `native addon lifetimes need ASYNC_RDMA_PROVIDER=verbs (have ${PROVIDER}): run by npm run test:verbs and scripts/softroce/memcheck.sh`;

function runScenario(name: string): Promise<{ code: number | string; out: string; err: string }> {
  const script = fileURLToPath(new URL("./native-lifetime-child.js", import.meta.url));
  const child = spawn(process.execPath, ["--expose-gc", script, name], { stdio: ["ignore", "pipe", "pipe"], env: process.env });
  let out = "";
  let err = "";
  child.stdout.on("data", (d: Buffer) => (out += d.toString()));
  child.stderr.on("data", (d: Buffer) => (err += d.toString()));
  // A hang (a blocking native call, a teardown that never ends) is a failure too.
  const limit = 120_000 * SLOW;
  const t = setTimeout(() => child.kill("SIGKILL"), limit);
  return new Promise((resolve) =>
    child.on("exit", (c, sig) => {
      clearTimeout(t);
      resolve({ code: c ?? String(sig), out, err });
    }),
  );
}

async function scenario(name: string): Promise<void> {
  const r = await runScenario(name);
  const line = r.out.split("\n").find((l) => l.startsWith("{"));
  // stderr carries any AddressSanitizer report: keep it in the failure message (memcheck.sh greps the log).
  assert.ok(line, `scenario ${name} printed no result (exit ${String(r.code)}):\n${r.out}\n${r.err}`);
  assert.equal((JSON.parse(line) as { ok: boolean }).ok, true);
  assert.equal(r.code, 0, `scenario ${name}: the child did not exit cleanly (${String(r.code)}) after its checks passed, i.e. in the environment's teardown:\n${r.err}`);
}

describe(`native lifetimes [${PROVIDER}]`, { skip: SKIP }, () => {
  it("references dropped in every order (the context's handle first) are collected: children keep their parents usable, then everything is freed", () => scenario("gc-order"));
  it("teardown (worker end, process exit) walks a context whose handle was collected while its PD, CQ, QP and MRs live", () => scenario("teardown-walk"));
  it("a CQ armed when its device closes is collected (the handler's strong reference goes with the channel)", () => scenario("armed-at-close"));
  it("a grant over a slab keeps the slab's memory (slab deregistered, or its handle collected) until the grant is deregistered; the peer reads and writes it meanwhile", () =>
    scenario("grant-over-slab"));
  it("a device closed from its own CQ's notify handler: no use after free, everything freed", () => scenario("close-from-callback"));
  it("RDMA CM ids destroyed, collected, or left to teardown (process and worker) with events pending; the channel keeps working", () => scenario("cm-pending"));
});
