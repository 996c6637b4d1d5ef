/**
 * The agent's control protocol, version 4: every SEND between two async-rdma
 * endpoints starts with this 24-byte header (docs/wire-format.md).
 *
 * | off | size | field   | meaning                                                      |
 * |-----|------|---------|--------------------------------------------------------------|
 * | 0   | 1    | magic   | 0xA7                                                         |
 * | 1   | 1    | version | 4                                                            |
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
 *
 * Credits (credits.ts): each side posts min(its receive depth, 8) receives
 * before it connects, so its peer starts with that many credits, and may
 * grow its ring up to its depth, granting the new receives as credits.
 */

export const MAGIC = 0xa7;
export const VERSION = 4;
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
  /** A shared region opened: id, length, access flags (imm), address and rkey. */
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

export function encodeMsg(dst: Uint8Array, m: Msg, off = 0): number {
  // Byte writes, no DataView: nothing is allocated per message (issue 21 point 1).
  dst[off] = MAGIC;
  dst[off + 1] = VERSION;
  dst[off + 2] = m.type;
  dst[off + 3] = m.flags;
  put32(dst, off + 4, m.credits);
  put32(dst, off + 8, m.imm);
  put32(dst, off + 12, m.token);
  put32(dst, off + 16, m.a);
  put32(dst, off + 20, m.b);
  if (WITH_DESC.has(m.type)) {
    put32(dst, off + 24, Math.floor(m.addr / 0x100000000));
    put32(dst, off + 28, m.addr);
    put32(dst, off + 32, m.rkey);
    put32(dst, off + 36, m.id);
    return HDR + DESC;
  }
  if (WITH_HASH.has(m.type)) {
    if (m.hash?.length !== DESC) throw new RangeError(`message type ${m.type} needs a ${DESC}-byte hash`);
    dst.set(m.hash, off + HDR);
    return HDR + DESC;
  }
  return HDR;
}

/** Big-endian 32-bit store (the value taken modulo 2^32, as DataView.setUint32 does). */
export function put32(d: Uint8Array, o: number, v: number): void {
  v >>>= 0;
  d[o] = v >>> 24;
  d[o + 1] = v >>> 16;
  d[o + 2] = v >>> 8;
  d[o + 3] = v;
}

/** Big-endian 32-bit load. */
function get32(s: Uint8Array, o: number): number {
  return ((s[o]! << 24) | (s[o + 1]! << 16) | (s[o + 2]! << 8) | s[o + 3]!) >>> 0;
}

export function decodeMsg(src: Uint8Array, len: number, out: Msg, off = 0): string | null {
  if (len < HDR) return `control message of ${len} bytes is shorter than its ${HDR}-byte header`;
  if (off + len > src.length) throw new RangeError(`decodeMsg: ${len} bytes at ${off} are outside a ${src.length}-byte buffer`);
  if (src[off] !== MAGIC) return `bad magic 0x${src[off]!.toString(16)}`;
  if (src[off + 1] !== VERSION) return `control protocol version ${src[off + 1]} not supported (this side speaks ${VERSION})`;
  out.type = src[off + 2]!;
  out.flags = src[off + 3]!;
  out.credits = get32(src, off + 4);
  out.imm = get32(src, off + 8);
  out.token = get32(src, off + 12);
  out.a = get32(src, off + 16);
  out.b = get32(src, off + 20);
  out.addr = 0;
  out.rkey = 0;
  out.id = 0;
  out.hash = undefined;
  if (out.type < MsgType.DATA || out.type > LAST_TYPE) return `unknown control message type ${out.type}`;
  if (out.flags & ~1) return `unknown flags 0x${out.flags.toString(16)}`;
  if (out.type !== MsgType.DATA && (out.flags & 1)) return "immediate flag on a control message";
  if (WITH_DESC.has(out.type)) {
    if (len !== HDR + DESC) return `message type ${out.type} must be ${HDR + DESC} bytes, got ${len}`;
    const hi = get32(src, off + 24);
    if (hi >= 0x200000) return "address beyond 2^53";
    out.addr = hi * 0x100000000 + get32(src, off + 28);
    out.rkey = get32(src, off + 32);
    out.id = get32(src, off + 36);
  } else if (WITH_HASH.has(out.type)) {
    if (len !== HDR + DESC) return `message type ${out.type} must be ${HDR + DESC} bytes, got ${len}`;
    out.hash = src.slice(off + HDR, off + HDR + DESC);
  } else if (out.type !== MsgType.DATA && len !== HDR) {
    return `message type ${out.type} must be ${HDR} bytes, got ${len}`;
  }
  return null;
}

export function newMsg(): Msg {
  return { type: 0, flags: 0, credits: 0, imm: 0, token: 0, a: 0, b: 0, addr: 0, rkey: 0, id: 0 };
}

// ------------------------------------------------------------ typed messages
//
// Each control message kind with its fields named. `toWire` and `fromWire`
// are the one place that knows which generic header slot (a, b, imm, addr,
// rkey, id) carries which field; no other code reads a generic slot of a
// control message.

/** Access flags (verbs Access bits) a grant, lend or share gives. */
type AccessFlags = number;

export type CtrlMessage =
  | { type: typeof MsgType.RNDV; token: number; length: number; addr: number; rkey: number; imm: number | undefined }
  | { type: typeof MsgType.RNDV_DONE; token: number; status: number }
  | { type: typeof MsgType.RNDV_CANCEL; token: number }
  | { type: typeof MsgType.CREDIT }
  | { type: typeof MsgType.PING; token: number }
  | { type: typeof MsgType.PONG; token: number }
  | { type: typeof MsgType.CLOSE }
  | { type: typeof MsgType.MR_REQUEST; token: number; size: number; leaseMs: number; access: AccessFlags }
  | { type: typeof MsgType.MR_GRANT; token: number; id: number; size: number; leaseMs: number; addr: number; rkey: number; access: AccessFlags }
  /** `value`: the bytes in use (QUOTA) or the owner's maximum lease (LEASE_TOO_LONG); `regions`: regions in use (QUOTA). */
  | { type: typeof MsgType.MR_DENY; token: number; reason: number; value: number; regions: number }
  | { type: typeof MsgType.MR_RELEASE; token: number }
  | { type: typeof MsgType.MR_LEND; token: number; size: number; leaseMs: number; addr: number; rkey: number; access: AccessFlags }
  | { type: typeof MsgType.MR_RETURN; token: number }
  | { type: typeof MsgType.MR_GIVE_BACK; token: number; lent: boolean }
  | { type: typeof MsgType.MR_OPEN; token: number; hash: Uint8Array }
  | { type: typeof MsgType.MR_SHARED; token: number; id: number; size: number; access: AccessFlags; addr: number; rkey: number }
  | { type: typeof MsgType.MR_REVOKED; token: number }
  | { type: typeof MsgType.MR_RENEW; token: number; leaseMs: number; lent: boolean }
  | { type: typeof MsgType.MR_RENEWED; token: number; status: number; leaseMs: number }
  | { type: typeof MsgType.LIMITS; maxLeaseMs: number; maxMessageSize: number; quotaBytes: number; maxRegions: number };

/** The generic header form of a typed control message (what encodeMsg writes). */
export function toWire(c: CtrlMessage): Msg {
  const m = newMsg();
  m.type = c.type;
  switch (c.type) {
    case MsgType.RNDV:
      m.token = c.token;
      m.a = c.length;
      m.addr = c.addr;
      m.rkey = c.rkey;
      m.b = c.imm === undefined ? 0 : 1;
      m.imm = c.imm ?? 0;
      break;
    case MsgType.RNDV_DONE:
    case MsgType.MR_RENEWED:
      m.token = c.token;
      m.a = c.status;
      if (c.type === MsgType.MR_RENEWED) m.b = c.leaseMs;
      break;
    case MsgType.CREDIT:
    case MsgType.CLOSE:
      break;
    case MsgType.MR_REQUEST:
      m.token = c.token;
      m.a = c.size;
      m.b = c.leaseMs;
      m.imm = c.access;
      break;
    case MsgType.MR_GRANT:
    case MsgType.MR_LEND:
      m.token = c.token;
      if (c.type === MsgType.MR_GRANT) m.id = c.id;
      m.a = c.size;
      m.b = c.leaseMs;
      m.addr = c.addr;
      m.rkey = c.rkey;
      m.imm = c.access;
      break;
    case MsgType.MR_DENY:
      m.token = c.token;
      m.a = c.reason;
      m.b = c.value;
      m.imm = c.regions;
      break;
    case MsgType.MR_GIVE_BACK:
    case MsgType.MR_RENEW:
      m.token = c.token;
      m.a = c.lent ? 1 : 0;
      if (c.type === MsgType.MR_RENEW) m.b = c.leaseMs;
      break;
    case MsgType.MR_OPEN:
      m.token = c.token;
      m.hash = c.hash;
      break;
    case MsgType.MR_SHARED:
      m.token = c.token;
      m.id = c.id;
      m.a = c.size;
      m.imm = c.access;
      m.addr = c.addr;
      m.rkey = c.rkey;
      break;
    case MsgType.LIMITS:
      m.a = c.maxLeaseMs;
      m.b = c.maxMessageSize;
      m.addr = c.quotaBytes;
      m.rkey = c.maxRegions;
      break;
    default:
      // RNDV_CANCEL, PING, PONG, MR_RELEASE, MR_RETURN, MR_REVOKED: a token only
      m.token = c.token;
  }
  return m;
}

/** The typed form of a decoded control message (decodeMsg checked it; DATA is not one). */
export function fromWire(m: Msg): CtrlMessage {
  const token = m.token;
  switch (m.type) {
    case MsgType.RNDV:
      return { type: MsgType.RNDV, token, length: m.a, addr: m.addr, rkey: m.rkey, imm: m.b === 1 ? m.imm : undefined };
    case MsgType.RNDV_DONE:
      return { type: MsgType.RNDV_DONE, token, status: m.a };
    case MsgType.MR_RENEWED:
      return { type: MsgType.MR_RENEWED, token, status: m.a, leaseMs: m.b };
    case MsgType.CREDIT:
      return CREDIT;
    case MsgType.CLOSE:
      return { type: MsgType.CLOSE };
    case MsgType.MR_REQUEST:
      return { type: MsgType.MR_REQUEST, token, size: m.a, leaseMs: m.b, access: m.imm };
    case MsgType.MR_GRANT:
      return { type: MsgType.MR_GRANT, token, id: m.id, size: m.a, leaseMs: m.b, addr: m.addr, rkey: m.rkey, access: m.imm };
    case MsgType.MR_LEND:
      return { type: MsgType.MR_LEND, token, size: m.a, leaseMs: m.b, addr: m.addr, rkey: m.rkey, access: m.imm };
    case MsgType.MR_DENY:
      return { type: MsgType.MR_DENY, token, reason: m.a, value: m.b, regions: m.imm };
    case MsgType.MR_GIVE_BACK:
      return { type: MsgType.MR_GIVE_BACK, token, lent: m.a === 1 };
    case MsgType.MR_RENEW:
      return { type: MsgType.MR_RENEW, token, leaseMs: m.b, lent: m.a === 1 };
    case MsgType.MR_OPEN:
      return { type: MsgType.MR_OPEN, token, hash: m.hash! };
    case MsgType.MR_SHARED:
      return { type: MsgType.MR_SHARED, token, id: m.id, size: m.a, access: m.imm, addr: m.addr, rkey: m.rkey };
    case MsgType.LIMITS:
      return { type: MsgType.LIMITS, maxLeaseMs: m.a, maxMessageSize: m.b, quotaBytes: m.addr, maxRegions: m.rkey };
    case MsgType.RNDV_CANCEL:
    case MsgType.PING:
    case MsgType.PONG:
    case MsgType.MR_RELEASE:
    case MsgType.MR_RETURN:
    case MsgType.MR_REVOKED:
      return { type: m.type, token };
    default:
      throw new RangeError(`fromWire: message type ${m.type} is not a control message`);
  }
}

const CREDIT: CtrlMessage = Object.freeze({ type: MsgType.CREDIT });

/** DATA: the payload length (header slot `a`). */
export function dataLength(m: Msg): number {
  return m.a;
}

/** DATA: the user's immediate, when flagged. */
export function dataImm(m: Msg): number | undefined {
  return m.flags & 1 ? m.imm : undefined;
}

/** Encodes the DATA header for a `length`-byte payload (credits are filled in when posted). */
export function encodeData(dst: Uint8Array, length: number, imm: number | undefined, off = 0): number {
  dst[off] = MAGIC;
  dst[off + 1] = VERSION;
  dst[off + 2] = MsgType.DATA;
  dst[off + 3] = imm === undefined ? 0 : 1;
  put32(dst, off + 4, 0);
  put32(dst, off + 8, imm ?? 0);
  put32(dst, off + 12, 0);
  put32(dst, off + 16, length);
  put32(dst, off + 20, 0);
  return HDR;
}

const views = new WeakMap<ArrayBuffer, Uint8Array>();

/**
 * A Uint8Array over all of `buffer`, made once per ArrayBuffer (header and
 * receive buffers are slices of a few slabs): the message path reads and
 * writes headers without a view per message. A detached buffer's view is
 * empty: made anew, so the constructor throws as it did.
 */
export function bytesOf(buffer: ArrayBuffer): Uint8Array {
  let v = views.get(buffer);
  if (v === undefined || v.length === 0) {
    v = new Uint8Array(buffer);
    views.set(buffer, v);
  }
  return v;
}
