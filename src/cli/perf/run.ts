/**
 * `async-rdma perf <test> [server]`: perftest's tests and columns on the
 * public async-rdma API.
 *
 * Roles as in perftest: without an address this is the server (it waits for
 * one client, runs the test, exits); with one it is the client. The client
 * drives: it sends the test configuration over the library's own connection
 * (a SEND with immediate data CTRL_IMM, which the server takes from
 * receiveWithImm()), then per message size a "size" message, a warm-up, a
 * "measure" message and a "result" message, and finally "end". Target memory
 * comes from requestRemoteMr (write/read/atomic), except write_lat's
 * perftest-style buffer polling, which needs memory the polling side owns and
 * so lends it with sendLocalMr (see runWriteLat).
 *
 * Only the public API is used (../index.js): what this measures is what an
 * application gets.
 */
import { type BwRow, type LatRow } from "./stats.js";
import { DEFAULT_PORT, PERF_USAGE, PROTOCOL, type PerfOptions, PerfUsageError, TIMEOUT_MS, isBw, itersFor, parsePerfArgs, sizesOf, warmFor } from "./options.js";
import { RULE, header, json, out, printRow } from "./output.js";
import { type Rdma, RdmaBuilder, RdmaError, type RdmaListener } from "../../index.js";
import { type Session, type SizeResult, clientBw, clientLat, serverLat, serverSendBw } from "./tests.js";
import { num, recvCtrl, sendCtrl, trace } from "./control.js";
import { progressLine } from "../progress.js";
import { renderPlot } from "./plot.js";
import { writeFileSync } from "node:fs";

export function builderFor(o: PerfOptions): RdmaBuilder {
  const b = new RdmaBuilder().setProvider(o.provider);
  if (o.device !== null) b.setDevice(o.device);
  if (o.gidIndex !== null) b.setGidIndex(o.gidIndex);
  if (o.polling !== null) b.setPolling(o.polling);
  if (o.eager !== null) b.setEagerThreshold(o.eager);
  if (o.txDepth > 256) b.setQpCaps({ maxSendWr: o.txDepth + 16 });
  b.setRecvDepth(o.rxDepth);
  return b;
}

export async function runServer(opts: PerfOptions): Promise<void> {
  let o = opts;
  const listener: RdmaListener = await builderFor(o).bind({ host: "0.0.0.0", port: o.port });
  const conns: Rdma[] = [];
  try {
    const port = listener.port;
    if (o.json) json({ type: "listening", port, test: o.test });
    else out(` Waiting for client to connect... (port ${port}, test ${o.test})`);
    const c0 = await listener.accept();
    conns.push(c0);
    trace("accepted");
    const hello = await recvCtrl(c0, "hello");
    const problems: string[] = [];
    if (hello.protocol !== PROTOCOL) problems.push(`protocol ${String(hello.protocol)} (server ${PROTOCOL})`);
    if (hello.test !== o.test) problems.push(`test ${String(hello.test)} (server ${o.test})`);
    if (problems.length) {
      await sendCtrl(c0, { type: "error", message: `mismatch: client asks for ${problems.join(", ")}` }).catch(() => {});
      throw new RdmaError("PROTOCOL", `perf: the client asks for ${problems.join(", ")}`);
    }
    const qps = num(hello, "qps");
    o = { ...o, gbits: hello.gbits === true, qps };
    await sendCtrl(c0, { type: "hello_ok", provider: c0.provider });
    for (let i = 1; i < qps; i++) conns.push(await listener.accept({ timeoutMs: TIMEOUT_MS }));
    const s: Session = { o, conns, role: "server", txDepth: num(hello, "txDepth"), writeImm: hello.writeImm === true };
    header(o, "server", c0, qps, s.txDepth, o.test === "write_lat" && !s.writeImm ? "lends its buffer (sendLocalMr) and polls it" : o.test === "send_bw" || o.test === "send_lat" ? "posted receives (two-sided)" : "granted to the client (requestRemoteMr)");
    for (;;) {
      const m = await recvCtrl(c0);
      if (m.type === "end") break;
      if (m.type !== "size") throw new RdmaError("PROTOCOL", `perf: unexpected "${m.type}"`);
      const size = num(m, "size");
      const warm = num(m, "warm");
      trace(`size ${size}`);
      let own: SizeResult | null = null;
      if (o.test === "send_bw") own = await serverSendBw(s, size);
      else if (isBw(o.test)) await recvCtrl(c0, "measure");
      else await serverLat(s, size, warm);
      const res = await recvCtrl(c0, "result");
      if (own) printRow(o, "server", c0.provider, own.row, own.note);
      else printRow(o, "server", c0.provider, res.row as unknown as BwRow | LatRow, typeof res.note === "string" ? `${res.note}, measured by the client` : "measured by the client");
    }
    if (!o.json) out(RULE);
  } finally {
    await Promise.all(conns.map((c) => c.close().catch(() => {})));
    await listener.close();
  }
}

export async function runClient(o: PerfOptions): Promise<void> {
  const b = builderFor(o);
  trace("connect");
  const c0 = await b.connect({ host: o.server!, port: o.port || DEFAULT_PORT });
  trace("connected");
  const conns: Rdma[] = [c0];
  const bar = progressLine();
  try {
    await sendCtrl(c0, { type: "hello", protocol: PROTOCOL, test: o.test, qps: o.qps, txDepth: o.txDepth, writeImm: o.writeImm, gbits: o.gbits });
    await recvCtrl(c0, "hello_ok");
    for (let i = 1; i < o.qps; i++) conns.push(await c0.newConnection());
    const s: Session = { o, conns, role: "client", txDepth: o.txDepth, writeImm: o.writeImm };
    header(o, "client", c0, o.qps, o.txDepth, o.test === "write_lat" && !o.writeImm ? "lends its buffer (sendLocalMr) and polls it" : o.test === "send_bw" || o.test === "send_lat" ? "posted receives (two-sided)" : "requestRemoteMr on the server");
    const rows: (BwRow | LatRow)[] = [];
    const sizes = sizesOf(o);
    for (const [k, size] of sizes.entries()) {
      if (sizes.length > 1) bar.update(`perf ${o.test}: ${size} bytes (${k + 1}/${sizes.length})`);
      const iters = itersFor(o, size);
      // -D on a latency test sizes its iterations from the warm-up rate, so it needs some warm-up
      const warm = Math.max(o.duration !== null && !isBw(o.test) ? 10 : 0, o.warmup ?? warmFor(o.test, size, o.txDepth, o.qps));
      await sendCtrl(c0, { type: "size", size, warm });
      const r = isBw(o.test) ? await clientBw(s, size, warm, iters) : await clientLat(s, size, warm, iters);
      rows.push(r.row);
      bar.clear();
      printRow(o, "client", c0.provider, r.row, r.note);
      await sendCtrl(c0, { type: "result", row: r.row as unknown as Record<string, unknown>, ...(r.note ? { note: r.note } : {}) });
    }
    await sendCtrl(c0, { type: "end" });
    if (!o.json) out(RULE);
    if (o.plot !== null) {
      writeFileSync(o.plot, renderPlot(o, c0.provider, rows));
      if (o.json) json({ type: "plot", file: o.plot });
      else out(` plot written to ${o.plot}`);
    }
  } finally {
    bar.clear();
    await Promise.all(conns.map((c) => c.close().catch(() => {})));
  }
}

/** Entry point: `async-rdma perf …`. Usage errors exit with status 2. */
export async function perf(argv: string[]): Promise<void> {
  let o: PerfOptions;
  try {
    o = parsePerfArgs(argv);
  } catch (e) {
    if (e instanceof PerfUsageError) {
      if (!e.message) {
        console.log(PERF_USAGE); // --help: usage on stdout, success
        process.exit(0);
      }
      console.error(`async-rdma perf: ${e.message}`);
      console.error(PERF_USAGE);
      process.exit(2);
    }
    throw e;
  }
  if (o.server === null) await runServer(o);
  else await runClient(o);
}

