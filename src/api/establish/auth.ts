/**
 * Authenticated peers: a shared key (per identity), checked by a
 * challenge–response with HMAC-SHA256 on both ways of establishing a
 * connection (sidechannel.ts, rdmacm.ts) before the server allocates
 * anything. No secret travels: each side proves it knows the key by a MAC
 * over fresh nonces of both sides (the server's used once) and the hellos
 * (endpoint, depths, limits), so a recorded exchange cannot be replayed and a
 * hello altered in transit fails its MAC. Mutual: the server proves it knows
 * the key too, and a client with a key refuses a server that does not.
 *
 * This module holds the settings (`setAuth`), the MAC primitives and the
 * table of outstanding RDMA CM challenges; the message layouts live with
 * their establisher (docs/wire-format.md).
 */
import { createHmac, randomBytes, timingSafeEqual } from "node:crypto";
import { RdmaError } from "../../errors.js";

/** A shared secret: a string (its UTF-8 bytes) or bytes, at least 16 bytes. */
export type AuthKey = string | Uint8Array;

/** A server's key for an identity, or undefined when the identity is unknown. */
export type AuthKeyLookup = (identity: string) => AuthKey | undefined;

/**
 * `RdmaBuilder.setAuth`'s argument.
 *
 * - `{ key }`: one shared key. A client names itself with `identity`
 *   (default `""`); a server with one key accepts every client that has it,
 *   whatever identity it names.
 * - `{ keys }` (servers only): a key per identity, as a record or a function.
 */
export type AuthOptions = { key: AuthKey; identity?: string; keys?: never } | { keys: Readonly<Record<string, AuthKey>> | AuthKeyLookup; key?: never; identity?: never };

/** Smallest key, in bytes. */
export const MIN_KEY_BYTES = 16;
/** Longest identity, in bytes of UTF-8 (it travels in RDMA CM private data). */
export const MAX_IDENTITY_BYTES = 32;

function keyBytes(k: unknown, what: string): Buffer {
  let b: Buffer;
  if (typeof k === "string") b = Buffer.from(k, "utf8");
  else if (k instanceof Uint8Array) b = Buffer.from(k); // a copy: later changes to the caller's array do not change the key
  else throw new RdmaError("INVALID_ARGUMENT", `${what} must be a string or a Uint8Array, got ${k === null ? "null" : typeof k}`);
  if (b.length < MIN_KEY_BYTES) throw new RdmaError("INVALID_ARGUMENT", `${what} must be at least ${MIN_KEY_BYTES} bytes, got ${b.length}: use a random secret (e.g. crypto.randomBytes(32))`);
  return b;
}

/** Checks an identity (UTF-8, at most MAX_IDENTITY_BYTES bytes); INVALID_ARGUMENT or, from the wire, PROTOCOL. */
export function checkIdentity(v: unknown, code: "INVALID_ARGUMENT" | "PROTOCOL" = "INVALID_ARGUMENT"): string {
  if (typeof v !== "string") throw new RdmaError(code, `identity must be a string, got ${v === null ? "null" : typeof v}`);
  const n = Buffer.byteLength(v, "utf8");
  if (n > MAX_IDENTITY_BYTES) throw new RdmaError(code, `identity must be at most ${MAX_IDENTITY_BYTES} bytes of UTF-8, got ${n}`);
  if (Buffer.from(v, "utf8").toString("utf8") !== v) throw new RdmaError(code, "identity is not valid Unicode text");
  return v;
}

/** The key for an identity, as the server resolved it. `known` false: a key nobody has (the MAC then fails like a wrong key's). */
export interface ResolvedKey {
  key: Buffer;
  known: boolean;
  /** Why the identity has no key (server-side diagnostics only, never sent). */
  why?: string;
}

/** @internal Validated `setAuth` settings. */
export class Auth {
  /** The identity a client names (servers: unused). */
  readonly identity: string;
  private readonly single: Buffer | null;
  private readonly table: Map<string, Buffer> | null;
  private readonly fn: AuthKeyLookup | null;
  /** Stands in for an unknown identity's key: the same work, a MAC nobody can match. */
  private readonly dummy = randomBytes(32);

  private constructor(identity: string, single: Buffer | null, table: Map<string, Buffer> | null, fn: AuthKeyLookup | null) {
    this.identity = identity;
    this.single = single;
    this.table = table;
    this.fn = fn;
  }

  static from(o: unknown): Auth {
    if (o === null || typeof o !== "object" || Array.isArray(o)) throw new RdmaError("INVALID_ARGUMENT", `setAuth takes { key, identity? } or { keys }, got ${o === null ? "null" : Array.isArray(o) ? "an array" : typeof o}`);
    const r = o as { key?: unknown; keys?: unknown; identity?: unknown };
    for (const k of Object.keys(r)) if (k !== "key" && k !== "keys" && k !== "identity") throw new RdmaError("INVALID_ARGUMENT", `setAuth: unknown option ${JSON.stringify(k)} (expected key, identity or keys)`);
    if (r.key !== undefined && r.keys !== undefined) throw new RdmaError("INVALID_ARGUMENT", "setAuth takes either key (one shared key) or keys (a key per identity, servers only), not both");
    if (r.key !== undefined) {
      const identity = r.identity === undefined ? "" : checkIdentity(r.identity);
      return new Auth(identity, keyBytes(r.key, "key"), null, null);
    }
    if (r.keys === undefined) throw new RdmaError("INVALID_ARGUMENT", "setAuth needs key (a shared secret of at least 16 bytes) or keys (a key per identity)");
    if (r.identity !== undefined) throw new RdmaError("INVALID_ARGUMENT", "setAuth: identity goes with key (a client names itself); keys is for servers");
    if (typeof r.keys === "function") return new Auth("", null, null, r.keys as AuthKeyLookup);
    if (r.keys === null || typeof r.keys !== "object" || Array.isArray(r.keys)) throw new RdmaError("INVALID_ARGUMENT", "keys must be a record { identity: key } or a function (identity) => key | undefined");
    const table = new Map<string, Buffer>();
    for (const [id, k] of Object.entries(r.keys)) table.set(checkIdentity(id), keyBytes(k, `the key of identity ${JSON.stringify(id)}`));
    if (table.size === 0) throw new RdmaError("INVALID_ARGUMENT", "keys names no identity");
    return new Auth("", null, table, null);
  }

  /** Whether this side can dial (a client authenticates with one key). */
  get canDial(): boolean {
    return this.single !== null;
  }

  /** The client's key. */
  clientKey(): Buffer {
    if (!this.single) throw new RdmaError("INVALID_ARGUMENT", "a client authenticates with one key: setAuth({ key, identity }) (keys is for servers)");
    return this.single;
  }

  /** The server's key for `identity`; an unknown identity gets a key nobody has. */
  resolve(identity: string): ResolvedKey {
    if (this.single) return { key: this.single, known: true };
    if (this.table) {
      const k = this.table.get(identity);
      return k ? { key: k, known: true } : { key: this.dummy, known: false, why: "unknown identity" };
    }
    try {
      const k = this.fn!(identity);
      if (k === undefined) return { key: this.dummy, known: false, why: "unknown identity" };
      return { key: keyBytes(k, "the key lookup's result"), known: true };
    } catch (e) {
      return { key: this.dummy, known: false, why: `the key lookup failed: ${(e as Error)?.message ?? String(e)}` };
    }
  }
}

/**
 * HMAC-SHA256 over a label and length-prefixed parts (u32 big-endian length,
 * then the bytes; strings as UTF-8), so no two different inputs share an
 * encoding.
 */
export function authMac(key: Uint8Array, label: string, ...parts: (Uint8Array | string | number)[]): Buffer {
  const h = createHmac("sha256", key);
  h.update(`async-rdma auth v1 ${label}\0`, "utf8");
  for (const p of parts) {
    const b = typeof p === "string" ? Buffer.from(p, "utf8") : typeof p === "number" ? u32(p) : p;
    h.update(u32(b.length));
    h.update(b);
  }
  return h.digest();
}

function u32(n: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32BE(n >>> 0);
  return b;
}

/** Constant-time comparison (lengths are public). */
export function macEqual(a: Uint8Array, b: Uint8Array): boolean {
  return a.length === b.length && timingSafeEqual(a, b);
}

export function nonce(bytes: number): Buffer {
  return randomBytes(bytes);
}

/** Base64 field of a JSON message with exactly `bytes` bytes; PROTOCOL otherwise. */
export function b64Field(v: unknown, name: string, bytes: number): Buffer {
  if (typeof v !== "string" || v.length > 4 * bytes) throw new RdmaError("PROTOCOL", `handshake field ${name} is invalid`);
  const b = Buffer.from(v, "base64");
  if (b.length !== bytes || b.toString("base64") !== v) throw new RdmaError("PROTOCOL", `handshake field ${name} is invalid`);
  return b;
}

/**
 * Outstanding RDMA CM challenges: a server nonce per REQ that asked for one,
 * used at most once (take() deletes it), expiring after `ttlMs`, at most
 * `max` at once (issue() returns null past that: the server is busy).
 */
export class ChallengeTable {
  private readonly m = new Map<string, { identity: string; expires: number }>();

  constructor(
    private readonly max: number,
    private readonly ttlMs: number,
    private readonly bytes: number,
    private readonly now: () => number = () => performance.now(),
  ) {}

  private purge(): void {
    const t = this.now();
    // insertion order is expiry order (one ttl for all)
    for (const [k, v] of this.m) {
      if (v.expires > t) break;
      this.m.delete(k);
    }
  }

  get size(): number {
    this.purge();
    return this.m.size;
  }

  /** A fresh nonce bound to `identity`, or null when `max` are outstanding. */
  issue(identity: string): Buffer | null {
    this.purge();
    if (this.m.size >= this.max) return null;
    let n: Buffer;
    do n = nonce(this.bytes);
    while (this.m.has(n.toString("hex")));
    this.m.set(n.toString("hex"), { identity, expires: this.now() + this.ttlMs });
    return n;
  }

  /** The identity the nonce was issued to, without using it up; null when unknown, expired or already used. */
  peek(n: Uint8Array): string | null {
    this.purge();
    return this.m.get(Buffer.from(n.buffer, n.byteOffset, n.byteLength).toString("hex"))?.identity ?? null;
  }

  /** The identity the nonce was issued to, once; null when unknown, expired or already used. */
  take(n: Uint8Array): string | null {
    this.purge();
    const k = Buffer.from(n.buffer, n.byteOffset, n.byteLength).toString("hex");
    const e = this.m.get(k);
    if (!e) return null;
    this.m.delete(k);
    return e.identity;
  }

  clear(): void {
    this.m.clear();
  }
}

/** What a client is told when it failed to authenticate: the same for a wrong key and an unknown identity. */
export const AUTH_FAILED_WIRE = "authentication failed: wrong key or unknown identity";

/** The client-facing text of a refusal whose server-side record says more (who, which identity, why). */
const wireText = new WeakMap<RdmaError, string>();

/** An AUTH_FAILED refusal: `record` for the server's listener.rejected, `wire` for the client. */
export function authRefusal(record: string, wire: string): RdmaError {
  const e = new RdmaError("AUTH_FAILED", record);
  wireText.set(e, wire);
  return e;
}

/** What the client is told about a refusal: an authentication failure never says more than AUTH_FAILED_WIRE unless built with authRefusal. */
export function wireMessage(e: RdmaError): string {
  return wireText.get(e) ?? (e.code === "AUTH_FAILED" ? AUTH_FAILED_WIRE : e.message);
}

/** The peer of a connection (`Rdma.peer`). */
export interface PeerInfo {
  /** The peer's IP address (side channel: the TCP peer; RDMA CM: the CM's peer). */
  readonly address: string;
  readonly port: number;
  /** The identity the client authenticated with (on the client: the one it used); null when the connection is not authenticated. */
  readonly identity: string | null;
}
