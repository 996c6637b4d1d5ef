/**
 * The native loader's explanations: a missing rdma-core library is fixed by
 * installing it (not by rebuilding), anything else by rebuilding from source,
 * with the command that fits where the package is (a checkout here).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { explainLoadFailure, rebuildCommand } from "../../src/transport/verbs/native.js";

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
  it("an addon whose libibverbs is missing (real dlopen): install rdma-core, no rebuild", { skip: hasCc ? false : "no C compiler" }, (t) => {
    // a shared object that needs libibverbs.so.77, which exists only while linking
    const dir = mkdtempSync(join(tmpdir(), "async-rdma-dlopen-"));
    t.after(() => rmSync(dir, { recursive: true, force: true }));
    writeFileSync(join(dir, "stub.c"), "int stub(void) { return 1; }\n");
    writeFileSync(join(dir, "addon.c"), "int stub(void);\nint use(void) { return stub(); }\n");
    const cc = (...a: string[]) => assert.equal(spawnSync("cc", a, { cwd: dir, encoding: "utf8" }).status, 0, a.join(" "));
    cc("-shared", "-fPIC", "-o", "libibverbs.so", "-Wl,-soname,libibverbs.so.77", "stub.c");
    cc("-shared", "-fPIC", "-o", "addon.node", "addon.c", "-L.", "-libverbs");
    rmSync(join(dir, "libibverbs.so"));
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

  it("a missing librdmacm names librdmacm1", () => {
    const m = explainLoadFailure("the RDMA CM addon", "/x/cm.node", "librdmacm.so.1: cannot open shared object file: No such file or directory");
    assert.match(m, /apt-get install -y librdmacm1 rdma-core/);
  });
});
