/**
 * Test support for the transport seam: opens devices of the provider under
 * test (ASYNC_RDMA_PROVIDER=tcp|verbs, default tcp), builds connected QP
 * pairs, and waits for completions with a deadline (never a fixed sleep).
 */
import { loadProvider } from "../../src/transport/providers.js";
import {
  Access,
  CompletionBuffer,
  completionAt,
  type CompletionQueue,
  type Device,
  type MemoryRegion,
  type ProtectionDomain,
  type Provider,
  type ProviderName,
  type QpConnectAttr,
  type QpInitAttr,
  type QueuePair,
  type WorkCompletion,
} from "../../src/transport/types.js";

export const PROVIDER = (process.env.ASYNC_RDMA_PROVIDER ?? "tcp") as ProviderName;
/** Deadlines scale up inside the emulated guest, where everything runs 4–7× slower. */
export const SLOW = Number(process.env.ASYNC_RDMA_TEST_SLOW ?? (PROVIDER === "verbs" ? 5 : 1));
export const DEADLINE_MS = 5_000 * SLOW;

/** Device names for side A and side B (two rxe devices in the veth layout, else one device twice). */
export function deviceNames(): [string | undefined, string | undefined] {
  if (PROVIDER === "tcp") return ["tcp0", "tcp1"];
  const devs = (process.env.RXE_DEVS ?? "").split(/\s+/).filter(Boolean);
  return [devs[0], devs[1] ?? devs[0]];
}

export const GID_INDEX = Number(process.env.RXE_GID_INDEX ?? 1);

/**
 * Known deviations of real devices from the verbs rules. A conformance test
 * for such a rule still runs everywhere; on a listed device it asserts the
 * device's documented behaviour instead and says so.
 */
export const DEVICE_DEVIATIONS = {
  "mw-bounds":
    "rxe (kernel 6.1) does not enforce memory-window bounds (type 1 or 2): an access past a window's end but inside its MR succeeds. Grants to peers therefore use dedicated MRs (see ../shared/softroce/README.md).",
  "rxe-lkey-status":
    "rxe (kernel 6.1) completes a SEND/WRITE whose gather SGE names an invalid lkey with LOC_QP_OP_ERR, not LOC_PROT_ERR: rxe_requester maps finish_packet's error to LOC_PROT_ERR only for -EFAULT (an SGE outside its MR) and to LOC_QP_OP_ERR otherwise, and copy_data returns -EINVAL when the lkey lookup fails (drivers/infiniband/sw/rxe/rxe_req.c, rxe_mr.c; measured in the guest). A READ scattering into a bad lkey does give LOC_PROT_ERR.",
  "rxe-recv-len-status":
    "rxe (kernel 6.1) completes a SEND that does not fit the receive buffer with LOC_QP_OP_ERR at the responder and REM_OP_ERR at the requester, not LOC_LEN_ERR / REM_INV_REQ_ERR: send_data_in treats only -ENOSPC from copy_data as RESPST_ERR_LENGTH, and copy_data reports the overrun as -EINVAL, so it becomes RESPST_ERR_MALFORMED_WQE (NAK remote operational error) (drivers/infiniband/sw/rxe/rxe_resp.c, rxe_mr.c; measured in the guest).",
} as const;

export type DeviationRule = keyof typeof DEVICE_DEVIATIONS;

/** Soft-RoCE devices: the harness names the rxe devices it created in RXE_DEVS. */
function isRxe(dev: Device): boolean {
  if (dev.attr.provider !== "verbs") return false;
  return (process.env.RXE_DEVS ?? "").split(/\s+/).includes(dev.name) || /^rxe/.test(dev.name);
}

export function deviates(rule: DeviationRule, dev: Device): boolean {
  if (rule === "mw-bounds") return !dev.attr.mwEnforcesBounds;
  return isRxe(dev);
}

let providerP: Promise<Provider> | null = null;
export function provider(): Promise<Provider> {
  providerP ??= loadProvider(PROVIDER);
  return providerP;
}

export interface Side {
  dev: Device;
  pd: ProtectionDomain;
  cq: CompletionQueue;
  qp: QueuePair;
  buf: CompletionBuffer;
}

export interface Pair {
  a: Side;
  b: Side;
  close(): void;
}

export const ALL_REMOTE = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC;

export async function openDevice(name: string | undefined): Promise<Device> {
  const p = await provider();
  return p.openDevice(name, { host: "127.0.0.1" });
}

export function makeSide(dev: Device, init: Partial<QpInitAttr> = {}): Side {
  const pd = dev.allocPd();
  const cq = dev.createCq(init.maxSendWr ? init.maxSendWr * 2 + 64 : 1024);
  const qp = pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 256, maxRecvWr: 256, maxSendSge: 4, maxRecvSge: 4, maxInlineData: 64, ...init });
  return { dev, pd, cq, qp, buf: new CompletionBuffer(64) };
}

export function endpointFor(qp: QueuePair) {
  return qp.localEndpoint({ gidIndex: GID_INDEX });
}

/** Two connected QPs (A and B), on two devices where the provider has them. */
export async function openPair(
  opts: { a?: Partial<QpInitAttr>; b?: Partial<QpInitAttr>; attrA?: QpConnectAttr; attrB?: QpConnectAttr; beforeConnect?: (a: Side, b: Side) => void } = {},
): Promise<Pair> {
  const [na, nb] = deviceNames();
  const devA = await openDevice(na);
  const devB = await openDevice(nb);
  const a = makeSide(devA, opts.a);
  const b = makeSide(devB, opts.b);
  opts.beforeConnect?.(a, b);
  const attr: QpConnectAttr = { gidIndex: GID_INDEX, timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
  a.qp.connect(endpointFor(b.qp), { ...attr, ...opts.attrA });
  b.qp.connect(endpointFor(a.qp), { ...attr, ...opts.attrB });
  return {
    a,
    b,
    close() {
      for (const s of [a, b]) {
        try {
          s.qp.destroy();
        } catch {
          /* already gone */
        }
      }
      devA.close();
      if (devB !== devA) devB.close();
    },
  };
}

/** Polls `cq` until `n` completions arrived (armed notification in between), or throws after the deadline. */
export async function waitCompletions(side: Side, n: number, deadlineMs = DEADLINE_MS): Promise<WorkCompletion[]> {
  const out: WorkCompletion[] = [];
  const drain = (): void => {
    let k: number;
    while (out.length < n && (k = side.cq.poll(side.buf, Math.min(side.buf.capacity, n - out.length))) > 0) {
      for (let i = 0; i < k; i++) out.push(completionAt(side.buf, i));
    }
  };
  drain();
  if (out.length >= n) return out;
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => {
      side.cq.onNotify = null;
      reject(new Error(`timed out after ${deadlineMs} ms waiting for ${n} completions (got ${out.length}: ${JSON.stringify(out)})`));
    }, deadlineMs);
    const onNotify = (): void => {
      drain();
      if (out.length >= n) {
        clearTimeout(timer);
        side.cq.onNotify = null;
        resolve();
        return;
      }
      side.cq.requestNotify();
      drain();
      if (out.length >= n) {
        clearTimeout(timer);
        side.cq.onNotify = null;
        resolve();
      }
    };
    side.cq.onNotify = onNotify;
    side.cq.requestNotify();
    drain();
    if (out.length >= n) {
      clearTimeout(timer);
      side.cq.onNotify = null;
      resolve();
    }
  });
  return out;
}

/**
 * Asserts that no completion arrives on `side` within `windowMs`: the only
 * kind of wait here that is bounded by time rather than an event, because it
 * checks for the absence of one.
 */
export async function expectNoCompletion(side: Side, windowMs: number): Promise<void> {
  try {
    const got = await waitCompletions(side, 1, windowMs);
    throw new Error(`unexpected completion: ${JSON.stringify(got)}`);
  } catch (e) {
    if (!(e instanceof Error) || !e.message.startsWith("timed out")) throw e;
  }
}

export function mr(side: Side, length: number, access = ALL_REMOTE): MemoryRegion {
  return side.pd.registerMr(length, access);
}

export function bytes(m: MemoryRegion): Uint8Array {
  return new Uint8Array(m.buffer, m.offset, m.length);
}

export function sge(m: MemoryRegion, off = 0, length = m.length - off) {
  return { addr: m.addr + off, length, lkey: m.lkey };
}
