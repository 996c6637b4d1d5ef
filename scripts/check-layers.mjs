#!/usr/bin/env node
// Lint of the imports under src/ (part of `npm run lint`). Exits 1 listing every violation.
//
// 1. Layers: imports point down only: cli → api → agent → memory → transport → errors.ts
//    (rpc/ and net/, the "./rpc" and "./net" exports, sit above api and the package entry).
//    A file's folder under src/ says its layer (src/index.ts is the package entry, above api).
// 2. Inside transport, the seam and the providers are ranked apart:
//    - the seam is transport/*.ts (types.ts, validate.ts, buffers.ts, providers.ts, index.ts);
//      a provider is a folder under transport/ (tcp/, verbs/);
//    - a provider may import the seam, errors.ts and its own files; never another provider;
//    - the seam never imports a provider, except the loader and the layer's entry
//      (SEAM_LOADS below, each with the one kind of import it may use);
//    - transport/validate.ts imports only transport/types.ts and errors.ts (it is pure, below both providers);
//    - above transport, a provider is reached only through its entry point (its index.ts),
//      except the imports in ALLOWED_INTERNALS below.
// 3. No import cycles between files anywhere in src/, except ALLOWED_CYCLES below. Every import
//    counts: static, re-exports, side-effect, dynamic import(), and type-only ones (`import type`,
//    `import { type A }`, `typeof import()`). tsc erases the type-only ones, so they cannot break
//    module loading, but a circle of types is still a circle of files that cannot be read, tested
//    or moved one at a time (issue 20): a type both sides need goes in a file of its own below
//    both (as src/api/settings.ts, src/memory/pool.ts's KeptMemory). A cycle is reported with the
//    kind of each import on its path, so a type-only one is told apart from a runtime one.
//
// All three rules count every import, type-only ones included: a type is a dependency on the
// module that declares it.
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { dirname, join, relative, resolve, sep } from "node:path";

const root = resolve(new URL("..", import.meta.url).pathname);
const src = join(root, "src");
const rank = { errors: 0, transport: 1, memory: 2, agent: 3, api: 4, index: 5, rpc: 6, net: 6, cli: 7 };

/**
 * The seam's imports of providers that are allowed, and how. Nothing else in transport/*.ts
 * may import a provider.
 */
const SEAM_LOADS = [
  // The provider loader: tcp is pure TypeScript and always available, so it is imported statically.
  { from: "transport/providers.ts", to: "transport/tcp/index.ts", kinds: ["static"] },
  // The loader loads verbs only on demand, with import(): the native addon may be missing, and
  // loadProvider("auto") then falls back to tcp. A static import would make the addon mandatory.
  { from: "transport/providers.ts", to: "transport/verbs/index.ts", kinds: ["dynamic"] },
  // The layer's entry (the package's "./transport" export) re-exports tcpProvider.
  { from: "transport/index.ts", to: "transport/tcp/index.ts", kinds: ["static"] },
];

/**
 * Imports of a provider's internals from above transport that exist today and are being
 * removed (by the owner of src/api). Each names exactly one importing file and one internal
 * file. Do not add to this list: go through the provider's entry point or the seam.
 */
const ALLOWED_INTERNALS = [
  // none: src/api reaches RDMA CM through the seam (Provider.rdmaCm)
];

/**
 * Import cycles that exist today and are being removed (by the owner of src/api). An entry
 * allows exactly that set of files to form a cycle: a cycle through any other file fails.
 */
const ALLOWED_CYCLES = [
  // none
];

/** Every .ts file under src/, as paths relative to src/ with "/" separators. */
function listFiles() {
  const out = [];
  (function walk(d) {
    for (const n of readdirSync(d).sort()) {
      const p = join(d, n);
      if (statSync(p).isDirectory()) walk(p);
      else if (n.endsWith(".ts") && !n.endsWith(".d.ts")) out.push(relative(src, p).split(sep).join("/"));
    }
  })(src);
  return out;
}

function lineOf(text, index) {
  let n = 1;
  for (let i = 0; i < index; i++) if (text.charCodeAt(i) === 10) n++;
  return n;
}

function isCommentAt(text, index) {
  const start = text.lastIndexOf("\n", index - 1) + 1;
  const head = text.slice(start, index).trimStart();
  return head.startsWith("//") || head.startsWith("*") || head.startsWith("/*");
}

/** The relative imports of a file: { spec, kind: static | type | dynamic, line }. */
function importsOf(text) {
  const found = [];
  // import/export ... from "x" at the start of a line; the clause holds only names, braces, commas, * and whitespace.
  const fromRe = /^[ \t]*(import|export)[ \t]+(type[ \t]+)?([\w$*{},\s]*?)\s*from\s*["']([^"']+)["']/gm;
  for (const m of text.matchAll(fromRe)) {
    const clause = m[3].trim();
    let typeOnly = m[2] !== undefined;
    if (!typeOnly && /^\{[\s\S]*\}$/.test(clause)) {
      const names = clause.slice(1, -1).split(",").map((s) => s.trim()).filter(Boolean);
      typeOnly = names.length > 0 && names.every((s) => /^type\s/.test(s));
    }
    found.push({ spec: m[4], kind: typeOnly ? "type" : "static", line: lineOf(text, m.index) });
  }
  for (const m of text.matchAll(/^[ \t]*import[ \t]*["']([^"']+)["']/gm)) found.push({ spec: m[1], kind: "static", line: lineOf(text, m.index) });
  for (const m of text.matchAll(/(typeof\s+)?(?<![\w$.])import\(\s*["']([^"']+)["']\s*\)/g)) {
    if (isCommentAt(text, m.index)) continue;
    found.push({ spec: m[2], kind: m[1] ? "type" : "dynamic", line: lineOf(text, m.index) });
  }
  return found.filter((i) => i.spec.startsWith("."));
}

/** The file a relative specifier names, relative to src/ (null outside src/ or missing). */
function resolveSpec(file, spec) {
  const abs = resolve(dirname(join(src, file)), spec);
  if (!abs.startsWith(src + sep)) return null;
  for (const cand of [abs.replace(/\.js$/, ".ts"), abs + ".ts", join(abs, "index.ts")]) {
    if (existsSync(cand) && statSync(cand).isFile()) return relative(src, cand).split(sep).join("/");
  }
  return null;
}

function layerOf(file) {
  const parts = file.split("/");
  return parts.length === 1 ? parts[0].replace(/\.ts$/, "") : parts[0];
}

/** Inside transport: "seam" for transport/*.ts, else the provider's folder name; null outside transport. */
function zoneOf(file) {
  const parts = file.split("/");
  if (parts[0] !== "transport") return null;
  return parts.length === 2 ? "seam" : parts[1];
}

const files = listFiles();
const edges = []; // { from, to, spec, kind, line }
for (const file of files) {
  const text = readFileSync(join(src, file), "utf8");
  for (const imp of importsOf(text)) {
    const to = resolveSpec(file, imp.spec);
    if (to !== null) edges.push({ from: file, to, ...imp });
  }
}

const violations = [];
const usedLoads = new Set();
const usedInternals = new Set();
const where = (e) => `src/${e.from}:${e.line} imports ${e.spec} (${e.kind === "static" ? "" : e.kind + " "}import)`;

for (const e of edges) {
  const lf = layerOf(e.from);
  const lt = layerOf(e.to);
  // 1. layers
  if (rank[lf] !== undefined && rank[lt] !== undefined && rank[lt] > rank[lf]) {
    violations.push(`${where(e)}: layer ${lf} may not import layer ${lt} (cli → api → agent → memory → transport → errors)`);
    continue;
  }
  const zf = zoneOf(e.from);
  const zt = zoneOf(e.to);
  if (zt === null || zt === "seam" || zf === zt) {
    // 2c. the pure validation module
    if (e.from === "transport/validate.ts" && e.to !== "transport/types.ts" && e.to !== "errors.ts") {
      violations.push(`${where(e)}: transport/validate.ts imports only transport/types.ts and errors.ts`);
    }
    continue;
  }
  // e.to is a provider's file, imported from outside that provider.
  if (zf !== null && zf !== "seam") {
    violations.push(`${where(e)}: provider ${zf} may not import provider ${zt} (providers import only the seam and errors.ts)`);
  } else if (zf === "seam") {
    const load = SEAM_LOADS.find((l) => l.from === e.from && l.to === e.to);
    if (load === undefined) violations.push(`${where(e)}: the seam may not import a provider (only transport/providers.ts loads them)`);
    else if (!load.kinds.includes(e.kind)) violations.push(`${where(e)}: ${e.from} may import ${e.to} only by ${load.kinds.join(" or ")} import`);
    else usedLoads.add(load);
  } else {
    const entry = e.to === `transport/${zt}/index.ts`;
    const allowed = ALLOWED_INTERNALS.find((a) => a.from === e.from && a.to === e.to);
    if (allowed) usedInternals.add(allowed);
    else if (!entry) violations.push(`${where(e)}: above transport, provider ${zt} is reached only through transport/${zt}/index.ts (or the seam)`);
  }
}

/** Strongly connected components of the graph over `kinds`, with more than one file (or a file importing itself). */
function cycles(kinds) {
  const adj = new Map(files.map((f) => [f, []]));
  for (const e of edges) if (kinds.includes(e.kind) && !adj.get(e.from).includes(e.to)) adj.get(e.from).push(e.to);
  let index = 0;
  const idx = new Map();
  const low = new Map();
  const stack = [];
  const on = new Set();
  const out = [];
  const visit = (v) => {
    idx.set(v, index);
    low.set(v, index++);
    stack.push(v);
    on.add(v);
    for (const w of adj.get(v)) {
      if (!idx.has(w)) {
        visit(w);
        low.set(v, Math.min(low.get(v), low.get(w)));
      } else if (on.has(w)) low.set(v, Math.min(low.get(v), idx.get(w)));
    }
    if (low.get(v) === idx.get(v)) {
      const comp = [];
      let w;
      do {
        w = stack.pop();
        on.delete(w);
        comp.push(w);
      } while (w !== v);
      if (comp.length > 1 || adj.get(v).includes(v)) out.push(comp.sort());
    }
  };
  for (const f of files) if (!idx.has(f)) visit(f);
  return out.map((comp) => ({ comp, path: cyclePath(comp, adj) }));
}

/** One cycle through the component, as a path a → b → … → a. */
function cyclePath(comp, adj) {
  const inComp = new Set(comp);
  const start = comp[0];
  const prev = new Map([[start, null]]);
  const queue = [start];
  while (queue.length) {
    const v = queue.shift();
    for (const w of adj.get(v)) {
      if (w === start) {
        const path = [start];
        for (let x = v; x !== null && x !== start; x = prev.get(x)) path.splice(1, 0, x);
        return [...path, start];
      }
      if (inComp.has(w) && !prev.has(w)) {
        prev.set(w, v);
        queue.push(w);
      }
    }
  }
  return comp;
}

const usedCycles = new Set();
/** The kinds of the imports from `a` to `b` (e.g. "type", "static"), for the report. */
const kindsOf = (a, b) => [...new Set(edges.filter((e) => e.from === a && e.to === b).map((e) => e.kind))].join("+");
for (const { comp, path } of cycles(["static", "dynamic", "type"])) {
  const allowed = ALLOWED_CYCLES.find((c) => c.files.length === comp.length && c.files.every((f) => comp.includes(f)));
  if (allowed) usedCycles.add(allowed);
  else {
    const steps = path.slice(1).map((f, i) => ` →(${kindsOf(path[i], f)}) src/${f}`).join("");
    violations.push(`import cycle (type-only imports count too): src/${path[0]}${steps}${comp.length > path.length - 1 ? ` (the cycle spans ${comp.join(", ")})` : ""}`);
  }
}

for (const l of SEAM_LOADS) if (!usedLoads.has(l)) console.warn(`note: SEAM_LOADS entry ${l.from} → ${l.to} matches no import any more; remove it from scripts/check-layers.mjs`);
for (const a of ALLOWED_INTERNALS) if (!usedInternals.has(a)) console.warn(`note: ALLOWED_INTERNALS entry ${a.from} → ${a.to} matches no import any more; remove it from scripts/check-layers.mjs`);
for (const c of ALLOWED_CYCLES) if (!usedCycles.has(c)) console.warn(`note: ALLOWED_CYCLES entry ${c.files.join(" ↔ ")} is no longer a cycle; remove it from scripts/check-layers.mjs`);

if (violations.length) {
  console.error(`import violations (scripts/check-layers.mjs):\n  ${violations.join("\n  ")}`);
  process.exit(1);
}
const allowedNow = usedInternals.size + usedCycles.size;
console.log(`layers ok${allowedNow ? ` (${usedInternals.size} allow-listed import of provider internals, ${usedCycles.size} allow-listed cycle: see scripts/check-layers.mjs)` : ""}`);
