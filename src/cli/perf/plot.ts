/**
 * The SVG plot of `async-rdma perf --plot`.
 */
import { type BwRow, type LatRow } from "./stats.js";
import { type PerfOptions } from "./options.js";

export const esc = (s: string): string => s.replace(/[<>&"]/g, (c) => ({ "<": "&lt;", ">": "&gt;", "&": "&amp;", '"': "&quot;" })[c]!);

export function sizeLabel(n: number): string {
  if (n >= 1 << 20) return `${n / (1 << 20)}M`;
  if (n >= 1024) return `${n / 1024}K`;
  return String(n);
}

/** A log-log line chart (size on x, bandwidth or latency on y), self-contained SVG. */
export function renderPlot(o: PerfOptions, provider: string, rows: (BwRow | LatRow)[]): string {
  const W = 760;
  const H = 460;
  const L = 78;
  const R = 170;
  const T = 44;
  const B = 58;
  const bw = rows.length > 0 && "bwAvg" in rows[0]!;
  const series: { name: string; color: string; pts: [number, number][] }[] = bw
    ? [
        { name: "BW average", color: "#1f77b4", pts: (rows as BwRow[]).map((r) => [r.bytes, r.bwAvg]) },
        { name: "BW peak", color: "#ff7f0e", pts: (rows as BwRow[]).map((r) => [r.bytes, r.bwPeak]) },
      ]
    : [
        { name: "t_typical", color: "#1f77b4", pts: (rows as LatRow[]).map((r) => [r.bytes, r.tTypical]) },
        { name: "t_avg", color: "#2ca02c", pts: (rows as LatRow[]).map((r) => [r.bytes, r.tAvg]) },
        { name: "99%", color: "#d62728", pts: (rows as LatRow[]).map((r) => [r.bytes, r.p99]) },
      ];
  const xs = rows.map((r) => r.bytes);
  const ys = series.flatMap((s) => s.pts.map((p) => p[1])).filter((v) => v > 0);
  const x0 = Math.log2(Math.min(...xs, 2));
  const x1 = Math.max(x0 + 1, Math.log2(Math.max(...xs, 4)));
  const y0 = Math.floor(Math.log10(Math.min(...ys, 1)));
  const y1 = Math.max(y0 + 1, Math.ceil(Math.log10(Math.max(...ys, 1))));
  const r1 = (v: number): number => Math.round(v * 10) / 10;
  const px = (x: number): number => r1(L + ((Math.log2(x) - x0) / (x1 - x0)) * (W - L - R));
  const py = (y: number): number => r1(T + (1 - (Math.log10(Math.max(y, 10 ** y0)) - y0) / (y1 - y0)) * (H - T - B));
  const unit = bw ? (o.gbits ? "Gb/sec" : "MB/sec") : "usec";
  const parts: string[] = [];
  parts.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`);
  parts.push(`<rect width="${W}" height="${H}" fill="white"/>`);
  parts.push(`<text x="${W / 2}" y="22" text-anchor="middle" font-size="15">${esc(`async-rdma perf ${o.test} (${provider}${o.qps > 1 ? `, ${o.qps} qps` : ""})`)}</text>`);
  for (let e = y0; e <= y1; e++) {
    const y = py(10 ** e);
    parts.push(`<line x1="${L}" x2="${W - R}" y1="${y}" y2="${y}" stroke="#ddd"/>`);
    parts.push(`<text x="${L - 6}" y="${y + 4}" text-anchor="end">${10 ** e >= 1 ? String(10 ** e) : (10 ** e).toFixed(-e)}</text>`);
  }
  for (let e = Math.ceil(x0); e <= x1; e += 2) {
    const x = px(2 ** e);
    parts.push(`<line x1="${x}" x2="${x}" y1="${T}" y2="${H - B}" stroke="#eee"/>`);
    parts.push(`<text x="${x}" y="${H - B + 16}" text-anchor="middle">${sizeLabel(2 ** e)}</text>`);
  }
  parts.push(`<rect x="${L}" y="${T}" width="${W - L - R}" height="${H - T - B}" fill="none" stroke="#333"/>`);
  parts.push(`<text x="${(L + W - R) / 2}" y="${H - 14}" text-anchor="middle">message size [bytes]</text>`);
  parts.push(`<text transform="translate(18 ${(T + H - B) / 2}) rotate(-90)" text-anchor="middle">${bw ? `bandwidth [${unit}]` : `latency [${unit}]`}</text>`);
  series.forEach((s, k) => {
    const d = s.pts.filter((p) => p[1] > 0).map((p, i) => `${i ? "L" : "M"}${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
    parts.push(`<path d="${d}" fill="none" stroke="${s.color}" stroke-width="2"/>`);
    for (const p of s.pts) if (p[1] > 0) parts.push(`<circle cx="${px(p[0]).toFixed(1)}" cy="${py(p[1]).toFixed(1)}" r="2.5" fill="${s.color}"><title>${sizeLabel(p[0])}: ${p[1].toFixed(2)} ${unit}</title></circle>`);
    const ly = T + 10 + k * 20;
    parts.push(`<line x1="${W - R + 12}" x2="${W - R + 36}" y1="${ly}" y2="${ly}" stroke="${s.color}" stroke-width="2"/>`);
    parts.push(`<text x="${W - R + 42}" y="${ly + 4}">${esc(s.name)}</text>`);
  });
  parts.push(`</svg>`);
  return parts.join("\n") + "\n";
}

