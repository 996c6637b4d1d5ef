/**
 * The RPC frame codec: the one place that knows a frame's bytes. Several
 * frames travel in one message; each is (big-endian)
 *   0 u8 magic 0x52   1 u8 kind (1 CALL, 2 OK, 3 ERROR, 4 CANCEL)
 *   2 u16 method length   4 u32 call id   8 u32 payload length
 *   12 method (UTF-8, CALL only)   then the payload.
 * A received message is decoded whole before any of its frames is acted
 * on: a malformed one is a PROTOCOL error naming what is wrong, and each
 * frame's payload is a copy (the message's buffer goes back at once).
 */
import { RdmaError } from "../index.js";

const MAGIC = 0x52;
export const CALL = 1;
export const OK = 2;
export const ERROR = 3;
export const CANCEL = 4;
/** Bytes of a frame's header, before the method name. */
export const HDR = 12;
/** The longest method name (UTF-8 bytes). */
export const MAX_METHOD = 1024;

/** One decoded frame. */
export interface Frame {
  kind: number;
  id: number;
  method: string;
  payload: Uint8Array;
}

export const enc = new TextEncoder();
export const dec = new TextDecoder("utf-8", { fatal: true });
export const EMPTY = new Uint8Array(0);

export function encodeFrame(kind: number, id: number, method: Uint8Array | null, payload: Uint8Array): Uint8Array {
  const m = method ?? EMPTY;
  const out = new Uint8Array(HDR + m.length + payload.length);
  writeFrame(out, 0, kind, id, m, payload);
  return out;
}

/** Writes a frame into `dst` at `off` (room checked by the caller); returns its length. */
export function writeFrame(dst: Uint8Array, off: number, kind: number, id: number, method: Uint8Array, payload: Uint8Array): number {
  const ml = method.length;
  const pl = payload.length;
  dst[off] = MAGIC;
  dst[off + 1] = kind;
  dst[off + 2] = ml >>> 8;
  dst[off + 3] = ml & 0xff;
  dst[off + 4] = id >>> 24;
  dst[off + 5] = (id >>> 16) & 0xff;
  dst[off + 6] = (id >>> 8) & 0xff;
  dst[off + 7] = id & 0xff;
  dst[off + 8] = pl >>> 24;
  dst[off + 9] = (pl >>> 16) & 0xff;
  dst[off + 10] = (pl >>> 8) & 0xff;
  dst[off + 11] = pl & 0xff;
  if (ml > 0) dst.set(method, off + HDR);
  if (pl > 0) dst.set(payload, off + HDR + ml);
  return HDR + ml + pl;
}

/** Big-endian u32 at `o` (read byte by byte: no DataView per message). */
function u32(b: Uint8Array, o: number): number {
  return b[o]! * 0x1000000 + ((b[o + 1]! << 16) | (b[o + 2]! << 8) | b[o + 3]!);
}

/**
 * Method names decoded lately (a copy of their bytes and the string): a
 * server mostly sees the same few names, and decoding UTF-8 costs more than
 * comparing a few bytes. Only names of at most CACHED_METHOD bytes, at most
 * METHOD_CACHE of them, replaced in turn: however many names a peer sends,
 * the cache holds at most 1 KiB of bytes, and a miss costs at most 1,024
 * byte comparisons before the decode (longer names are decoded at once).
 */
const METHOD_CACHE = 16;
const CACHED_METHOD = 64;
const cachedBytes: Uint8Array[] = [];
const cachedNames: string[] = [];
let cacheNext = 0;

/** The method name in `buf[start, start + len)` (UTF-8); throws PROTOCOL if it is not UTF-8. */
function methodAt(buf: Uint8Array, start: number, len: number): string {
  if (len > CACHED_METHOD) return decodeMethod(buf.subarray(start, start + len));
  for (let k = 0; k < cachedBytes.length; k++) {
    const c = cachedBytes[k]!;
    if (c.length !== len) continue;
    let i = 0;
    while (i < len && c[i] === buf[start + i]) i++;
    if (i === len) return cachedNames[k]!;
  }
  // A copy (decodeFrames made `buf` a plain Uint8Array, whose slice() copies): the message's memory is reused.
  const bytes = buf.slice(start, start + len);
  const name = decodeMethod(bytes);
  cachedBytes[cacheNext] = bytes;
  cachedNames[cacheNext] = name;
  cacheNext = (cacheNext + 1) % METHOD_CACHE;
  return name;
}

function decodeMethod(bytes: Uint8Array): string {
  try {
    return dec.decode(bytes);
  } catch {
    throw new RdmaError("PROTOCOL", "rpc: method name is not UTF-8");
  }
}

/** Every frame of a message; throws PROTOCOL naming what is wrong. */
export function decodeFrames(bytes: Uint8Array): Frame[] {
  // A Buffer's slice() is a view: read a plain Uint8Array over the same bytes, whose slice() copies.
  const buf = Object.getPrototypeOf(bytes) === Uint8Array.prototype ? bytes : new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out: Frame[] = [];
  let off = 0;
  while (off < buf.length) {
    if (buf.length - off < HDR) throw new RdmaError("PROTOCOL", `rpc: truncated frame header (${buf.length - off} bytes)`);
    if (buf[off] !== MAGIC) throw new RdmaError("PROTOCOL", "rpc: bad frame magic (is the peer an RpcClient/RpcServer?)");
    const kind = buf[off + 1]!;
    const mlen = (buf[off + 2]! << 8) | buf[off + 3]!;
    const id = u32(buf, off + 4);
    const plen = u32(buf, off + 8);
    if (kind < CALL || kind > CANCEL) throw new RdmaError("PROTOCOL", `rpc: unknown frame kind ${kind}`);
    if (kind !== CALL && mlen !== 0) throw new RdmaError("PROTOCOL", "rpc: method name on a frame that is not a call");
    if (mlen > MAX_METHOD) throw new RdmaError("PROTOCOL", `rpc: method name of ${mlen} bytes`);
    const end = off + HDR + mlen + plen;
    if (end > buf.length) throw new RdmaError("PROTOCOL", "rpc: frame longer than its message");
    const method = mlen > 0 ? methodAt(buf, off + HDR, mlen) : "";
    // A copy: the message's buffer goes back to the connection at once.
    out.push({ kind, id, method, payload: buf.slice(off + HDR + mlen, end) });
    off = end;
  }
  return out;
}

/** The ids of the CALL frames in `b` (frames this side encoded, so well-formed): the calls of a message whose send failed. */
export function callIds(b: Uint8Array): number[] {
  const ids: number[] = [];
  const v = new DataView(b.buffer, b.byteOffset, b.byteLength);
  for (let off = 0; off + HDR <= b.length; off += HDR + v.getUint16(off + 2) + v.getUint32(off + 8)) {
    if (v.getUint8(off + 1) === CALL) ids.push(v.getUint32(off + 4));
  }
  return ids;
}
