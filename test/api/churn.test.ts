/**
 * API churn (issue 9, "Tests"): thousands of connect/close cycles through
 * the public API — RdmaBuilder connect and listen, newConnection() siblings,
 * connections closed by either side or both at once, closed while sends,
 * rendezvous, grants, writes and receives are in flight, and connections
 * whose peer's transport is cut (tcp: the peer QP's streams destroyed; verbs,
 * which has no stream: the peer QP moved to ERR under its agent). Every
 * operation settles (done, or a typed RdmaError) before a deadline.
 *
 * Afterwards, against a baseline taken after a warm-up: the device tables
 * (contexts = PDs and pools, QPs, CQs on tcp, keys/MRs), the process-wide
 * peer memory budget (0), open file descriptors (/proc/self/fd: sockets,
 * and on verbs each CQ's completion channel, so CQs too; a small margin for
 * lazily opened ones) and RSS after forced GCs (a generous margin: a leak
 * of one connection's receive buffers alone would exceed it).
 *
 * ASYNC_RDMA_CHURN_CYCLES sets the cycle count: 2,000 on tcp by default,
 * 100 on verbs (rxe in the emulated guest is 4–7× slower, and a cut there
 * is only found by the survivor's keepalive and peer timeout: ~3 s per such
 * cycle; 200 cycles took 5 minutes).
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError, peerMemoryUsage, type Rdma, type RdmaListener } from "../../src/index.js";
import type { Device } from "../../src/transport/types.js";
import { CM, PROVIDER, at, builder } from "../support/api.js";
import { SLOW } from "../support/seam.js";
import { deadline, fdCount, settledRssMiB, tables, watchUnhandled, type Tables } from "../support/fuzz.js";

const CYCLES = Number(process.env.ASYNC_RDMA_CHURN_CYCLES ?? (PROVIDER === "verbs" ? 100 : 2000));
const WARMUP = Math.max(10, Math.round(CYCLES / 10));
const STEP_MS = 30_000 * SLOW;
const KINDS = ["client closes", "server closes", "both close at once", "newConnection siblings", "client closes with operations in flight", "server closes with operations in flight", "peer transport cut"] as const;
type Kind = (typeof KINDS)[number];

/** Every settled operation: done, or rejected with a typed error. */
async function settled(ops: Promise<unknown>[], what: string): Promise<number> {
  const rs = await deadline(Promise.allSettled(ops), STEP_MS, `${what}: every operation to settle`);
  let failed = 0;
  for (const r of rs) {
    if (r.status === "rejected") {
      failed++;
      assert.ok(r.reason instanceof RdmaError, `${what}: an operation rejected with a non-RdmaError: ${String(r.reason)}`);
    }
  }
  return failed;
}

/** Cuts the peer's transport under its agent: tcp destroys the QP's stream; verbs (no stream) moves the QP to ERR. */
function cut(rdma: Rdma): void {
  const qp = rdma.conn.qp as unknown as { sock?: { destroy(): void } | null; setError(): void };
  if (PROVIDER === "tcp") qp.sock?.destroy();
  else qp.setError();
}

describe(`API churn [${PROVIDER}, ${CM}]`, { timeout: 3_600_000 }, () => {
  let listener: RdmaListener;
  // By name, the latest instance: a device whose last connection closed is opened afresh by the
  // next one (two devices: the veth layout), and the closed instance is no longer the device.
  const devices = new Map<string, Device>();
  const watch = watchUnhandled();
  const counts = new Map<string, number>();

  /**
   * On verbs a cut is found by the survivor's keepalive and peer timeout (there is no stream to
   * close): shorter than the defaults there. On tcp the closed streams tell at once: defaults.
   */
  const liveness = <B extends { setKeepalive(ms: number): B; setPeerTimeout(ms: number): B }>(b: B): B => (PROVIDER === "verbs" ? b.setKeepalive(100 * SLOW).setPeerTimeout(600 * SLOW) : b);

  before(async () => {
    listener = await liveness(builder("server")).bind(at(0));
  });

  after(async () => {
    await listener?.close();
    watch.stop();
  });

  async function pair(): Promise<[Rdma, Rdma]> {
    const [c, s] = await deadline(Promise.all([liveness(builder("client")).connect(at(listener.port)), listener.accept({ timeoutMs: STEP_MS })]), STEP_MS, "connect");
    devices.set(c.ctx.device.name, c.ctx.device);
    devices.set(s.ctx.device.name, s.ctx.device);
    return [c, s];
  }

  /** Operations of every kind, started on `from` towards `to` and left in flight. */
  async function inFlight(from: Rdma, to: Rdma, i: number): Promise<Promise<unknown>[]> {
    const small = from.allocLocalMr(64);
    const big = from.allocLocalMr(64 * 1024);
    small.bytes.fill(i & 0xff);
    const granted = await from.requestRemoteMr(4096);
    const ops: Promise<unknown>[] = [
      from.send(small),
      from.send(small),
      from.send(big),
      from.requestRemoteMr(8192),
      from.write(small, granted),
      from.read(small, granted),
      from.fetchAndAdd(granted, 1n),
      from.receive(),
      to.receive().then((m) => m.dispose()),
      to.receive().then((m) => m.dispose()),
    ];
    // dispose what the operations used once they settled (the connection frees it anyway)
    void Promise.allSettled(ops).then(() => {
      for (const x of [small, big, granted]) {
        try {
          x.dispose();
        } catch {
          /* freed with its connection */
        }
      }
    });
    return ops;
  }

  async function cycle(i: number): Promise<void> {
    const kind: Kind = KINDS[i % KINDS.length]!;
    counts.set(kind, (counts.get(kind) ?? 0) + 1);
    const what = `cycle ${i} (${kind})`;
    const [c, s] = await pair();
    switch (kind) {
      case "client closes": {
        using m = c.allocLocalMr(32);
        await c.send(m);
        (await s.receive()).dispose();
        await deadline(c.close(), STEP_MS, `${what}: client close`);
        await deadline(s.close(), STEP_MS, `${what}: server close`);
        break;
      }
      case "server closes":
        await deadline(s.close(), STEP_MS, `${what}: server close`);
        await deadline(c.close(), STEP_MS, `${what}: client close`);
        break;
      case "both close at once":
        await deadline(Promise.all([c.close(), s.close()]), STEP_MS, `${what}: close`);
        break;
      case "newConnection siblings": {
        const sibs: Rdma[] = [];
        const peers: Rdma[] = [];
        for (let k = 0; k < 2; k++) {
          const [n, a] = await deadline(Promise.all([c.newConnection(), listener.accept({ timeoutMs: STEP_MS })]), STEP_MS, `${what}: newConnection`);
          sibs.push(n);
          peers.push(a);
        }
        using m = sibs[1]!.allocLocalMr(16);
        await sibs[1]!.send(m);
        (await peers[1]!.receive()).dispose();
        // the parent first on odd cycles: siblings outlive it (they share its context)
        const order = (i >> 1) % 2 === 0 ? [...sibs, c, ...peers, s] : [c, s, ...peers.reverse(), ...sibs];
        for (const r of order) await deadline(r.close(), STEP_MS, `${what}: close`);
        break;
      }
      case "client closes with operations in flight":
      case "server closes with operations in flight": {
        const ops = await inFlight(c, s, i);
        const closing = kind.startsWith("client") ? c : s;
        await deadline(closing.close(), STEP_MS, `${what}: close`);
        await settled(ops, what);
        await deadline(Promise.all([c.close(), s.close()]), STEP_MS, `${what}: close`);
        break;
      }
      case "peer transport cut": {
        const ops = await inFlight(c, s, i);
        cut(i % 2 === 0 ? s : c);
        await settled(ops, what);
        await deadline(Promise.all([c.close(), s.close()]), STEP_MS, `${what}: close`);
        break;
      }
    }
    assert.ok(c.isClosed && s.isClosed, `${what}: both sides torn down`);
  }

  function snapshot(): { tables: Tables[]; fds: number; budget: number } {
    return { tables: [...devices.values()].map((d) => tables(d)), fds: fdCount(), budget: peerMemoryUsage().used };
  }

  it(`${CYCLES} connect/close cycles (${KINDS.join(", ")}): tables, peer memory, file descriptors and RSS back to the baseline`, async () => {
    for (let i = 0; i < WARMUP; i++) await cycle(i);
    const rss0 = await settledRssMiB();
    const base = snapshot();
    const t0 = performance.now();
    for (let i = WARMUP; i < WARMUP + CYCLES; i++) {
      await cycle(i);
      if (i % 100 === 0) watch.check();
    }
    const ms = performance.now() - t0;
    await deadline(
      (async () => {
        while (listener.stats().handshakes > 0) await new Promise((r) => setImmediate(r));
      })(),
      STEP_MS,
      "handshakes to end",
    );
    const rss = await settledRssMiB();
    const now = snapshot();
    // What leaking one connection's receive buffers alone would cost (recvDepth × (eagerMax + header)).
    const leakMiB = (CYCLES * 32 * 4120) / 2 ** 20;
    console.log(`# ${CYCLES} cycles in ${(ms / 1000).toFixed(1)} s (${JSON.stringify(Object.fromEntries(counts))}); fds ${base.fds} → ${now.fds}; RSS ${rss0.toFixed(0)} → ${rss.toFixed(0)} MiB (leaking the receive buffers would add ~${leakMiB.toFixed(0)} MiB); tables ${JSON.stringify(now.tables)}`);
    assert.deepEqual(now.tables, base.tables, "device tables (contexts, QPs, CQs, keys/MRs) back to the baseline");
    assert.equal(now.budget, 0, "the peer memory budget is back to 0");
    assert.ok(now.fds <= base.fds + 8, `open file descriptors ${base.fds} → ${now.fds}`);
    assert.ok(rss - rss0 < Math.max(24, Math.min(64, leakMiB / 2)), `RSS grew by ${(rss - rss0).toFixed(0)} MiB`);
    watch.check();
  });
});
