/**
 * The control channel of `async-rdma perf`: the client drives the server with messages over the library's own connection (SEND with immediate CTRL_IMM).
 */
import { CTRL_IMM } from "./options.js";
import { type Rdma, RdmaError } from "../../index.js";

export type Ctrl = Record<string, unknown> & { type: string };

export async function sendCtrl(rdma: Rdma, msg: Ctrl): Promise<void> {
  const bytes = Buffer.from(JSON.stringify(msg));
  const lmr = rdma.allocLocalMr(bytes.length);
  try {
    lmr.bytes.set(bytes);
    await rdma.sendWithImm(lmr, CTRL_IMM);
  } finally {
    lmr.dispose();
  }
}

export async function recvCtrl(rdma: Rdma, expect?: string): Promise<Ctrl> {
  const { mr, imm } = await rdma.receiveWithImm();
  try {
    if (imm !== CTRL_IMM) throw new RdmaError("PROTOCOL", `perf: expected a control message${expect ? ` (${expect})` : ""}, got a ${mr.length}-byte data message`);
    const msg = JSON.parse(Buffer.from(mr.bytes).toString("utf8")) as Ctrl;
    if (msg.type === "error") throw new RdmaError("PROTOCOL", `perf: the peer says: ${String(msg.message)}`);
    if (expect !== undefined && msg.type !== expect) throw new RdmaError("PROTOCOL", `perf: expected "${expect}", got "${msg.type}"`);
    return msg;
  } finally {
    mr.dispose();
  }
}

export function num(m: Ctrl, k: string): number {
  const v = m[k];
  if (typeof v !== "number" || !Number.isFinite(v)) throw new RdmaError("PROTOCOL", `perf: control message "${m.type}" lacks a numeric ${k}`);
  return v;
}

export const immediate = (): Promise<void> => new Promise((r) => setImmediate(r));

/**
 * ASYNC_RDMA_PERF_TRACE=1: phases on stderr with timestamps, and on SIGTERM
 * (e.g. from `timeout`) where the run stood — for diagnosing a stuck run.
 */
export const TRACE = !!process.env.ASYNC_RDMA_PERF_TRACE;
export const progress = { phase: "start", posted: 0, completed: 0 };
export function trace(phase: string): void {
  progress.phase = phase;
  if (TRACE) process.stderr.write(`[perf ${(performance.now() / 1000).toFixed(3)} s] ${phase}\n`);
}
if (TRACE) {
  process.on("SIGTERM", () => {
    process.stderr.write(`[perf] SIGTERM in phase "${progress.phase}": ${progress.posted} operations posted, ${progress.completed} completed\n`);
    process.exit(143);
  });
}

