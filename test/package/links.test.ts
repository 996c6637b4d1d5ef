/**
 * issue 22 point 7: the package links nothing it does not ship. `npm pack --dry-run --json`
 * lists what a user gets; every relative link in README.md and in every Markdown file the
 * package ships must name a file it ships, so the links work from node_modules (and on the npm
 * page, which resolves them against the repository). Links to what the package does not ship
 * (sources, benchmarks, engineering notes) are absolute.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname, join, posix } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");

/** The relative link targets of a Markdown text (code blocks and spans left out), each with its line. */
export function relativeLinks(md: string): { target: string; line: number }[] {
  const out: { target: string; line: number }[] = [];
  let fence = false;
  md.split("\n").forEach((raw, i) => {
    if (/^\s*(```|~~~)/.test(raw)) fence = !fence;
    if (fence) return;
    const text = raw.replace(/`[^`]*`/g, "");
    const found = [...text.matchAll(/\]\(\s*(?:<([^>]+)>|([^)\s]+))(?:\s+"[^"]*")?\s*\)/g)].map((m) => (m[1] ?? m[2])!);
    const ref = /^\s*\[[^\]]+\]:\s*<?(\S+?)>?(\s|$)/.exec(text);
    if (ref) found.push(ref[1]!);
    for (const h of text.matchAll(/\b(?:href|src)="([^"]+)"/g)) found.push(h[1]!);
    for (const t of found) {
      if (/^[a-z][a-z0-9+.-]*:/i.test(t) || t.startsWith("#") || t.startsWith("//")) continue;
      out.push({ target: decodeURIComponent(t.split("#")[0]!.split("?")[0]!), line: i + 1 });
    }
  });
  return out;
}

describe("package links", { timeout: 120_000 }, () => {
  it("issue 22 point 7: every relative link in README.md and in the shipped docs names a shipped file", () => {
    const r = spawnSync("npm", ["pack", "--dry-run", "--json", "--ignore-scripts"], { cwd: root, encoding: "utf8" });
    assert.equal(r.status, 0, `npm pack --dry-run failed:\n${r.stderr}`);
    const packed = JSON.parse(r.stdout) as { files: { path: string }[] }[];
    const shipped = new Set(packed[0]!.files.map((f) => f.path));
    assert.ok(shipped.has("README.md") && shipped.has("package.json"), "the pack lists README.md");
    const docs = [...shipped].filter((p) => p.endsWith(".md")).sort();
    assert.ok(docs.some((p) => p.startsWith("docs/guide/")), "the user guide is shipped");
    const broken: string[] = [];
    let checked = 0;
    for (const file of docs) {
      for (const { target, line } of relativeLinks(readFileSync(join(root, file), "utf8"))) {
        checked++;
        const to = posix.normalize(posix.join(posix.dirname(file), target));
        if (!shipped.has(to)) broken.push(`${file}:${line}: ${target} (${to} is not in the package)`);
      }
    }
    assert.ok(checked >= 10, `links were found (${checked})`);
    assert.deepEqual(broken, [], "links to files the package does not ship (ship the file, or link it absolutely)");
  });

  it("issue 22 point 7: the link finder sees inline, reference and HTML links, not code", () => {
    const md = "a [x](docs/a.md#s) b [y](<docs/b c.md>) [z](https://e.org/x) [w](#top)\n`[no](code.md)`\n```\n[no](fenced.md)\n```\n[r]: ./ref.md\n<img src=\"docs/i.svg\">";
    assert.deepEqual(
      relativeLinks(md).map((l) => l.target),
      ["docs/a.md", "docs/b c.md", "./ref.md", "docs/i.svg"],
    );
  });
});
