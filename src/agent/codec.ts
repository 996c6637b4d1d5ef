/**
 * The agent's control protocol, version 3: every SEND between two async-rdma
 * endpoints starts with this 24-byte header (docs/wire-format.md).
 *
 * | off | size | field   | meaning                                                      |
 * |-----|------|---------|--------------------------------------------------------------|
 * | 0   | 1    | magic   | 0xA7                                                         |
 * | 1   | 1    | version | 1                                                            |
 * | 2   | 1    | type    | MsgType                                                      |
 * | 3   | 1    | flags   | bit0: user immediate present                                 |
 * | 4   | 4    | credits | receive buffers the sender re-posted since its last report   |
 * | 8   | 4    | imm     | user immediate data                                          |
 * | 12  | 4    | token   | request id / grant id / lend id / rendezvous id              |
 * | 16  | 4    | a       | per type: length, status or reason                           |
 * | 20  | 4    | b       | per type: lease in ms                                        |
 * | 24  | 8    | addr    | descriptor types: remote address (LIMITS: quota bytes)       |
 * | 32  | 4    | rkey    | descriptor types: remote key (LIMITS: max regions)           |
 * | 36  | 4    | id      | MR_GRANT, MR_SHARED: the id chosen by the owner; else zero   |
 *
 * MR_OPEN carries the first 16 bytes of SHA-256(name) in bytes 24–39 instead.
 *
 * DATA carries the user's bytes after the 24-byte header. Big-endian fields.
 */

export const MAGIC = 0xa7;
export const VERSION = 3;
export const HDR = 24;
export const DESC = 16;

export const MsgType = {
  DATA: 1,
  RNDV: 2,
  RNDV_DONE: 3,
  CREDIT: 4,
  MR_REQUEST: 5,
  MR_GRANT: 6,
  MR_DENY: 7,
  MR_RELEASE: 8,
  MR_LEND: 9,
  MR_RETURN: 10,
  MR_GIVE_BACK: 11,
  CLOSE: 12,
  /** Liveness probe: the peer's agent answers PONG (token echoed). */
  PING: 13,
  PONG: 14,
  /** The sender gives up a rendezvous: the receiver drops it unless already delivered, then answers RNDV_DONE. */
  RNDV_CANCEL: 15,
  /** Opens a shared region by name (hash in the descriptor bytes); answered by MR_SHARED or MR_DENY. */
  MR_OPEN: 16,
  /** A shared region opened: id, length, access flags (b), address and rkey. */
  MR_SHARED: 17,
  /** The owner revoked a shared region (token: the open's id). */
  MR_REVOKED: 18,
  /** Asks the owner to extend a grant or lend (token: its id; b: lease in ms). */
  MR_RENEW: 19,
  /** The owner's answer to MR_RENEW (a: RenewStatus; b: the lease applied, or the owner's maximum). */
  MR_RENEWED: 20,
  /** This side's limits, sent once at start: a max lease ms, b max message size, addr quota bytes, rkey max regions. */
  LIMITS: 21,
} as const;
const LAST_TYPE = MsgType.LIMITS;
export type MsgType = (typeof MsgType)[keyof typeof MsgType];

export const DenyReason = { QUOTA: 1, TOO_LARGE: 2, NO_MEMORY: 3, NOT_FOUND: 4, LEASE_TOO_LONG: 6, BUDGET: 7 } as const;
export const RenewStatus = { OK: 0, UNKNOWN: 1, TOO_LONG: 2 } as const;
/** RNDV_DONE's `a`: the message was delivered, or dropped after a RNDV_CANCEL. */
export const RndvStatus = { DELIVERED: 0, CANCELLED: 1 } as const;

export interface Msg {
  type: number;
  flags: number;
  credits: number;
  imm: number;
  token: number;
  a: number;
  b: number;
  addr: number;
  rkey: number;
  /** Descriptor messages only (MR_GRANT: the grant id). */
  id: number;
  /** MR_OPEN only: 16 bytes of the name's hash. */
  hash?: Uint8Array | undefined;
}

const WITH_DESC = new Set<number>([MsgType.RNDV, MsgType.MR_GRANT, MsgType.MR_LEND, MsgType.MR_SHARED, MsgType.LIMITS]);
/** Messages whose bytes 24–39 are opaque (a name hash). */
const WITH_HASH = new Set<number>([MsgType.MR_OPEN]);

export function msgLength(type: number): number {
  return WITH_DESC.has(type) || WITH_HASH.has(type) ? HDR + DESC : HDR;
}

export function encodeMsg(dst: Uint8Array, m: Msg): number {
  const dv = new DataView(dst.buffer, dst.byteOffset, dst.byteLength);
  dv.setUint8(0, MAGIC);
  dv.setUint8(1, VERSION);
  dv.setUint8(2, m.type);
  dv.setUint8(3, m.flags);
  dv.setUint32(4, m.credits);
  dv.setUint32(8, m.imm >>> 0);
  dv.setUint32(12, m.token >>> 0);
  dv.setUint32(16, m.a >>> 0);
  dv.setUint32(20, m.b >>> 0);
  if (WITH_DESC.has(m.type)) {
    dv.setUint32(24, Math.floor(m.addr / 0x100000000));
    dv.setUint32(28, m.addr >>> 0);
    dv.setUint32(32, m.rkey >>> 0);
    dv.setUint32(36, m.id >>> 0);
    return HDR + DESC;
  }
  if (WITH_HASH.has(m.type)) {
    if (m.hash?.length !== DESC) throw new RangeError(`message type ${m.type} needs a ${DESC}-byte hash`);
    dst.set(m.hash, HDR);
    return HDR + DESC;
  }
  return HDR;
}

/** Decodes a received message of `len` bytes; a string names what is wrong with it. */
export function decodeMsg(src: Uint8Array, len: number, out: Msg): string | null {
  if (len < HDR) return `control message of ${len} bytes is shorter than its ${HDR}-byte header`;
  const dv = new DataView(src.buffer, src.byteOffset, len);
  if (dv.getUint8(0) !== MAGIC) return `bad magic 0x${dv.getUint8(0).toString(16)}`;
  if (dv.getUint8(1) !== VERSION) return `control protocol version ${dv.getUint8(1)} not supported (this side speaks ${VERSION})`;
  out.type = dv.getUint8(2);
  out.flags = dv.getUint8(3);
  out.credits = dv.getUint32(4);
  out.imm = dv.getUint32(8);
  out.token = dv.getUint32(12);
  out.a = dv.getUint32(16);
  out.b = dv.getUint32(20);
  out.addr = 0;
  out.rkey = 0;
  out.id = 0;
  out.hash = undefined;
  if (out.type < MsgType.DATA || out.type > LAST_TYPE) return `unknown control message type ${out.type}`;
  if (out.flags & ~1) return `unknown flags 0x${out.flags.toString(16)}`;
  if (out.type !== MsgType.DATA && (out.flags & 1)) return "immediate flag on a control message";
  if (WITH_DESC.has(out.type)) {
    if (len !== HDR + DESC) return `message type ${out.type} must be ${HDR + DESC} bytes, got ${len}`;
    const hi = dv.getUint32(24);
    if (hi >= 0x200000) return "address beyond 2^53";
    out.addr = hi * 0x100000000 + dv.getUint32(28);
    out.rkey = dv.getUint32(32);
    out.id = dv.getUint32(36);
  } else if (WITH_HASH.has(out.type)) {
    if (len !== HDR + DESC) return `message type ${out.type} must be ${HDR + DESC} bytes, got ${len}`;
    out.hash = src.slice(HDR, HDR + DESC);
  } else if (out.type !== MsgType.DATA && len !== HDR) {
    return `message type ${out.type} must be ${HDR} bytes, got ${len}`;
  }
  return null;
}

export function newMsg(): Msg {
  return { type: 0, flags: 0, credits: 0, imm: 0, token: 0, a: 0, b: 0, addr: 0, rkey: 0, id: 0 };
}
