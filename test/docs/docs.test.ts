/**
 * Runs every code block of the user guide (docs/guide/*.md), both tutorials
 * (docs/tutorial/<lang>/*.md) and the examples' READMEs, so they cannot rot.
 *
 * A fence's info string says what the block is:
 * - ```ts / ```js: a program. It is written to a file of its own and run with
 *   node (plain JavaScript that is valid TypeScript too, importing
 *   "async-rdma" through the package's own exports map); it must exit 0.
 * - ```ts no-run <reason> (or js): deliberately not run (a fragment, a
 *   placeholder address); the reason is required.
 * - ```sh, ```text: shell commands or program output, not run.
 * Any other fence (a bare ``` included) fails the test: every block is
 * either run or marked with why it is not. README.md's programs are run by
 * test/api/readme.test.ts; here its fences are checked the same way.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, writeFileSync, mkdirSync, readdirSync, existsSync, rmSync } from "node:fs";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join, relative } from "node:path";
import { PROVIDER } from "../support/api.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");

/** The Markdown files whose blocks are checked. */
function docFiles(): string[] {
  const out: string[] = [];
  const md = (dir: string): string[] => (existsSync(dir) ? readdirSync(dir).filter((n) => n.endsWith(".md")).sort().map((n) => join(dir, n)) : []);
  out.push(...md(join(root, "docs", "guide")));
  const tut = join(root, "docs", "tutorial");
  if (existsSync(tut)) for (const lang of readdirSync(tut).sort()) out.push(...md(join(tut, lang)));
  out.push(...md(join(root, "examples")));
  const ex = join(root, "examples");
  for (const d of readdirSync(ex).sort()) if (existsSync(join(ex, d, "README.md"))) out.push(join(ex, d, "README.md"));
  return out;
}

interface Block {
  file: string;
  line: number;
  info: string;
  code: string;
}

/** Every fenced block (``` at the start of a line), with its info string. */
export function blocksOf(file: string): Block[] {
  const lines = readFileSync(file, "utf8").split("\n");
  const blocks: Block[] = [];
  for (let i = 0; i < lines.length; i++) {
    const open = /^(\s*)(`{3,})(.*)$/.exec(lines[i]!);
    if (!open) continue;
    const fence = open[2]!;
    const start = i;
    const body: string[] = [];
    for (i++; i < lines.length && !lines[i]!.trimStart().startsWith(fence); i++) body.push(lines[i]!);
    blocks.push({ file, line: start + 1, info: open[3]!.trim(), code: body.join("\n") + "\n" });
  }
  return blocks;
}

type Kind = { run: true } | { run: false; why: string } | { bad: string };

function kindOf(info: string): Kind | { bad: string } {
  const [lang, ...rest] = info.split(/\s+/);
  if (lang === "sh" || lang === "text") return { run: false, why: lang };
  if (lang === "ts" || lang === "js") {
    if (rest.length === 0) return { run: true };
    if (rest[0] === "no-run") return rest.length > 1 ? { run: false, why: rest.slice(1).join(" ") } : { bad: "`no-run` needs a reason" };
    return { bad: `unknown annotation "${rest.join(" ")}"` };
  }
  return { bad: `unmarked block (fence "${info}"): use ts, js, ts no-run <reason>, sh or text` };
}

function run(file: string): Promise<{ status: number | null; out: string }> {
  return new Promise((resolve) => {
    const p = spawn(process.execPath, [file], { env: { ...process.env, ASYNC_RDMA_PROVIDER: PROVIDER }, stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    p.stdout.on("data", (c: Buffer) => (out += c.toString()));
    p.stderr.on("data", (c: Buffer) => (out += c.toString()));
    const t = setTimeout(() => p.kill("SIGKILL"), 60_000);
    p.on("exit", (status) => {
      clearTimeout(t);
      resolve({ status, out });
    });
  });
}

const files = docFiles();
// One directory per process: two runs of the suite at once never share a file.
const dir = join(root, "dist", "doc-blocks", String(process.pid));

describe(`documentation code blocks [${PROVIDER}]`, () => {
  it("the guide and both tutorials exist and have runnable blocks", () => {
    for (const part of ["guide", "tutorial/en", "tutorial/zh"]) {
      const runnable = files.filter((f) => relative(join(root, "docs"), f).startsWith(part + "/")).flatMap(blocksOf).filter((b) => "run" in kindOf(b.info) && (kindOf(b.info) as { run: boolean }).run);
      assert.ok(runnable.length >= 1, `docs/${part} has no runnable block`);
    }
    // the Chinese tutorial is a translation: the same programs, flow for flow
    const count = (lang: string): number => files.filter((f) => f.includes(join("tutorial", lang))).flatMap(blocksOf).filter((b) => b.info === "ts" || b.info === "js").length;
    assert.equal(count("zh"), count("en"), "docs/tutorial/zh and docs/tutorial/en have different numbers of programs");
  });
  for (const file of files) {
    const rel = relative(root, file);
    describe(rel, () => {
      blocksOf(file).forEach((b, i) => {
        const k = kindOf(b.info);
        if ("bad" in k) {
          it(`${rel}:${b.line} is marked`, () => assert.fail(`${rel}:${b.line}: ${k.bad}`));
          return;
        }
        if (!k.run) return;
        it(`${rel}:${b.line} runs`, async () => {
          mkdirSync(dir, { recursive: true });
          const name = join(dir, `${rel.replace(/[^A-Za-z0-9]+/g, "_")}-${i + 1}.mjs`);
          writeFileSync(name, b.code);
          const r = await run(name);
          assert.equal(r.status, 0, `${rel}:${b.line} failed (exit ${r.status}):\n${r.out}`);
        });
      });
    });
  }
  // README.md: its runnable blocks are run by test/api/readme.test.ts (marked
  // <!-- run -->); here every other fence must be marked too, and no program
  // may be left unmarked (so none escapes both tests).
  it("README.md: every block is marked, every program is run", () => {
    const file = join(root, "README.md");
    const lines = readFileSync(file, "utf8").split("\n");
    for (const b of blocksOf(file)) {
      const k = kindOf(b.info);
      assert.ok(!("bad" in k), `README.md:${b.line}: ${"bad" in k ? k.bad : ""}`);
      if ("run" in k && k.run) {
        const before = lines.slice(0, b.line - 1).reverse().find((l) => l.trim() !== "");
        assert.equal(before?.trim(), "<!-- run -->", `README.md:${b.line}: a program not marked <!-- run --> (readme.test.ts would not run it)`);
      }
    }
  });
  it("cleans up", () => rmSync(dir, { recursive: true, force: true }));
});
