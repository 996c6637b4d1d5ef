#!/usr/bin/env node
// Top frames of a V8 .cpuprofile (node --cpu-prof): self time and total
// (inclusive) time per function, as a share of the sampled time.
//   node bench/lib/cpuprofile-top.mjs FILE.cpuprofile [N=20]
import { readFileSync } from "node:fs";

export function topFrames(profile, n = 20) {
  const nodes = new Map(profile.nodes.map((x) => [x.id, x]));
  const parent = new Map();
  for (const x of profile.nodes) for (const c of x.children ?? []) parent.set(c, x.id);
  const dt = new Map();
  const { samples, timeDeltas } = profile;
  for (let i = 0; i < samples.length; i++) dt.set(samples[i], (dt.get(samples[i]) ?? 0) + (timeDeltas[i] ?? 0));
  const total = [...dt.values()].reduce((a, b) => a + b, 0) || 1;
  const key = (x) => {
    const f = x.callFrame;
    const file = f.url ? f.url.replace(/^file:\/\//, "").replace(/^.*\/(dist|node_modules)\//, "$1/") : "";
    return `${f.functionName || "(anonymous)"} ${file}${file ? `:${f.lineNumber + 1}` : ""}`;
  };
  const self = new Map();
  const incl = new Map();
  for (const [id, t] of dt) {
    const x = nodes.get(id);
    self.set(key(x), (self.get(key(x)) ?? 0) + t);
    const seen = new Set();
    for (let cur = id; cur !== undefined; cur = parent.get(cur)) {
      const k = key(nodes.get(cur));
      if (seen.has(k)) continue;
      seen.add(k);
      incl.set(k, (incl.get(k) ?? 0) + t);
    }
  }
  const fmt = (m) => [...m.entries()].sort((a, b) => b[1] - a[1]).slice(0, n).map(([k, t]) => ({ pct: +((100 * t) / total).toFixed(1), ms: +(t / 1000).toFixed(1), frame: k }));
  return { totalMs: total / 1000, self: fmt(self), inclusive: fmt(incl) };
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const file = process.argv[2];
  if (!file) {
    console.error("usage: cpuprofile-top.mjs FILE.cpuprofile [N]");
    process.exit(2);
  }
  const r = topFrames(JSON.parse(readFileSync(file, "utf8")), Number(process.argv[3] ?? 20));
  console.log(`sampled ${r.totalMs.toFixed(0)} ms`);
  console.log("self time:");
  for (const f of r.self) console.log(`  ${String(f.pct).padStart(5)}%  ${f.frame}`);
  console.log("inclusive time:");
  for (const f of r.inclusive) console.log(`  ${String(f.pct).padStart(5)}%  ${f.frame}`);
}
