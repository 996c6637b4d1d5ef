#!/usr/bin/env node
// Makes the prebuilt addons shipped in the package: compiles native/ with
// node-gyp (scripts/build-native.mjs) and copies build/Release/*.node to
// prebuilds/<platform>-<arch>/<name>.glibc.node, where the loader
// (src/transport/verbs/native.ts) and the install script (scripts/install.mjs)
// look. Runs at `npm pack`/`npm publish` (prepack), so binaries are never
// committed. Node-API 8: one build serves every Node version >= 20.19.
// Usage: node scripts/prebuild.mjs [--from-build]   (--from-build: copy the
// existing build/Release without compiling)
import { copyFileSync, existsSync, mkdirSync, renameSync, rmSync } from "node:fs";
import { join } from "node:path";
import { spawnSync } from "node:child_process";

const root = new URL("..", import.meta.url).pathname;
const fail = (msg) => {
  console.error(`prebuild: ${msg}`);
  process.exit(1);
};
if (process.platform !== "linux" || !process.report.getReport().header.glibcVersionRuntime) fail("prebuilds are made on linux with glibc");
if (!process.argv.includes("--from-build")) {
  // everything on stderr: `npm pack --json` prints its JSON on the stdout prepack shares
  const r = spawnSync(process.execPath, [join(root, "scripts/build-native.mjs"), "--require"], { cwd: root, stdio: ["ignore", 2, 2] });
  if (r.status !== 0) fail("the native build failed: a package without its prebuilds is not shipped");
}
const dir = join(root, "prebuilds", `${process.platform}-${process.arch}`);
mkdirSync(dir, { recursive: true });
for (const name of ["async_rdma_verbs", "async_rdma_cm"]) {
  const from = join(root, "build/Release", `${name}.node`);
  if (!existsSync(from)) fail(`${from} is missing (rdma-core headers: apt-get install -y libibverbs-dev librdmacm-dev)`);
  // copy then rename: a concurrent reader never sees half a file
  const to = join(dir, `${name}.glibc.node`);
  const tmp = `${to}.${process.pid}.tmp`;
  copyFileSync(from, tmp);
  renameSync(tmp, to);
  console.error(`prebuild: ${to.slice(root.length)}`);
}
rmSync(join(root, "prebuilds", ".keep"), { force: true });
