#!/usr/bin/env node
// Runs the compiled test files (dist/test/**/*.test.js) with node:test.
// Usage: node scripts/run-tests.mjs [substring filters...]
// A filter matches the file's path relative to dist/test (e.g. "tcp/", "api/data"),
// never the checkout's own path.
// ASYNC_RDMA_PROVIDER=verbs runs the same files on the native provider.
import { readdirSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import { spawnSync } from "node:child_process";

const root = new URL("..", import.meta.url).pathname;
const dir = join(root, "dist", "test");
const files = [];
(function walk(d) {
  for (const n of readdirSync(d).sort()) {
    const p = join(d, n);
    if (statSync(p).isDirectory()) walk(p);
    else if (n.endsWith(".test.js")) files.push(p);
  }
})(dir);
const filters = process.argv.slice(2);
const chosen = filters.length ? files.filter((f) => filters.some((s) => relative(dir, f).includes(s))) : files;
if (chosen.length === 0) {
  console.error("run-tests: no test files matched");
  process.exit(1);
}
const concurrency = process.env.TEST_CONCURRENCY ?? "2";
// --test-force-exit: a test that times out leaves its connections open (they keep the process
// alive by design); the run must still end and report it.
const r = spawnSync(process.execPath, ["--test", "--test-force-exit", `--test-concurrency=${concurrency}`, "--test-reporter=spec", ...chosen], { stdio: "inherit" });
process.exit(r.status ?? 1);
