/**
 * What a posted send WR becomes: a send-queue entry holding a copy of the
 * WR's fields (the caller may reuse its WR objects, and its buffer too for
 * inline data, as soon as postSend returns), and what its completion reports.
 * The WR was checked by ../validate.ts first; only what needs this provider's
 * tables (inline bytes inside a registered MR, a window and MR of ours) is
 * checked here.
 */
import { RdmaError } from "../../errors.js";
import { SendFlags, WcOpcode, WcStatus, WrOpcode, type SendWr, type Sge } from "../types.js";
import { carriesInline } from "../validate.js";
import { TcpMr, TcpMw, localView, type MemoryPd } from "./memory.js";

export const ENTRY_QUEUED = 0;
export const ENTRY_SENT = 1;
export const ENTRY_DONE = 2;

/** A send-queue entry: the WR's fields copied at post time (the caller may reuse its objects). */
export interface SqEntry {
  wrId: number;
  opcode: number;
  signaled: boolean;
  fence: boolean;
  sges: Sge[];
  len: number;
  inline: Uint8Array | null;
  imm: number;
  hasImm: boolean;
  solicited: boolean;
  remoteAddr: number;
  rkey: number;
  compareAdd: bigint;
  swap: bigint;
  mw: TcpMw | null;
  bindRkey: number;
  bindMr: TcpMr | null;
  bindAddr: number;
  bindLen: number;
  bindAccess: number;
  invalidateRkey: number;
  psn: number;
  state: number;
  status: number;
  rnrTries: number;
  /** READ/ATOMIC: where the response lands, resolved at transmit, and whether those MRs are still registered. */
  targets: Uint8Array[] | null;
  guard: (() => boolean) | null;
}

export function isReadOrAtomic(opcode: number): boolean {
  return opcode === WrOpcode.RDMA_READ || opcode === WrOpcode.ATOMIC_CMP_AND_SWP || opcode === WrOpcode.ATOMIC_FETCH_AND_ADD;
}

const WC_OF_WR: Record<number, number> = {
  [WrOpcode.RDMA_WRITE]: WcOpcode.RDMA_WRITE,
  [WrOpcode.RDMA_WRITE_WITH_IMM]: WcOpcode.RDMA_WRITE,
  [WrOpcode.SEND]: WcOpcode.SEND,
  [WrOpcode.SEND_WITH_IMM]: WcOpcode.SEND,
  [WrOpcode.RDMA_READ]: WcOpcode.RDMA_READ,
  [WrOpcode.ATOMIC_CMP_AND_SWP]: WcOpcode.COMP_SWAP,
  [WrOpcode.ATOMIC_FETCH_AND_ADD]: WcOpcode.FETCH_ADD,
  [WrOpcode.LOCAL_INV]: WcOpcode.LOCAL_INV,
  [WrOpcode.BIND_MW]: WcOpcode.BIND_MW,
};

/** The completion's opcode and byte_len for an entry. */
export function wcOpcodeOf(e: SqEntry): number {
  return WC_OF_WR[e.opcode]!;
}

export function wcByteLen(e: SqEntry): number {
  return e.opcode === WrOpcode.ATOMIC_CMP_AND_SWP || e.opcode === WrOpcode.ATOMIC_FETCH_AND_ADD ? 8 : e.opcode === WrOpcode.RDMA_READ ? e.len : 0;
}

/**
 * The entry for WR #i, already checked by validateSendWr (which returned its
 * message length `len`). `signalAll`: the QP's sq_sig_all.
 */
export function makeEntry(wr: SendWr, i: number, len: number, pd: MemoryPd, signalAll: boolean): SqEntry {
  const op = wr.opcode;
  const flags = wr.flags ?? 0;
  const sges: Sge[] = (wr.sgList ?? []).map((s) => ({ addr: s.addr, length: s.length, lkey: s.lkey }));
  const e: SqEntry = {
    wrId: wr.wrId,
    opcode: op,
    signaled: signalAll || (flags & SendFlags.SIGNALED) !== 0,
    fence: (flags & SendFlags.FENCE) !== 0,
    sges,
    len,
    inline: null,
    imm: wr.imm ?? 0,
    hasImm: op === WrOpcode.SEND_WITH_IMM || op === WrOpcode.RDMA_WRITE_WITH_IMM,
    solicited: (flags & SendFlags.SOLICITED) !== 0,
    remoteAddr: wr.remoteAddr ?? 0,
    rkey: wr.rkey ?? 0,
    compareAdd: wr.compareAdd ?? 0n,
    swap: wr.swap ?? 0n,
    mw: null,
    bindRkey: 0,
    bindMr: null,
    bindAddr: 0,
    bindLen: 0,
    bindAccess: 0,
    invalidateRkey: wr.invalidateRkey ?? 0,
    psn: -1,
    state: ENTRY_QUEUED,
    status: WcStatus.SUCCESS,
    rnrTries: 0,
    targets: null,
    guard: null,
  };
  if (op === WrOpcode.BIND_MW) {
    const b = wr.bind!;
    if (!(wr.mw instanceof TcpMw) || !(b.mr instanceof TcpMr)) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: BIND_MW needs a memory window and an MR of the tcp provider`);
    e.mw = wr.mw;
    e.bindRkey = wr.bindRkey!;
    e.bindMr = b.mr;
    e.bindAddr = b.addr;
    e.bindLen = b.length;
    e.bindAccess = b.access;
  }
  if (flags & SendFlags.INLINE && carriesInline(op)) {
    // Inline data is copied now: the caller may reuse its buffer as soon as postSend returns.
    const data = new Uint8Array(len);
    let o = 0;
    for (const s of sges) {
      const v = localView(pd, s, false, []);
      if (v === null) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: inline scatter/gather element is not inside a registered MR`);
      data.set(v, o);
      o += s.length;
    }
    e.inline = data;
  }
  return e;
}
