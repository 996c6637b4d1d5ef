/**
 * Wire format of the tcp provider, version 2. The only module that knows the
 * byte layout; docs/wire-format.md describes the same table.
 *
 * Each QP uses one TCP stream, carrying both directions: this QP's requests
 * and the peer's responses and ACKs to them, and the peer's requests and this
 * QP's responses and ACKs. The frame type says which half a frame is for.
 * The side whose endpoint compares lower (QP number, then port, PSN,
 * address) dials and says HELLO first; the other side waits for it on its
 * device's port. A request may also carry the sender's cumulative ACK for
 * the peer's requests (flag ACK below), so a ping-pong needs no ACK frame.
 *
 * Every frame is a fixed 48-byte header followed by `payloadLen` bytes:
 *
 * | off | size | field      | meaning                                                        |
 * |-----|------|------------|----------------------------------------------------------------|
 * | 0   | 1    | magic      | 0xRD = 0xD7                                                    |
 * | 1   | 1    | version    | 2 (1: the two-stream format, refused)                          |
 * | 2   | 1    | type       | FrameType                                                      |
 * | 3   | 1    | flags      | bit0 IMM present, bit1 SOLICITED, bit2 ACK (piggybacked ACK)   |
 * | 4   | 4    | psn        | packet sequence number of the request (24 bits used)           |
 * | 8   | 4    | payloadLen | bytes after the header                                         |
 * | 12  | 4    | rkey       | WRITE/READ/ATOMIC target key                                   |
 * | 16  | 8    | raddr      | WRITE/READ/ATOMIC target address (u64, < 2^53)                 |
 * | 24  | 4    | imm        | immediate data, big-endian as verbs carries it                 |
 * | 28  | 4    | aux        | READ: length; ATOMIC: 0 CAS / 1 FADD; ACK: syndrome; HELLO: dstQp |
 * | 32  | 8    | operand1   | ATOMIC: compare or add; ATOMIC_RESP: original value; HELLO: srcQp |
 * | 40  | 8    | operand2   | ATOMIC: swap; ACK with RNR: the RNR timer code; flag ACK: PSN  |
 *
 * All multi-byte fields are big-endian (network order).
 *
 * Piggybacked ACK (flag bit2, SEND / WRITE / READ_REQ only, never ATOMIC,
 * whose operand2 is the swap value): operand2 (< 2^24) carries the cumulative
 * ACK PSN of the reverse direction, exactly what a standalone ACK frame with
 * syndrome 0 would say, so a ping-pong hop costs one frame instead of two.
 * The receiver completes nothing past an unanswered READ/ATOMIC until its
 * response arrives (a peer may write the ACK first). Setting it is optional
 * for senders; receivers must honour it.
 */

export const MAGIC = 0xd7;
export const VERSION = 2;
/** How decodeHeader's reason for a frame of another wire version begins (accept.ts counts those HELLOs). */
export const VERSION_MISMATCH = "wire version";
export const HEADER_LEN = 48;
/** RC allows messages up to 2^31 bytes. */
export const MAX_MESSAGE = 0x80000000;

export const FrameType = {
  HELLO: 1,
  SEND: 2,
  WRITE: 3,
  READ_REQ: 4,
  ATOMIC: 5,
  ACK: 6,
  READ_RESP: 7,
  ATOMIC_RESP: 8,
} as const;
export type FrameType = (typeof FrameType)[keyof typeof FrameType];

export const FrameFlags = {
  IMM: 1,
  SOLICITED: 2,
  /** operand2 carries the cumulative ACK PSN of the reverse direction (SEND, WRITE, READ_REQ only). */
  ACK: 4,
} as const;
const KNOWN_FLAGS = FrameFlags.IMM | FrameFlags.SOLICITED | FrameFlags.ACK;

/** ACK syndromes (IB AETH, by name). */
export const Syndrome = {
  ACK: 0,
  RNR_NAK: 1,
  NAK_INV_REQ: 2,
  NAK_REM_ACCESS: 3,
  NAK_REM_OP: 4,
} as const;

export interface FrameHeader {
  type: number;
  flags: number;
  psn: number;
  payloadLen: number;
  rkey: number;
  raddr: number;
  imm: number;
  aux: number;
  op1: bigint;
  op2: bigint;
}

/**
 * A decoded header. The 64-bit operands are kept as two 32-bit halves and
 * become BigInts only when asked for (atomics, tests): the per-frame path
 * (decoding, a piggybacked ACK PSN, an RNR timer code) never makes a BigInt.
 */
export class DecodedHeader implements FrameHeader {
  type = 0;
  flags = 0;
  psn = 0;
  payloadLen = 0;
  rkey = 0;
  raddr = 0;
  imm = 0;
  aux = 0;
  op1Hi = 0;
  op1Lo = 0;
  op2Hi = 0;
  op2Lo = 0;
  get op1(): bigint {
    return (BigInt(this.op1Hi) << 32n) | BigInt(this.op1Lo);
  }
  set op1(v: bigint) {
    this.op1Hi = Number((v >> 32n) & 0xffffffffn);
    this.op1Lo = Number(v & 0xffffffffn);
  }
  get op2(): bigint {
    return (BigInt(this.op2Hi) << 32n) | BigInt(this.op2Lo);
  }
  set op2(v: bigint) {
    this.op2Hi = Number((v >> 32n) & 0xffffffffn);
    this.op2Lo = Number(v & 0xffffffffn);
  }
}

export function newHeader(): DecodedHeader {
  return new DecodedHeader();
}

/** Header buffers are carved from an arena so a frame costs a view, not an allocation of its own. */
let arena = Buffer.allocUnsafe(64 * 1024);
let arenaOff = 0;

function putU32(b: Uint8Array, o: number, v: number): void {
  b[o] = v >>> 24;
  b[o + 1] = v >>> 16;
  b[o + 2] = v >>> 8;
  b[o + 3] = v;
}

function getU32(b: Uint8Array, o: number): number {
  return b[o]! * 0x1000000 + ((b[o + 1]! << 16) | (b[o + 2]! << 8) | b[o + 3]!);
}

/** A u64 operand: a BigInt (atomics) is split once; a number (0, an ACK PSN, an RNR code, a QP number; < 2^53) costs no BigInt. */
function putU64(b: Uint8Array, o: number, v: bigint | number): void {
  if (typeof v === "number") {
    putU32(b, o, Math.floor(v / 0x100000000) >>> 0);
    putU32(b, o + 4, v >>> 0);
    return;
  }
  const u = BigInt.asUintN(64, v);
  putU32(b, o, Number(u >> 32n));
  putU32(b, o + 4, Number(u & 0xffffffffn));
}

export function encodeHeader(
  type: FrameType,
  flags: number,
  psn: number,
  payloadLen: number,
  rkey: number,
  raddr: number,
  imm: number,
  aux: number,
  op1: bigint | number,
  op2: bigint | number,
  /** Bytes reserved after the header (a small payload copied in by the caller: one write per frame). */
  room = 0,
): Buffer {
  const size = HEADER_LEN + room;
  if (arenaOff + size > arena.length) {
    // Earlier headers may still be queued in a socket: never reuse, start a new arena.
    arena = Buffer.allocUnsafe(Math.max(64 * 1024, size));
    arenaOff = 0;
  }
  const b = arena.subarray(arenaOff, arenaOff + size);
  arenaOff += size;
  writeHeader(b, 0, type, flags, psn, payloadLen, rkey, raddr, imm, aux, op1, op2);
  return b;
}

/** Encodes a header into `b` at `o` (a staging slab: no view per frame). The same bytes as encodeHeader. */
export function writeHeader(
  b: Uint8Array,
  o: number,
  type: FrameType,
  flags: number,
  psn: number,
  payloadLen: number,
  rkey: number,
  raddr: number,
  imm: number,
  aux: number,
  op1: bigint | number,
  op2: bigint | number,
): void {
  b[o] = MAGIC;
  b[o + 1] = VERSION;
  b[o + 2] = type;
  b[o + 3] = flags;
  putU32(b, o + 4, psn >>> 0);
  putU32(b, o + 8, payloadLen >>> 0);
  putU32(b, o + 12, rkey >>> 0);
  putU32(b, o + 16, Math.floor(raddr / 0x100000000) >>> 0);
  putU32(b, o + 20, raddr >>> 0);
  putU32(b, o + 24, imm >>> 0);
  putU32(b, o + 28, aux >>> 0);
  putU64(b, o + 32, op1);
  putU64(b, o + 40, op2);
}

/**
 * Decodes and validates a header in place (no copy, no DataView, no BigInt).
 * Returns an error string for a malformed frame (the caller moves the QP to
 * ERR with that reason) or null.
 */
export function decodeHeader(b: Uint8Array, off: number, h: DecodedHeader): string | null {
  if (b[off] !== MAGIC) return `bad magic 0x${b[off]!.toString(16)}`;
  const ver = b[off + 1]!;
  if (ver !== VERSION) return `${VERSION_MISMATCH} ${ver} not supported (this side speaks ${VERSION})`;
  h.type = b[off + 2]!;
  h.flags = b[off + 3]!;
  h.psn = getU32(b, off + 4);
  h.payloadLen = getU32(b, off + 8);
  h.rkey = getU32(b, off + 12);
  const hi = getU32(b, off + 16);
  if (hi >= 0x200000) return "remote address beyond 2^53";
  h.raddr = hi * 0x100000000 + getU32(b, off + 20);
  h.imm = getU32(b, off + 24);
  h.aux = getU32(b, off + 28);
  h.op1Hi = getU32(b, off + 32);
  h.op1Lo = getU32(b, off + 36);
  h.op2Hi = getU32(b, off + 40);
  h.op2Lo = getU32(b, off + 44);
  if (h.flags & ~KNOWN_FLAGS) return `unknown flags 0x${h.flags.toString(16)}`;
  if (h.flags & FrameFlags.ACK) {
    if (h.type !== FrameType.SEND && h.type !== FrameType.WRITE && h.type !== FrameType.READ_REQ) return `ACK flag on frame type ${h.type} (only SEND, WRITE and READ_REQ carry a piggybacked ACK)`;
    if (h.op2Hi !== 0 || h.op2Lo > 0xffffff) return `piggybacked ACK PSN 0x${h.op2.toString(16)} exceeds 24 bits`;
  }
  if (h.payloadLen > MAX_MESSAGE) return `payload length ${h.payloadLen} exceeds 2^31`;
  switch (h.type) {
    case FrameType.HELLO:
    case FrameType.READ_REQ:
    case FrameType.ATOMIC:
    case FrameType.ACK:
    case FrameType.ATOMIC_RESP:
      if (h.payloadLen !== 0) return `frame type ${h.type} carries no payload, got ${h.payloadLen} bytes`;
      break;
    case FrameType.SEND:
    case FrameType.WRITE:
    case FrameType.READ_RESP:
      break;
    default:
      return `unknown frame type ${h.type}`;
  }
  if (h.type === FrameType.READ_REQ && h.aux > MAX_MESSAGE) return `read length ${h.aux} exceeds 2^31`;
  if (h.type === FrameType.ATOMIC && h.aux > 1) return `unknown atomic op ${h.aux}`;
  if (h.type === FrameType.ACK && h.aux > Syndrome.NAK_REM_OP) return `unknown ACK syndrome ${h.aux}`;
  return null;
}

/** IB RNR NAK timer encoding (IBA table 45) to milliseconds. */
const RNR_TIMER_MS = [
  655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28, 1.92, 2.56, 3.84, 5.12, 7.68, 10.24,
  15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88, 163.84, 245.76, 327.68, 491.52,
];
export function rnrTimerMs(code: number): number {
  return RNR_TIMER_MS[code & 31] ?? 0.64;
}

/** Local ACK timeout exponent to milliseconds: 4.096 µs × 2^t (0 = infinite). */
export function ackTimeoutMs(t: number): number {
  return t === 0 ? Infinity : 0.004096 * 2 ** t;
}
