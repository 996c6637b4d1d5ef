/**
 * A counter many processes increment: the owner shares 8 bytes with "atomic"
 * access; each client opens them and adds with RDMA fetch-and-add, which the
 * owner's memory applies atomically (no lock, no message per increment).
 */
import type { LocalMr, Rdma, RdmaListener, RemoteMr } from "../../src/index.js";

export const SHARE_NAME = "counter";

/** Owner: allocates the counter (zero) and shares it with every connection of `listener`. */
export function shareCounter(listener: RdmaListener): LocalMr {
  const counter = listener.allocLocalMr(8);
  listener.share(SHARE_NAME, counter, { access: "atomic" });
  return counter;
}

/** Owner: the counter's value, read in its own memory. */
export function valueOf(counter: LocalMr): bigint {
  return counter.view(BigUint64Array)[0]!;
}

/**
 * Owner: accepts `clients` connections and waits for each client's report
 * (how many increments it made, sent once it is done); returns their sum and
 * the connections (the owner closes them).
 */
export async function collectReports(listener: RdmaListener, clients: number): Promise<{ reported: bigint; connections: Rdma[] }> {
  const connections: Rdma[] = [];
  const reports: Promise<bigint>[] = [];
  for (let i = 0; i < clients; i++) {
    const rdma = await listener.accept();
    connections.push(rdma);
    reports.push(
      rdma.receive().then((m) => {
        using report = m;
        return report.view(BigUint64Array)[0]!;
      }),
    );
  }
  const all = await Promise.all(reports);
  return { reported: all.reduce((a, b) => a + b, 0n), connections };
}

/** Client: opens the shared counter. */
export function openCounter(rdma: Rdma): Promise<RemoteMr> {
  return rdma.openSharedMr(SHARE_NAME, { timeoutMs: 30_000 });
}

/** Client: `times` atomic increments, one after the other. */
export async function countUp(rdma: Rdma, counter: RemoteMr, times: number): Promise<void> {
  for (let i = 0; i < times; i++) await rdma.fetchAndAdd(counter, 1n);
}

/** Client: tells the owner how many increments it made, then waits for the owner to close the connection. */
export async function report(rdma: Rdma, times: number): Promise<void> {
  using m = rdma.allocLocalMr(8);
  m.view(BigUint64Array)[0] = BigInt(times);
  await rdma.send(m);
  await rdma.receive().catch(() => {}); // resolves… never: rejects once the owner closes
  await rdma.close();
}
