/**
 * The native loader's explanations: a missing rdma-core library is fixed by
 * installing it (not by rebuilding), anything else by rebuilding from source,
 * with the command that fits where the package is (a checkout here); the
 * install script does not compile when rdma-core itself is missing.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { copyFileSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { explainLoadFailure, rebuildCommand } from "../../src/transport/verbs/native.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");

describe("native addon load failures", () => {
  it("in a checkout the rebuild command is npm run build:native", () => {
    assert.equal(rebuildCommand(), "npm run build:native");
  });

  it("a broken addon: rebuild from source", () => {
    const m = explainLoadFailure("the native addon", "/x/a.node", "/x/a.node: invalid ELF header");
    assert.match(m, /failed to load: \/x\/a\.node: invalid ELF header/);
    assert.match(m, /`npm run build:native`/);
  });

  const hasCc = spawnSync("cc", ["--version"]).status === 0;
  /** A shared object that needs libibverbs.so.77, which exists only while linking: what a machine without rdma-core sees. */
  function addonWithoutLibibverbs(dir: string): string {
    writeFileSync(join(dir, "stub.c"), "int stub(void) { return 1; }\n");
    writeFileSync(join(dir, "addon.c"), "int stub(void);\nint use(void) { return stub(); }\n");
    const cc = (...a: string[]) => assert.equal(spawnSync("cc", a, { cwd: dir, encoding: "utf8" }).status, 0, a.join(" "));
    cc("-shared", "-fPIC", "-o", "libibverbs.so", "-Wl,-soname,libibverbs.so.77", "stub.c");
    cc("-shared", "-fPIC", "-o", "addon.node", "addon.c", "-L.", "-libverbs");
    rmSync(join(dir, "libibverbs.so"));
    return join(dir, "addon.node");
  }

  it("an addon whose libibverbs is missing (real dlopen): install rdma-core, no rebuild", { skip: hasCc ? false : "no C compiler" }, (t) => {
    const dir = mkdtempSync(join(tmpdir(), "async-rdma-dlopen-"));
    t.after(() => rmSync(dir, { recursive: true, force: true }));
    addonWithoutLibibverbs(dir);
    let msg = "";
    try {
      createRequire(import.meta.url)(join(dir, "addon.node"));
      assert.fail("the addon loaded without its library");
    } catch (e) {
      msg = (e as Error).message;
    }
    const m = explainLoadFailure("the native addon", join(dir, "addon.node"), msg);
    assert.match(m, /^libibverbs\.so\.77 is missing/);
    assert.match(m, /apt-get install -y libibverbs1 ibverbs-providers rdma-core/);
    assert.match(m, /tcp provider works/);
    assert.doesNotMatch(m, /rebuild/);
  });

  it("the install script keeps a prebuild whose libibverbs is missing: no build, exit 0, says what to install", { skip: hasCc ? false : "no C compiler" }, (t) => {
    // an installed package's layout: node_modules/async-rdma/{scripts/install.mjs, prebuilds/linux-x64/…}
    const dir = mkdtempSync(join(tmpdir(), "async-rdma-install-"));
    t.after(() => rmSync(dir, { recursive: true, force: true }));
    const pkg = join(dir, "node_modules", "async-rdma");
    mkdirSync(join(pkg, "scripts"), { recursive: true });
    mkdirSync(join(pkg, "prebuilds", `linux-${process.arch}`), { recursive: true });
    copyFileSync(join(root, "scripts", "install.mjs"), join(pkg, "scripts", "install.mjs"));
    // build-native.mjs would say "native verbs addon not built/built": its absence makes any source build fail loudly
    copyFileSync(addonWithoutLibibverbs(dir), join(pkg, "prebuilds", `linux-${process.arch}`, "async_rdma_verbs.glibc.node"));
    const env = { ...process.env };
    for (const k of Object.keys(env)) if (/^npm_config_build_from_source$/i.test(k)) delete env[k];
    delete env.ASYNC_RDMA_SKIP_NATIVE;
    const r = spawnSync(process.execPath, [join(pkg, "scripts", "install.mjs")], { cwd: pkg, encoding: "utf8", env });
    assert.equal(r.status, 0, r.stdout + r.stderr);
    assert.match(r.stdout, /prebuilt native addon present, but rdma-core is not installed \(.*libibverbs\.so\.77/);
    assert.match(r.stdout, /the tcp provider works/);
    assert.match(r.stdout, /apt-get install -y libibverbs1 librdmacm1 ibverbs-providers rdma-core/);
    assert.equal(r.stderr, "");
  });

  it("a missing librdmacm names librdmacm1", () => {
    const m = explainLoadFailure("the RDMA CM addon", "/x/cm.node", "librdmacm.so.1: cannot open shared object file: No such file or directory");
    assert.match(m, /apt-get install -y librdmacm1 rdma-core/);
  });
});
