/**
 * Work-request encoding for the native provider: TS writes the WRs of one
 * post into a preallocated ArrayBuffer per QP and the addon turns them into
 * one chained ibv_post_send / ibv_post_recv (native/verbs.c reads the same
 * layout; the addon exports its constants and they are checked at load).
 *
 * Layout (little-endian, host order; all offsets in bytes):
 *
 *   control (16):  u32 badIndex (written by the addon: first WR not posted)
 *                  u32 capacity (WR records)   u32 sgeOffset   u32 sgeCapacity
 *   send WR (64):   0 f64 wrId (its bits become ibv_send_wr.wr_id and come back unchanged)
 *                   8 u32 opcode (ibv_wr_opcode)        12 u32 send_flags
 *                  16 u32 first SGE index               20 u32 SGE count
 *                  24 u32 imm (host order; the addon applies htonl) | LOCAL_INV: rkey to invalidate
 *                  28 u32 rkey | BIND_MW: the new rkey
 *                  32 f64 remote address | BIND_MW: bind address
 *                  40 u64 compare_add | BIND_MW: f64 bind length
 *                  48 u64 swap | BIND_MW: u32 window access flags
 *                  56 u32 BIND_MW: index of the window handle in the post's handle array
 *                  60 u32 BIND_MW: index of the MR handle in the post's handle array
 *   recv WR (16):   0 f64 wrId   8 u32 first SGE index   12 u32 SGE count
 *   SGE (16):       0 f64 addr   8 u32 length   12 u32 lkey
 *
 * Records start at byte 16; the SGE region at `sgeOffset` (16-aligned).
 */
import { rebuildCommand, type NativeLayout } from "./native.js";

export const CTRL_BYTES = 16;
export const SEND_WR_BYTES = 64;
export const RECV_WR_BYTES = 16;
export const SGE_BYTES = 16;

/** Throws unless the addon was compiled with this layout. */
export function checkLayout(l: NativeLayout): string | null {
  if (l.ctrlBytes !== CTRL_BYTES || l.sendWrBytes !== SEND_WR_BYTES || l.recvWrBytes !== RECV_WR_BYTES || l.sgeBytes !== SGE_BYTES) {
    return `the native addon's work-request layout (${JSON.stringify(l)}) does not match this version's codec; rebuild it with \`${rebuildCommand()}\``;
  }
  return null;
}

/** A WR buffer: typed views over one ArrayBuffer, created once per QP and direction. */
export class WrBuffer {
  readonly buffer: ArrayBuffer;
  readonly capacity: number;
  readonly sgeCapacity: number;
  readonly recordBytes: number;
  private readonly f64: Float64Array;
  private readonly u32: Uint32Array;
  private readonly u64: BigUint64Array;
  private readonly sgeOffset: number;

  constructor(capacity: number, maxSge: number, recordBytes: number) {
    this.capacity = capacity;
    this.recordBytes = recordBytes;
    this.sgeCapacity = capacity * Math.max(1, maxSge);
    this.sgeOffset = CTRL_BYTES + capacity * recordBytes;
    this.buffer = new ArrayBuffer(this.sgeOffset + this.sgeCapacity * SGE_BYTES);
    this.f64 = new Float64Array(this.buffer);
    this.u32 = new Uint32Array(this.buffer);
    this.u64 = new BigUint64Array(this.buffer);
    this.u32[1] = capacity;
    this.u32[2] = this.sgeOffset;
    this.u32[3] = this.sgeCapacity;
  }

  /** Index of the first WR the addon did not post (after a failed post). */
  get badIndex(): number {
    return this.u32[0]!;
  }

  sge(j: number, addr: number, length: number, lkey: number): void {
    const b = this.sgeOffset + j * SGE_BYTES;
    this.f64[b >> 3] = addr;
    this.u32[(b + 8) >> 2] = length;
    this.u32[(b + 12) >> 2] = lkey;
  }

  recv(i: number, wrId: number, sgeStart: number, numSge: number): void {
    const b = CTRL_BYTES + i * RECV_WR_BYTES;
    this.f64[b >> 3] = wrId;
    this.u32[(b + 8) >> 2] = sgeStart;
    this.u32[(b + 12) >> 2] = numSge;
  }

  /** Common part of a send record; the opcode-specific fields are cleared. */
  send(i: number, wrId: number, opcode: number, flags: number, sgeStart: number, numSge: number): void {
    const b = CTRL_BYTES + i * SEND_WR_BYTES;
    const w = b >> 2;
    this.f64[b >> 3] = wrId;
    this.u32[w + 2] = opcode;
    this.u32[w + 3] = flags;
    this.u32[w + 4] = sgeStart;
    this.u32[w + 5] = numSge;
    this.u32[w + 6] = 0;
    this.u32[w + 7] = 0;
    this.f64[(b + 32) >> 3] = 0;
  }

  /** imm (host order) or, for LOCAL_INV, the rkey to invalidate. */
  imm(i: number, v: number): void {
    this.u32[((CTRL_BYTES + i * SEND_WR_BYTES) >> 2) + 6] = v;
  }

  remote(i: number, addr: number, rkey: number): void {
    const b = CTRL_BYTES + i * SEND_WR_BYTES;
    this.u32[(b >> 2) + 7] = rkey;
    this.f64[(b + 32) >> 3] = addr;
  }

  atomic(i: number, compareAdd: bigint, swap: bigint): void {
    const b = CTRL_BYTES + i * SEND_WR_BYTES;
    this.u64[(b + 40) >> 3] = BigInt.asUintN(64, compareAdd);
    this.u64[(b + 48) >> 3] = BigInt.asUintN(64, swap);
  }

  bind(i: number, newRkey: number, addr: number, length: number, access: number, mwIndex: number, mrIndex: number): void {
    const b = CTRL_BYTES + i * SEND_WR_BYTES;
    const w = b >> 2;
    this.u32[w + 7] = newRkey;
    this.f64[(b + 32) >> 3] = addr;
    this.f64[(b + 40) >> 3] = length;
    this.u32[w + 12] = access;
    this.u32[w + 14] = mwIndex;
    this.u32[w + 15] = mrIndex;
  }
}
