/**
 * What a posted send WR becomes: a send-queue entry holding a copy of the
 * WR's fields (the caller may reuse its WR objects, and its buffer too for
 * inline data, as soon as postSend returns), and what its completion reports.
 * The WR was checked by ../validate.ts first; only what needs this provider's
 * tables (inline bytes inside a registered MR, a window and MR of ours) is
 * checked here.
 *
 * Invariant (no allocation per WR in steady state): entries are records
 * recycled through a free list, held in a ring of references (ring.ts). A
 * record goes back to the free list only when the requester retires it at
 * the head of the queue, i.e. its completion was generated (or skipped,
 * unsignaled) and nothing can read it any more: the bytes of every socket
 * write made for it were copied out of it (small frames and inline data are
 * copied into the frame; large payloads are written from registered memory,
 * never from the record), and the reader's placement of a READ response
 * names the MRs, not the record. Every field is rewritten when a record is
 * filled again.
 */
import { RdmaError } from "../../errors.js";
import { SendFlags, WcOpcode, WcStatus, WrOpcode, type SendWr, type Sge } from "../types.js";
import { carriesInline } from "../validate.js";
import { SMALL_COPY, copyWords, dvOf } from "./bytes.js";
import { TcpMr, TcpMw, sgeMr, type MemoryPd } from "./memory.js";
import { copySges } from "./ring.js";

export const ENTRY_QUEUED = 0;
export const ENTRY_SENT = 1;
export const ENTRY_DONE = 2;

/** A send-queue entry: the WR's fields copied at post time (the caller may reuse its objects). */
export interface SqEntry {
  wrId: number;
  opcode: number;
  signaled: boolean;
  fence: boolean;
  /** The WR's scatter/gather list: the first `nsge` elements (records reused with the entry). */
  sges: Sge[];
  nsge: number;
  len: number;
  /** The WR's bytes were copied at post (INLINE): `inlineBuf[0, len)` (the record's own bytes of an inline slab). */
  inline: boolean;
  inlineBuf: Uint8Array;
  /** A DataView over inlineBuf's slab (one per slab, shared by its records). */
  inlineDv: DataView | null;
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
  /**
   * The local segments resolved at transmit, the first `ntargets` of (MR,
   * offset in it, length), arrays reused with the entry: for a READ/ATOMIC
   * where its response lands, for a SEND/WRITE the bytes it sends.
   */
  targetMrs: (TcpMr | null)[];
  targetOffs: number[];
  targetLens: number[];
  ntargets: number;
}

const NO_BYTES = new Uint8Array(0);

/**
 * Records' inline bytes are carved from slabs of INLINE_SLAB bytes shared by
 * every QP of the process (a record keeps its piece for life: a buffer of its
 * own would cost an ArrayBuffer and a DataView per record); one DataView
 * per slab serves its records.
 */
const INLINE_SLAB = 16 * 1024;
/** Inline pieces are this big, or the message's length when larger (the device allows up to 1 KiB). */
const INLINE_PIECE = 64;
let inlineSlab: Uint8Array = NO_BYTES;
let inlineSlabOff = 0;
let inlineSlabDv: DataView | null = null;

/** Gives record `e` a piece of an inline slab of at least `len` bytes. */
function takeInlinePiece(e: SqEntry, len: number): void {
  const n = Math.max(len, INLINE_PIECE);
  if (inlineSlabOff + n > inlineSlab.length || inlineSlabDv === null) {
    inlineSlab = new Uint8Array(Math.max(INLINE_SLAB, n));
    inlineSlabDv = new DataView(inlineSlab.buffer);
    inlineSlabOff = 0;
  }
  e.inlineBuf = inlineSlab.subarray(inlineSlabOff, inlineSlabOff + n);
  e.inlineDv = inlineSlabDv;
  inlineSlabOff += n;
}

export function newEntry(): SqEntry {
  return {
    wrId: 0,
    opcode: 0,
    signaled: false,
    fence: false,
    // Arrays of one element (a WR with more SGEs grows them once): an empty array's first push reserves 17.
    sges: [{ addr: 0, length: 0, lkey: 0 }],
    nsge: 0,
    len: 0,
    inline: false,
    inlineBuf: NO_BYTES,
    inlineDv: null,
    imm: 0,
    hasImm: false,
    solicited: false,
    remoteAddr: 0,
    rkey: 0,
    compareAdd: 0n,
    swap: 0n,
    mw: null,
    bindRkey: 0,
    bindMr: null,
    bindAddr: 0,
    bindLen: 0,
    bindAccess: 0,
    invalidateRkey: 0,
    psn: -1,
    state: ENTRY_QUEUED,
    status: WcStatus.SUCCESS,
    rnrTries: 0,
    targetMrs: [null],
    targetOffs: [0],
    targetLens: [0],
    ntargets: 0,
  };
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

/** Unlinks a retired record from what it named (windows, MRs): it is about to go to the free list. */
export function clearEntry(e: SqEntry): void {
  e.mw = null;
  e.bindMr = null;
  for (let t = 0; t < e.ntargets; t++) e.targetMrs[t] = null;
  e.ntargets = 0;
}

/**
 * Fills record `e` (new or from the free list) with WR #i, already checked by
 * validateSendWr (which returned its message length `len`). `signalAll`: the
 * QP's sq_sig_all. Throws INVALID_ARGUMENT for what only this provider can
 * check (the caller gives the record back).
 */
export function fillEntry(e: SqEntry, wr: SendWr, i: number, len: number, pd: MemoryPd, signalAll: boolean): void {
  const op = wr.opcode;
  const flags = wr.flags ?? 0;
  const sges = e.sges;
  const n = (e.nsge = copySges(wr.sgList, sges));
  e.wrId = wr.wrId;
  e.opcode = op;
  e.signaled = signalAll || (flags & SendFlags.SIGNALED) !== 0;
  e.fence = (flags & SendFlags.FENCE) !== 0;
  e.len = len;
  e.inline = false;
  e.imm = wr.imm ?? 0;
  e.hasImm = op === WrOpcode.SEND_WITH_IMM || op === WrOpcode.RDMA_WRITE_WITH_IMM;
  e.solicited = (flags & SendFlags.SOLICITED) !== 0;
  e.remoteAddr = wr.remoteAddr ?? 0;
  e.rkey = wr.rkey ?? 0;
  e.compareAdd = wr.compareAdd ?? 0n;
  e.swap = wr.swap ?? 0n;
  e.mw = null;
  e.bindRkey = 0;
  e.bindMr = null;
  e.bindAddr = 0;
  e.bindLen = 0;
  e.bindAccess = 0;
  e.invalidateRkey = wr.invalidateRkey ?? 0;
  e.psn = -1;
  e.state = ENTRY_QUEUED;
  e.status = WcStatus.SUCCESS;
  e.rnrTries = 0;
  e.ntargets = 0;
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
    // The record keeps its buffer (grown, never shrunk: at most the QP's maxInlineData).
    if (e.inlineBuf.length < len) takeInlinePiece(e, len);
    const data = e.inlineBuf;
    const ddv = e.inlineDv!;
    let o = 0;
    for (let k = 0; k < n; k++) {
      const s = sges[k]!;
      if (s.length === 0) continue;
      const mr = sgeMr(pd, s, false);
      if (mr === null) throw new RdmaError("INVALID_ARGUMENT", `work request #${i}: inline scatter/gather element is not inside a registered MR`);
      copyFromMr(mr, s.addr - mr.addr, data, ddv, o, s.length);
      o += s.length;
    }
    e.inline = true;
  }
}

/** Copies the entry's inline bytes to `dst` at `dof` (`ddv`: a DataView over dst's buffer). */
export function copyInline(e: SqEntry, dst: Uint8Array, ddv: DataView, dof: number): void {
  const src = e.inlineBuf;
  const n = e.len;
  if (n <= SMALL_COPY) copyWords(e.inlineDv!, src.byteOffset, ddv, dst.byteOffset + dof, n);
  else dst.set(n === src.length ? src : src.subarray(0, n), dof);
}

/** Copies `n` bytes of `mr` at `off` to `dst` at `dof` (`ddv`: a DataView over dst's buffer). */
export function copyFromMr(mr: TcpMr, off: number, dst: Uint8Array, ddv: DataView, dof: number, n: number): void {
  const v = mr.view;
  if (n <= SMALL_COPY) copyWords(dvOf(v, mr.dvc), v.byteOffset + off, ddv, dst.byteOffset + dof, n);
  else dst.set(v.subarray(off, off + n), dof);
}
