/**
 * Runs the README's code blocks marked `<!-- run -->`, so they cannot rot.
 * They are TypeScript importing "async-rdma" through the package's own
 * exports map: transpiled here, then run. (test/package/tarball.test.ts
 * type-checks them under `strict` against the packed declarations.)
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import ts from "typescript";
import { PROVIDER } from "../support/api.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const readme = readFileSync(join(root, "README.md"), "utf8");
const blocks = [...readme.matchAll(/<!-- run -->\s*```(?:ts|js)\n([\s\S]*?)```/g)].map((m) => m[1]!);

describe(`README code blocks [${PROVIDER}]`, () => {
  it("the README has runnable blocks", () => assert.ok(blocks.length >= 1));
  blocks.forEach((code, i) => {
    it(`README block ${i + 1} runs`, () => {
      const dir = join(root, "dist", "readme");
      mkdirSync(dir, { recursive: true });
      const file = join(dir, `block-${i + 1}.mjs`);
      writeFileSync(file, ts.transpileModule(code, { compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 } }).outputText);
      const r = spawnSync(process.execPath, [file], { encoding: "utf8", timeout: 60_000, env: { ...process.env, ASYNC_RDMA_PROVIDER: PROVIDER } });
      assert.equal(r.status, 0, `block ${i + 1} failed:\n${r.stdout}\n${r.stderr}`);
    });
  });
});
