#!/usr/bin/env node
// Builds the native verbs addon (native/verbs.c -> build/Release/async_rdma_verbs.node)
// and, when the librdmacm headers exist, the RDMA CM addon (native/cm.c ->
// build/Release/async_rdma_cm.node; binding.gyp skips it otherwise) with
// node-gyp. Used as the package's "install" script: when the rdma-core
// headers (libibverbs-dev) or a toolchain are missing, it prints one line and
// exits 0, so installing still succeeds and the tcp provider works; the verbs
// provider then reports PROVIDER_UNAVAILABLE with the reason.
// --require (scripts/prebuild.mjs): exit 1 instead of 0 when nothing was built.
// Usage: node scripts/build-native.mjs [--verbose] [--require]   (npm run build:native)
import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { spawnSync } from "node:child_process";

const root = new URL("..", import.meta.url).pathname;
const verbose = process.argv.includes("--verbose");
const required = process.argv.includes("--require");
// In a consumer's node_modules the fix is `npm rebuild async-rdma`; in a checkout, `npm run build:native`.
const rebuild = root.replace(/\/$/, "").split("/").includes("node_modules") ? "npm rebuild async-rdma" : "npm run build:native";
const note = (msg) => {
  console.log(`async-rdma: native verbs addon not built (${msg}); the tcp provider works. Fix: apt-get install -y libibverbs-dev librdmacm-dev ibverbs-providers rdma-core build-essential python3, then ${rebuild}`);
  process.exit(required ? 1 : 0);
};

if (process.env.ASYNC_RDMA_SKIP_NATIVE) note("ASYNC_RDMA_SKIP_NATIVE is set");
const header = ["/usr/include/infiniband/verbs.h", "/usr/local/include/infiniband/verbs.h"].find((p) => existsSync(p));
if (!header) note("rdma-core headers missing: no infiniband/verbs.h");

// node-gyp: npm bundles one (npm_config_node_gyp points at it during npm scripts).
function findGyp() {
  const cands = [process.env.npm_config_node_gyp];
  try {
    cands.push(createRequire(import.meta.url).resolve("node-gyp/bin/node-gyp.js"));
  } catch {}
  const prefix = dirname(dirname(process.execPath));
  cands.push(join(prefix, "lib/node_modules/npm/node_modules/node-gyp/bin/node-gyp.js"));
  cands.push(join(prefix, "lib/node_modules/npm/node_modules/node-gyp/bin/node-gyp.js".replace("lib/", "")));
  return cands.find((p) => p && existsSync(p));
}
const gyp = findGyp();
if (!gyp) note("node-gyp not found");

// Headers of the running node: $npm_config_nodedir, else the install prefix when it
// ships them (Debian/NodeSource: /usr/include/node), else node-gyp downloads them.
const args = [gyp, "rebuild"];
const prefix = dirname(dirname(process.execPath));
const nodedir = process.env.npm_config_nodedir || (existsSync(join(prefix, "include/node/node_api.h")) ? prefix : "");
if (nodedir) args.push(`--nodedir=${nodedir}`);
const r = spawnSync(process.execPath, args, { cwd: root, stdio: verbose ? "inherit" : "pipe", encoding: "utf8" });
if (r.status !== 0) {
  const out = `${r.stdout ?? ""}\n${r.stderr ?? ""}`;
  const line = out.split("\n").find((l) => /error|not found|No such file/i.test(l) && !/^gyp info/.test(l)) ?? `node-gyp exited with ${r.status}`;
  note(`build failed: ${line.trim().slice(0, 200)}`);
}
const cm = existsSync(join(root, "build/Release/async_rdma_cm.node"));
console.log(
  "async-rdma: native verbs addon built (build/Release/async_rdma_verbs.node)" +
    (cm ? "; RDMA CM addon built (build/Release/async_rdma_cm.node)" : `; RDMA CM addon not built (no rdma/rdma_cma.h: apt-get install -y librdmacm-dev, then ${rebuild})`),
);
