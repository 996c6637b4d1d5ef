/**
 * The package as a user gets it: packs the tarball once (from a copy of the
 * checkout, with prebuilds made from its build/Release as prepack would),
 * installs it into a temporary project with no compiler on PATH, and checks
 * what is shipped, that the prebuilt addon is used (no build ran), that an
 * example runs from it, that ESM and CommonJS programs load it, that consumer
 * code (the README's blocks among it) compiles against the packed declarations
 * under `strict` with `skipLibCheck: false`, and that a broken addon gives a
 * consumer's hint. Temp dirs are unique: two suites may run at once.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync, type SpawnSyncReturns } from "node:child_process";
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, realpathSync, rmSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, relative, sep } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const tsc = join(root, "node_modules", "typescript", "bin", "tsc");
const typeRoots = join(root, "node_modules", "@types");
const nativeBuilt = existsSync(join(root, "build", "Release", "async_rdma_verbs.node")) && existsSync(join(root, "build", "Release", "async_rdma_cm.node"));
const noPrebuild = nativeBuilt ? false : "no build/Release addons to make prebuilds from (rdma-core headers missing)";

/** npm's own script, so npm runs with a PATH that lacks compilers. */
function npmCli(): string {
  const which = spawnSync("sh", ["-c", "command -v npm"], { encoding: "utf8" }).stdout.trim();
  const real = realpathSync(which);
  return real.endsWith(".js") ? real : join(dirname(real), "..", "lib", "node_modules", "npm", "bin", "npm-cli.js");
}

/** The environment less npm's own variables (a run under `npm test` sets many). */
function cleanEnv(extra: Record<string, string>): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = {};
  for (const [k, v] of Object.entries(process.env)) if (!/^npm_/i.test(k) && k !== "ASYNC_RDMA_NATIVE" && k !== "ASYNC_RDMA_NATIVE_CM") env[k] = v;
  return { ...env, ...extra };
}

function ok(r: SpawnSyncReturns<string>, what: string): string {
  assert.equal(r.status, 0, `${what} failed (${r.status ?? r.signal}):\n${r.stdout}\n${r.stderr}`);
  return r.stdout;
}

function walk(dir: string, out: string[] = []): string[] {
  for (const n of readdirSync(dir)) {
    const p = join(dir, n);
    if (statSync(p).isDirectory()) walk(p, out);
    else out.push(p);
  }
  return out;
}

interface Packed {
  files: { path: string; size: number }[];
  entryCount: number;
  unpackedSize: number;
  filename: string;
}

describe("package tarball", { timeout: 120_000 }, () => {
  let tmp = "";
  let app = "";
  let pkgDir = "";
  let packed: Packed;
  let installLog = "";
  let safePath = "";

  before(() => {
    tmp = mkdtempSync(join(tmpdir(), "async-rdma-pkg-"));
    const stage = join(tmp, "stage");
    // a copy of the checkout: the pack's prebuilds never touch the checkout another suite may be using
    cpSync(root, stage, {
      recursive: true,
      filter: (src) => {
        const rel = relative(root, src);
        return !/^(node_modules|\.git|prebuilds)(\/|$)/.test(rel) && !rel.endsWith(".tgz");
      },
    });
    if (nativeBuilt) ok(spawnSync(process.execPath, [join(stage, "scripts", "prebuild.mjs"), "--from-build"], { encoding: "utf8" }), "prebuild");
    const npm = npmCli();
    // --ignore-scripts: prepack would rebuild dist/ and the addon; the copy has both already
    const pack = ok(spawnSync(process.execPath, [npm, "pack", "--ignore-scripts", "--json", "--pack-destination", tmp], { cwd: stage, encoding: "utf8", env: cleanEnv({}) }), "npm pack");
    packed = (JSON.parse(pack) as Packed[])[0]!;

    // PATH with node and sh only: no cc, g++, make or python3, so a source build cannot run
    const bin = join(tmp, "bin");
    mkdirSync(bin);
    symlinkSync(process.execPath, join(bin, "node"));
    symlinkSync("/bin/sh", join(bin, "sh"));
    safePath = bin;
    app = join(tmp, "app");
    mkdirSync(app);
    writeFileSync(join(app, "package.json"), JSON.stringify({ name: "consumer", version: "1.0.0", private: true }));
    const r = spawnSync(process.execPath, [npm, "install", join(tmp, packed.filename), "--offline", "--no-audit", "--no-fund", "--foreground-scripts"], {
      cwd: app,
      encoding: "utf8",
      env: cleanEnv({ PATH: bin, npm_config_cache: join(tmp, "npm-cache") }),
    });
    installLog = ok(r, "npm install of the tarball") + r.stderr;
    pkgDir = join(app, "node_modules", "async-rdma");
  });

  after(() => {
    if (tmp) rmSync(tmp, { recursive: true, force: true });
  });

  it("ships dist (no tests), the native sources and build scripts, README, LICENSE, CHANGELOG, the user docs, and nothing else", () => {
    const paths = packed.files.map((f) => f.path);
    for (const p of ["package.json", "README.md", "LICENSE", "CHANGELOG.md", "binding.gyp", "native/verbs.c", "native/cm.c", "native/napi_util.h", "scripts/build-native.mjs", "scripts/install.mjs", "dist/src/index.js", "dist/src/index.d.ts", "dist/src/cli/main.js", "dist/examples/lab/run.js"]) {
      assert.ok(paths.includes(p), `${p} is not in the tarball`);
    }
    const stray = paths.filter(
      (p) =>
        !/^(package\.json|README\.md|LICENSE|CHANGELOG\.md|binding\.gyp|native\/[\w-]+\.[ch]|scripts\/(build-native|install)\.mjs|prebuilds\/linux-x64\/async_rdma_(verbs|cm)\.glibc\.node)$/.test(p) &&
        !/^dist\/(src|examples)\/.*\.(js|d\.ts)$/.test(p) &&
        // the user docs the README links (issue 22 point 7; test/package/links.test.ts)
        !/^docs\/(guide\/[\w-]+|tutorial\/\w+\/README|cp|limits|memory|security|wire-format)\.md$/.test(p),
    );
    assert.deepEqual(stray, [], "files outside the whitelist");
    assert.deepEqual(paths.filter((p) => /\.test\.|^dist\/test\/|\.map$|^src\/|^test\/|^bench\/|^\.ci\/|softroce/.test(p)), []);
    // The compiled sources (one file per invariant: .js + .d.ts each; 304 files once issue 20 split the
    // agent and the API) and the user docs; a bound, so a stray folder shows.
    assert.ok(packed.entryCount < 350, `${packed.entryCount} files`);
    // With the user docs and the prebuilt addons: 1.51 MB at the merge of issue 22.
    assert.ok(packed.unpackedSize < 2_000_000, `${packed.unpackedSize} bytes unpacked`);
  });

  it("package.json has the fields users expect", () => {
    const pkg = JSON.parse(readFileSync(join(pkgDir, "package.json"), "utf8")) as Record<string, unknown>;
    for (const k of ["repository", "homepage", "bugs", "keywords", "license", "engines", "exports", "types", "bin"]) assert.ok(pkg[k] !== undefined, `no ${k}`);
    assert.equal(pkg.license, "MIT");
    assert.match(readFileSync(join(pkgDir, "LICENSE"), "utf8"), /^MIT License/);
    assert.match((pkg.engines as { node: string }).node, /^>=20\.19/);
  });

  it("installs with the prebuilt addon: no compiler on PATH, no build ran", { skip: noPrebuild }, () => {
    assert.match(installLog, /using the prebuilt native addon \(prebuilds\/linux-x64\/async_rdma_verbs\.glibc\.node\)/, installLog);
    assert.ok(!existsSync(join(pkgDir, "build")), "a build/ directory appeared: the addon was compiled");
    const addons = walk(pkgDir).filter((p) => p.endsWith(".node")).map((p) => relative(pkgDir, p).split(sep).join("/"));
    assert.deepEqual(addons.sort(), ["prebuilds/linux-x64/async_rdma_cm.glibc.node", "prebuilds/linux-x64/async_rdma_verbs.glibc.node"]);
    // the verbs provider loads, and the only addons there are are the prebuilds
    writeFileSync(join(app, "verbs.mjs"), 'import { loadProvider } from "async-rdma/transport";\nconst p = await loadProvider("verbs");\nconsole.log(p.name);\n');
    assert.equal(ok(spawnSync(process.execPath, [join(app, "verbs.mjs")], { cwd: app, encoding: "utf8", env: cleanEnv({ PATH: safePath }) }), "verbs provider").trim(), "verbs");
  });

  it("runs an example from the package (async-rdma lab, tcp provider), and the bin answers --version", () => {
    const binJs = join(app, "node_modules", ".bin", "async-rdma");
    const env = cleanEnv({ PATH: safePath, ASYNC_RDMA_PROVIDER: "tcp" });
    const out = ok(spawnSync(process.execPath, [binJs, "lab"], { cwd: app, encoding: "utf8", env, timeout: 60_000 }), "async-rdma lab");
    assert.match(out, /lab finished on both ends/);
    assert.equal(ok(spawnSync(process.execPath, [binJs, "--version"], { cwd: app, encoding: "utf8", env }), "--version").trim(), "0.1.0");
  });

  it("loads from ESM (import) and CommonJS (require) programs", () => {
    const prog = (load: string) =>
      `${load}\nconst l = await new RdmaBuilder().setProvider("tcp").bind("127.0.0.1:0");\nconsole.log(typeof l.port, isRdmaError(new RdmaError("TIMEOUT", "x")));\nawait l.close();\n`;
    writeFileSync(join(app, "esm.mjs"), prog('import { RdmaBuilder, RdmaError, isRdmaError } from "async-rdma";'));
    writeFileSync(join(app, "cjs.cjs"), `const { RdmaBuilder, RdmaError, isRdmaError } = require("async-rdma");\nconst { RpcServer } = require("async-rdma/rpc");\nrequire("async-rdma/transport");\n(async () => {\n${prog("")}\nconsole.log(typeof RpcServer);\n})();\n`);
    const env = cleanEnv({ PATH: safePath });
    assert.equal(ok(spawnSync(process.execPath, [join(app, "esm.mjs")], { cwd: app, encoding: "utf8", env }), "ESM program").trim(), "number true");
    assert.equal(ok(spawnSync(process.execPath, ["--no-warnings", join(app, "cjs.cjs")], { cwd: app, encoding: "utf8", env }), "CommonJS program").trim(), "number true\nfunction");
  });

  it("consumer code and the README's blocks compile against the packed types: strict, skipLibCheck false, nodenext ESM and CJS", () => {
    const readme = readFileSync(join(root, "README.md"), "utf8");
    const blocks = [...readme.matchAll(/<!-- run -->\s*```(?:ts|js)\n([\s\S]*?)```/g)].map((m) => m[1]!);
    assert.ok(blocks.length >= 1);
    const src = join(app, "src");
    mkdirSync(src);
    blocks.forEach((b, i) => writeFileSync(join(src, `readme-${i + 1}.mts`), b));
    writeFileSync(
      join(src, "esm.mts"),
      [
        'import { RdmaBuilder, RdmaError, isRdmaError, type Rdma, type LocalMr, type RemoteMr, type RdmaErrorCode } from "async-rdma";',
        'import { loadProvider, tcpProvider, type Provider } from "async-rdma/transport";',
        'import { RpcServer, RpcClient } from "async-rdma/rpc";',
        "export async function f(rdma: Rdma, lmr: LocalMr, rmr: RemoteMr): Promise<RdmaErrorCode | null> {",
        "  try { await rdma.write(lmr, rmr); return null; } catch (e) { return isRdmaError(e) ? e.code : null; }",
        "}",
        "const e = new RdmaError(\"TIMEOUT\", \"x\", { errnoName: \"ETIMEDOUT\" });",
        "export const n: number | undefined = e.errno;",
        "export const name: string | undefined = e.errnoName;",
        "export const p: Promise<Provider> = loadProvider(\"tcp\");",
        "export const all = [RdmaBuilder, tcpProvider, RpcServer, RpcClient];",
      ].join("\n"),
    );
    writeFileSync(
      join(src, "cjs.cts"),
      [
        'import { RdmaBuilder, type RdmaListener } from "async-rdma";',
        'import { RpcClient } from "async-rdma/rpc";',
        "export async function g(): Promise<RdmaListener> { return new RdmaBuilder().bind(\"127.0.0.1:0\"); }",
        "export const c = RpcClient;",
      ].join("\n"),
    );
    const base = { strict: true, skipLibCheck: false, target: "es2022", noEmit: true, types: ["node"], typeRoots: [typeRoots], exactOptionalPropertyTypes: true, noUncheckedIndexedAccess: true };
    writeFileSync(join(app, "tsconfig.json"), JSON.stringify({ compilerOptions: { ...base, module: "nodenext", moduleResolution: "nodenext" }, include: ["src"] }));
    ok(spawnSync(process.execPath, [tsc, "-p", join(app, "tsconfig.json")], { cwd: app, encoding: "utf8" }), "tsc (nodenext, ESM and CJS)");
    // no declaration may need esModuleInterop (e.g. `import net from "node:net"`): bundler mode without it
    writeFileSync(join(app, "plain.ts"), 'import * as A from "async-rdma";\nimport * as T from "async-rdma/transport";\nimport * as R from "async-rdma/rpc";\nexport const all = [A, T, R];\n');
    writeFileSync(
      join(app, "tsconfig.bundler.json"),
      JSON.stringify({ compilerOptions: { ...base, module: "esnext", moduleResolution: "bundler", esModuleInterop: false, allowSyntheticDefaultImports: false }, files: ["plain.ts"] }),
    );
    ok(spawnSync(process.execPath, [tsc, "-p", join(app, "tsconfig.bundler.json")], { cwd: app, encoding: "utf8" }), "tsc (bundler, no esModuleInterop)");
  });

  it("the declarations leave internals out (stripInternal)", () => {
    const dts = walk(join(pkgDir, "dist", "src"))
      .filter((p) => p.endsWith(".d.ts"))
      .map((p) => readFileSync(p, "utf8"))
      .join("\n");
    for (const re of [/declare class Connection\b/, /declare class Context\b/, /declare class MrPool\b/, /function makeConnection\b/, /\bdial\(/, /^import (type )?\w+ from "node:/m]) assert.doesNotMatch(dts, re);
    assert.match(dts, /declare class RdmaBuilder\b/);
  });

  it("a prebuilt addon that does not load, or none: verbs is PROVIDER_UNAVAILABLE with the consumer's fix, auto falls back to tcp", { skip: noPrebuild }, () => {
    writeFileSync(join(pkgDir, "prebuilds", "linux-x64", "async_rdma_verbs.glibc.node"), "not an ELF file");
    writeFileSync(
      join(app, "broken.mjs"),
      [
        'import { loadProvider } from "async-rdma/transport";',
        'console.log((await loadProvider("auto")).name);',
        'try { await loadProvider("verbs"); console.log("loaded"); } catch (e) { console.log(e.code); console.log(e.message); }',
      ].join("\n"),
    );
    const out = ok(spawnSync(process.execPath, [join(app, "broken.mjs")], { cwd: app, encoding: "utf8", env: cleanEnv({ PATH: safePath }) }), "broken addon");
    const [auto, code, message] = out.split("\n");
    assert.equal(auto, "tcp");
    assert.equal(code, "PROVIDER_UNAVAILABLE");
    assert.match(message!, /async_rdma_verbs\.glibc\.node failed to load/);
    assert.match(message!, /`npm rebuild async-rdma`/);
    assert.doesNotMatch(message!, /build:native/);
    // no addon at all (no prebuild fits, nothing compiled): the same fix, after the headers
    rmSync(join(pkgDir, "prebuilds"), { recursive: true });
    const none = ok(spawnSync(process.execPath, [join(app, "broken.mjs")], { cwd: app, encoding: "utf8", env: cleanEnv({ PATH: safePath }) }), "no addon").split("\n");
    assert.deepEqual(none.slice(0, 2), ["tcp", "PROVIDER_UNAVAILABLE"]);
    assert.match(none[2]!, /not built, and no prebuild fits this machine/);
    assert.match(none[2]!, /apt-get install -y libibverbs-dev .*`npm rebuild async-rdma`/);
  });
});
