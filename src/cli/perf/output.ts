/**
 * Output of `async-rdma perf`: perftest's headers and rows, or JSON lines.
 */
import { type BwRow, type LatRow } from "./stats.js";
import { type PerfOptions, type PerfTest, isBw } from "./options.js";
import { type Rdma } from "../../index.js";

export const RULE = "-".repeat(87);

export const TITLES: Record<PerfTest, string> = {
  write_bw: "RDMA_Write BW Test",
  read_bw: "RDMA_Read BW Test",
  send_bw: "Send BW Test",
  atomic_bw: "Atomic FETCH_AND_ADD BW Test",
  write_lat: "RDMA_Write Latency Test",
  read_lat: "RDMA_Read Latency Test",
  send_lat: "Send Latency Test",
  atomic_lat: "Atomic FETCH_AND_ADD Latency Test",
};

export function out(line: string): void {
  process.stdout.write(line + "\n");
}

export function json(o: Record<string, unknown>): void {
  out(JSON.stringify(o));
}

export function header(o: PerfOptions, role: string, rdma: Rdma, qps: number, txDepth: number, extra: string): void {
  if (o.json) return;
  const lat = !isBw(o.test);
  out(RULE);
  out(`                    ${TITLES[o.test]}`);
  out(` Provider        : ${rdma.provider.padEnd(14)} Device         : ${rdma.deviceName}`);
  out(` Number of qps   : ${String(qps).padEnd(14)} Transport type : RC (async-rdma)`);
  out(` Role            : ${role.padEnd(14)} ${lat ? "Iteration" : "TX depth      "} : ${lat ? "one operation at a time" : txDepth}`);
  out(` RX depth        : ${String(o.rxDepth).padEnd(14)} Memory         : ${extra}`);
  // The peer's eager threshold (its --eager-threshold): larger messages go to it by rendezvous READ.
  out(` Eager to peer   : ${`${rdma.peerEagerThreshold} B`.padEnd(14)} Larger sends   : rendezvous READ`);
  out(RULE);
  if (lat) out(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ");
  else {
    const u = o.gbits ? "Gb/sec" : "MB/sec";
    out(` #bytes     #iterations    BW peak[${u}]    BW average[${u}]   MsgRate[Mpps]`);
  }
}

export function printRow(o: PerfOptions, role: string, provider: string, row: BwRow | LatRow, note?: string): void {
  if (o.json) {
    json({ type: "result", test: o.test, role, provider, ...row, ...(note ? { note } : {}) });
    return;
  }
  if ("bwAvg" in row) {
    out(` ${String(row.bytes).padEnd(10)} ${String(row.iterations).padEnd(14)} ${row.bwPeak.toFixed(2).padStart(12)}       ${row.bwAvg.toFixed(2).padStart(12)}          ${row.msgRate.toFixed(6)}${note ? `   (${note})` : ""}`);
  } else {
    const f = (v: number): string => v.toFixed(2).padEnd(14);
    out(` ${String(row.bytes).padEnd(7)} ${String(row.iterations).padEnd(12)} ${f(row.tMin)} ${f(row.tMax)} ${f(row.tTypical)}   ${f(row.tAvg)}   ${f(row.tStdev)}   ${f(row.p99)}         ${f(row.p999)}${note ? `  (${note})` : ""}`);
  }
}

