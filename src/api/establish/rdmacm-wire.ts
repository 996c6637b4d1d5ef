/**
 * The RDMA CM wire: the bytes async-rdma puts in the CM's private data (REQ, REP, REJ) and the
 * MACs that authenticate them. Pure: encode, decode and check; no CM id, no I/O (both sides
 * of rdmacm.ts use it). Every decoder bounds what it reads and refuses malformed input with
 * PROTOCOL. The layout is docs/wire-format.md's and must not change byte for byte (compact
 * binary, big-endian, versioned):
 *
 *   hello  (20 bytes; CONNECT ≤ 56, ACCEPT ≤ 196)
 *     0 u32 magic "aRDM"   4 u8 protocol version   5 u8 kind (1 connect, 2 accept)
 *     6 u16 0              8 u32 psn (24 bits)     12 u32 recvDepth   16 u32 eagerMax
 *   reject (8 + n bytes, ≤ 148)
 *     0 u32 magic   4 u8 version   5 u8 kind 3   6 u8 code (1 refused, 2 protocol, 3 authentication, 4 challenge)   7 u8 n
 *     8 reason, n bytes of UTF-8 (code 4: the server's 8-byte challenge nonce)
 *
 * Authenticated (setAuth on both sides; docs/wire-format.md), two REQs:
 *
 *   auth request (REQ, 8 + n bytes)
 *     0 u32 magic   4 u8 version   5 u8 kind 4   6 u8 n (≤ 32)   7 u8 0   8 identity, n bytes of UTF-8
 *     → REJ code 4 with a fresh server nonce Ns (single use, expires after the connect timeout)
 *   auth connect (REQ, 52 bytes, on a new CM id)
 *     0..20 hello with kind 5   20 Ns (8)   28 client nonce Nc (8)
 *     36 MAC (16) = HMAC-SHA256(K, "cm connect", identity, bytes 0..36, client QPN), truncated
 *   accept (REP, 36 bytes): hello (kind 2) + 20 MAC (16) = HMAC-SHA256(K, "cm accept",
 *     identity, REQ bytes 0..36, REP bytes 0..20, server QPN, client QPN), truncated
 */
import { RdmaError } from "../../errors.js";
import { PROTOCOL_VERSION } from "./protocol.js";
import { MAX_IDENTITY_BYTES, authMac, checkIdentity } from "./auth.js";

export const MAGIC = 0x6152444d; // "aRDM"
export const KIND_CONNECT = 1;
export const KIND_ACCEPT = 2;
export const KIND_REJECT = 3;
export const KIND_AUTH_REQUEST = 4;
export const KIND_AUTH_CONNECT = 5;
export const HELLO_BYTES = 20;
export const REJECT_REFUSED = 1;
export const REJECT_PROTOCOL = 2;
export const REJECT_AUTH = 3;
export const REJECT_CHALLENGE = 4;
export const MAX_REASON = 140;
/** Bytes of the server's and the client's nonce. */
export const CM_NONCE_BYTES = 8;
/** Bytes of a (truncated HMAC-SHA256) MAC in private data. */
export const CM_MAC_BYTES = 16;
/** The signed part of an auth connect: hello, Ns, Nc. */
export const AUTH_SIGNED = HELLO_BYTES + 2 * CM_NONCE_BYTES;
export const AUTH_CONNECT_BYTES = AUTH_SIGNED + CM_MAC_BYTES;

export interface CmHello {
  psn: number;
  recvDepth: number;
  eagerMax: number;
}

export type HelloKind = typeof KIND_CONNECT | typeof KIND_ACCEPT | typeof KIND_AUTH_CONNECT;

export function encodeHello(kind: HelloKind, h: CmHello, version = PROTOCOL_VERSION): Uint8Array {
  const b = new Uint8Array(HELLO_BYTES);
  const v = new DataView(b.buffer);
  v.setUint32(0, MAGIC);
  v.setUint8(4, version);
  v.setUint8(5, kind);
  v.setUint32(8, h.psn & 0xffffff);
  v.setUint32(12, h.recvDepth);
  v.setUint32(16, h.eagerMax);
  return b;
}

/** Validates a peer's hello; PROTOCOL errors name what is wrong. Trailing bytes (IB pads private data) are ignored. */
export function decodeHello(pd: Uint8Array | null, kind: HelloKind): CmHello {
  if (!pd || pd.length < 6) throw new RdmaError("PROTOCOL", "the peer's RDMA CM private data is missing: is the other side an async-rdma endpoint?");
  const v = new DataView(pd.buffer, pd.byteOffset, pd.byteLength);
  if (v.getUint32(0) !== MAGIC) throw new RdmaError("PROTOCOL", "the peer's RDMA CM private data is not an async-rdma hello: is the other side an async-rdma endpoint?");
  const ver = v.getUint8(4);
  if (ver !== PROTOCOL_VERSION) throw new RdmaError("PROTOCOL", `protocol version mismatch: the peer speaks ${ver}, this side ${PROTOCOL_VERSION}; upgrade the older side`);
  if (v.getUint8(5) !== kind) throw new RdmaError("PROTOCOL", `unexpected RDMA CM hello kind ${v.getUint8(5)} (expected ${kind})`);
  if (pd.length < HELLO_BYTES) throw new RdmaError("PROTOCOL", `the peer's RDMA CM hello is truncated (${pd.length} bytes)`);
  const psn = v.getUint32(8);
  const recvDepth = v.getUint32(12);
  const eagerMax = v.getUint32(16);
  if (psn > 0xffffff) throw new RdmaError("PROTOCOL", "handshake field psn is invalid");
  if (recvDepth < 8 || recvDepth > 65536) throw new RdmaError("PROTOCOL", "handshake field recvDepth is invalid");
  if (eagerMax > 1 << 20) throw new RdmaError("PROTOCOL", "handshake field eagerMax is invalid");
  return { psn, recvDepth, eagerMax };
}

export function encodeReject(code: typeof REJECT_REFUSED | typeof REJECT_PROTOCOL | typeof REJECT_AUTH, reason: string): Uint8Array {
  let r = new TextEncoder().encode(reason);
  if (r.length > MAX_REASON) {
    // cut on a character boundary
    let n = MAX_REASON;
    while (n > 0 && (r[n]! & 0xc0) === 0x80) n--;
    r = r.subarray(0, n);
  }
  const b = new Uint8Array(8 + r.length);
  const v = new DataView(b.buffer);
  v.setUint32(0, MAGIC);
  v.setUint8(4, PROTOCOL_VERSION);
  v.setUint8(5, KIND_REJECT);
  v.setUint8(6, code);
  v.setUint8(7, r.length);
  b.set(r, 8);
  return b;
}

/** Our reject's reason, or null when the REJ did not come from an async-rdma peer. */
export function decodeReject(pd: Uint8Array | null): { code: number; reason: string } | null {
  if (!pd || pd.length < 8) return null;
  const v = new DataView(pd.buffer, pd.byteOffset, pd.byteLength);
  if (v.getUint32(0) !== MAGIC || v.getUint8(5) !== KIND_REJECT) return null;
  const n = Math.min(v.getUint8(7), pd.length - 8, MAX_REASON);
  return { code: v.getUint8(6), reason: new TextDecoder("utf-8", { fatal: false }).decode(pd.subarray(8, 8 + n)) };
}

/** The kind of an async-rdma message of our version in private data, or 0. */
export function kindOf(pd: Uint8Array | null): number {
  if (!pd || pd.length < 6) return 0;
  const v = new DataView(pd.buffer, pd.byteOffset, pd.byteLength);
  return v.getUint32(0) === MAGIC && v.getUint8(4) === PROTOCOL_VERSION ? v.getUint8(5) : 0;
}

/** REQ asking for a challenge: the client's identity. */
export function encodeAuthRequest(identity: string): Uint8Array {
  const id = new TextEncoder().encode(checkIdentity(identity));
  const b = new Uint8Array(8 + id.length);
  const v = new DataView(b.buffer);
  v.setUint32(0, MAGIC);
  v.setUint8(4, PROTOCOL_VERSION);
  v.setUint8(5, KIND_AUTH_REQUEST);
  v.setUint8(6, id.length);
  b.set(id, 8);
  return b;
}

export function decodeAuthRequest(pd: Uint8Array): string {
  const n = pd.length >= 8 ? pd[6]! : -1;
  if (n < 0 || n > MAX_IDENTITY_BYTES || pd.length < 8 + n) throw new RdmaError("PROTOCOL", "the peer's RDMA CM authentication request is malformed");
  let identity: string;
  try {
    identity = new TextDecoder("utf-8", { fatal: true }).decode(pd.subarray(8, 8 + n));
  } catch {
    throw new RdmaError("PROTOCOL", "the identity in the peer's RDMA CM authentication request is not UTF-8");
  }
  return checkIdentity(identity, "PROTOCOL");
}

/** REJ carrying a challenge (the server's nonce). */
export function encodeChallenge(ns: Uint8Array): Uint8Array {
  const b = new Uint8Array(8 + CM_NONCE_BYTES);
  const v = new DataView(b.buffer);
  v.setUint32(0, MAGIC);
  v.setUint8(4, PROTOCOL_VERSION);
  v.setUint8(5, KIND_REJECT);
  v.setUint8(6, REJECT_CHALLENGE);
  v.setUint8(7, CM_NONCE_BYTES);
  b.set(ns, 8);
  return b;
}

/** The server's nonce when the REJ is our challenge, else null. */
export function decodeChallenge(pd: Uint8Array | null): Uint8Array | null {
  if (!pd || pd.length < 8 + CM_NONCE_BYTES || kindOf(pd) !== KIND_REJECT || pd[6] !== REJECT_CHALLENGE || pd[7] !== CM_NONCE_BYTES) return null;
  return pd.slice(8, 8 + CM_NONCE_BYTES);
}

/** The auth connect REQ: the hello (kind 5), both nonces, the MAC over them and the client's QP number. */
export function encodeAuthConnect(h: CmHello, ns: Uint8Array, nc: Uint8Array, key: Uint8Array, identity: string, clientQpn: number): Uint8Array {
  const b = new Uint8Array(AUTH_CONNECT_BYTES);
  b.set(encodeHello(KIND_AUTH_CONNECT, h), 0);
  b.set(ns, HELLO_BYTES);
  b.set(nc, HELLO_BYTES + CM_NONCE_BYTES);
  b.set(connectMac(key, identity, b.subarray(0, AUTH_SIGNED), clientQpn), AUTH_SIGNED);
  return b;
}

/** The parts of an auth connect REQ (structure only: the server checks the nonce, then the MAC, then the hello's fields). */
export function decodeAuthConnect(pd: Uint8Array): { ns: Uint8Array; signed: Uint8Array; mac: Uint8Array } {
  if (pd.length < AUTH_CONNECT_BYTES) throw new RdmaError("PROTOCOL", `the peer's RDMA CM authenticated hello is truncated (${pd.length} bytes)`);
  return { ns: pd.slice(HELLO_BYTES, HELLO_BYTES + CM_NONCE_BYTES), signed: pd.slice(0, AUTH_SIGNED), mac: pd.slice(AUTH_SIGNED, AUTH_CONNECT_BYTES) };
}

export function connectMac(key: Uint8Array, identity: string, signed: Uint8Array, clientQpn: number): Uint8Array {
  return authMac(key, "cm connect", identity, signed, clientQpn).subarray(0, CM_MAC_BYTES);
}

export function acceptMac(key: Uint8Array, identity: string, signed: Uint8Array, rep: Uint8Array, serverQpn: number, clientQpn: number): Uint8Array {
  return authMac(key, "cm accept", identity, signed, rep.subarray(0, HELLO_BYTES), serverQpn, clientQpn).subarray(0, CM_MAC_BYTES);
}

/** The reject code that tells the peer an error of this kind. */
export function rejectCode(e: RdmaError): typeof REJECT_REFUSED | typeof REJECT_PROTOCOL | typeof REJECT_AUTH {
  return e.code === "PROTOCOL" ? REJECT_PROTOCOL : e.code === "AUTH_FAILED" ? REJECT_AUTH : REJECT_REFUSED;
}
