/**
 * Statistics of `async-rdma perf`: perftest's bandwidth and latency rows from completion stamps and samples.
 */

export interface BwRow {
  bytes: number;
  iterations: number;
  bwPeak: number;
  bwAvg: number;
  msgRate: number;
  unit: "MB/sec" | "Gb/sec";
  seconds: number;
}

export interface LatRow {
  bytes: number;
  iterations: number;
  tMin: number;
  tMax: number;
  tTypical: number;
  tAvg: number;
  tStdev: number;
  p99: number;
  p999: number;
}

/** perftest's units: MB = 2^20 bytes; Gb = 10^9 bits. */
export function bwUnit(bytesPerSec: number, gbits: boolean): number {
  return gbits ? (bytesPerSec * 8) / 1e9 : bytesPerSec / 1048576;
}

/**
 * Average: bytes over first post → last completion. Peak: the best rate over
 * any stretch of max(k, 10 % of the run) consecutive completions (k = the
 * operations in flight): completions arrive in bursts (one ACK covers many
 * writes), so shorter stretches would report bursts, not bandwidth. A run no
 * longer than that reports peak = average.
 * perftest's peak is a best-case figure too.
 */
export function bwStats(size: number, count: number, start: number, done: Float64Array, k: number, gbits: boolean): BwRow {
  const end = count > 0 ? done[count - 1]! : start;
  const sec = Math.max(1e-9, (end - start) / 1000);
  const avg = (size * count) / sec;
  let peak = avg;
  // With no more completions than the window, every operation was in flight at once: no stretch to judge a peak by.
  const w = Math.max(1, k, Math.ceil(count / 10));
  if (count > w) {
    let best = Infinity;
    for (let j = w; j < count; j++) {
      const dt = done[j]! - done[j - w]!;
      if (dt > 0 && dt < best) best = dt;
    }
    if (best !== Infinity) peak = Math.max(avg, (size * w) / (best / 1000));
  }
  return { bytes: size, iterations: count, bwPeak: bwUnit(peak, gbits), bwAvg: bwUnit(avg, gbits), msgRate: count / sec / 1e6, unit: gbits ? "Gb/sec" : "MB/sec", seconds: sec };
}

/** Latency statistics in µs over `n` samples; typical = median (as perftest). */
export function latStats(size: number, samples: Float64Array, n: number): LatRow {
  const s = samples.slice(0, n).sort();
  let sum = 0;
  for (let i = 0; i < n; i++) sum += s[i]!;
  const avg = sum / n;
  let sq = 0;
  for (let i = 0; i < n; i++) sq += (s[i]! - avg) ** 2;
  const pct = (p: number): number => s[Math.min(n - 1, Math.max(0, Math.ceil(p * n) - 1))]!;
  return { bytes: size, iterations: n, tMin: s[0]!, tMax: s[n - 1]!, tTypical: s[Math.floor(n / 2)]!, tAvg: avg, tStdev: Math.sqrt(sq / n), p99: pct(0.99), p999: pct(0.999) };
}

