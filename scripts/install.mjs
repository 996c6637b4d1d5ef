#!/usr/bin/env node
// The package's install script. Uses the prebuilt addon shipped in
// prebuilds/<platform>-<arch>/ when one fits this machine and loads, so
// installing needs no compiler; otherwise compiles from source
// (scripts/build-native.mjs), which exits 0 whatever happens: without
// rdma-core the tcp provider still works and the verbs provider reports
// PROVIDER_UNAVAILABLE with the fix.
//   npm rebuild async-rdma                       runs this again
//   npm rebuild async-rdma --build-from-source   always compiles
//   ASYNC_RDMA_SKIP_NATIVE=1                      neither
import { existsSync } from "node:fs";
import { join } from "node:path";
import { spawnSync } from "node:child_process";

const root = new URL("..", import.meta.url).pathname;
const buildFromSource = () => {
  const r = spawnSync(process.execPath, [join(root, "scripts/build-native.mjs")], { cwd: root, stdio: "inherit" });
  process.exit(r.status ?? 1);
};
const fromSource = process.env.npm_config_build_from_source;
// A checkout of the project (not in node_modules) always compiles: its sources may be newer than any prebuild.
const inCheckout = !root.replace(/\/$/, "").split("/").includes("node_modules");
if (process.env.ASYNC_RDMA_SKIP_NATIVE || inCheckout || (fromSource && fromSource !== "false")) buildFromSource();

const glibc = process.platform === "linux" && process.report.getReport().header.glibcVersionRuntime;
const prebuild = glibc ? join(root, "prebuilds", `${process.platform}-${process.arch}`, "async_rdma_verbs.glibc.node") : null;
if (!prebuild || !existsSync(prebuild)) buildFromSource();

// Load it in a child process: a failure (missing library, too old a glibc) must not be this process's.
const r = spawnSync(process.execPath, ["-e", "require(process.argv[1])", prebuild], { encoding: "utf8" });
if (r.status === 0) {
  console.log(`async-rdma: using the prebuilt native addon (${prebuild.slice(root.length)})`);
  process.exit(0);
}
const first = (r.stderr.split("\n").find((l) => /Error/.test(l)) ?? r.stderr.trim().split("\n")[0] ?? "").trim();
if (/lib(ibverbs|rdmacm|nl-)[^:\s]*: cannot open shared object/.test(first)) {
  // rdma-core itself is missing: compiling cannot help (its headers are missing too)
  console.log(`async-rdma: prebuilt native addon present, but rdma-core is not installed (${first}); the tcp provider works. For verbs: apt-get install -y libibverbs1 librdmacm1 ibverbs-providers rdma-core`);
  process.exit(0);
}
console.log(`async-rdma: the prebuilt native addon does not load here (${first}); compiling from source`);
buildFromSource();
