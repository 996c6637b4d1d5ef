#!/usr/bin/env node
// Lint: layers import downward only (cli → api → agent/memory → transport; errors.ts is below all).
// A file's folder under src/ says its layer. Exits 1 listing every upward or sideways import.
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join, relative, dirname, resolve } from "node:path";

const root = resolve(new URL("..", import.meta.url).pathname);
const src = join(root, "src");
const rank = { errors: 0, transport: 1, memory: 2, agent: 3, api: 4, index: 5, rpc: 6, cli: 7 };
// agent may use memory (same level group per the brief: agent/memory share a tier, agent above memory here).
function layerOf(file) {
  const rel = relative(src, file).split("/");
  if (rel.length === 1) return rel[0].replace(/\.ts$/, "");
  return rel[0];
}
const bad = [];
(function walk(d) {
  for (const n of readdirSync(d)) {
    const p = join(d, n);
    if (statSync(p).isDirectory()) walk(p);
    else if (n.endsWith(".ts")) {
      const from = layerOf(p);
      const text = readFileSync(p, "utf8");
      for (const m of text.matchAll(/(?:import|export)[^"']*?from\s+["'](\.[^"']+)["']|import\(\s*["'](\.[^"']+)["']\s*\)/g)) {
        const spec = m[1] ?? m[2];
        const target = resolve(dirname(p), spec);
        if (!target.startsWith(src)) continue;
        const to = layerOf(target.replace(/\.js$/, ".ts"));
        if (rank[to] === undefined || rank[from] === undefined) continue;
        if (rank[to] > rank[from]) bad.push(`${relative(root, p)} (${from}) imports ${spec} (${to})`);
      }
    }
  }
})(src);
if (bad.length) {
  console.error("layer violations (imports must point down: cli → api → agent → memory → transport → errors):\n  " + bad.join("\n  "));
  process.exit(1);
}
console.log("layers ok");
