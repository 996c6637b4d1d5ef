/**
 * Shared regions: memory an owner exposes by name to many peers, keeping full
 * local access to it.
 *
 * A share is exactly the shared bytes with exactly the granted rights: for
 * every protection domain that opens it, one registration over those bytes
 * with those access flags (connections have a PD each, so a peer's rkey works
 * on its own connection only). The registration lives while one of that PD's
 * connections has the share open; revoking the share deregisters every one
 * (any later access by any peer fails with a remote access error, and the
 * owner's memory is never touched by a late operation) and tells every
 * opener.
 *
 * Revocation is orderly: revoke() refuses new opens at once and tells every
 * opener first; a PD's registration goes when its openers acknowledged
 * (their agent marked the region revoked, so every operation they posted on
 * it before is ahead of the acknowledgement on the same RC connection and
 * has executed), when their connection ends, or after a bounded wait. An
 * opener therefore learns of it before the memory goes: its later operations
 * fail locally with REMOTE_ACCESS and its connection lives. Disposing the
 * shared LocalMr and closing the listener or connection that owns the table
 * deregister at once (revokeNow), then tell the openers.
 */
import { createHash } from "node:crypto";
import { RdmaError } from "../errors.js";
import { Access, type MemoryRegion, type ProtectionDomain } from "../transport/types.js";
import type { LocalMr } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";

/** What a share lets its openers do. */
export type ShareAccess = "read" | "write" | "atomic";

export function accessFlags(a: ShareAccess): number {
  switch (a) {
    case "read":
      return Access.REMOTE_READ;
    case "write":
      return Access.REMOTE_READ | Access.REMOTE_WRITE;
    case "atomic":
      return Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC;
  }
}

export function checkAccess(v: unknown, what: string): ShareAccess {
  if (v === "read" || v === "write" || v === "atomic") return v;
  throw new RdmaError("INVALID_ARGUMENT", `${what}: access must be "read", "write" or "atomic", got ${typeof v === "string" ? JSON.stringify(v) : typeof v}`);
}

const MAX_NAME_BYTES = 256;

/** The name as it travels: the first 16 bytes of its SHA-256, hex (the table's key). */
export function nameKey(name: unknown): { key: string; hash: Uint8Array } {
  if (typeof name !== "string" || name.length === 0) throw new RdmaError("INVALID_ARGUMENT", "a shared region's name must be a non-empty string");
  const bytes = Buffer.from(name, "utf8");
  if (bytes.length > MAX_NAME_BYTES) throw new RdmaError("INVALID_ARGUMENT", `a shared region's name is at most ${MAX_NAME_BYTES} bytes of UTF-8 (got ${bytes.length})`);
  const hash = new Uint8Array(createHash("sha256").update(bytes).digest().subarray(0, 16));
  return { key: Buffer.from(hash).toString("hex"), hash };
}

export function hashKey(hash: Uint8Array): string {
  return Buffer.from(hash).toString("hex");
}

/** @internal */
/** An opener of a share: told when it is revoked. */
export interface ShareOpener {
  /** The share is being revoked: tell the peer (its open `id`); the open stays until the peer acknowledges (close) or `dropped`. */
  revoked(share: Share, id: number): void;
  /** The open is gone (the share's registrations were removed): forget it. */
  dropped(share: Share, id: number): void;
}

/** How long an orderly revoke waits for openers to acknowledge before it deregisters anyway (ms). */
export const REVOKE_WAIT_MS = 1000;

interface PdRegistration {
  mr: MemoryRegion;
  opens: number;
}

/** @internal */
export class Share {
  private readonly regs = new Map<ProtectionDomain, PdRegistration>();
  private readonly opens = new Map<ShareOpener, Set<number>>();
  private ended = false;
  readonly flags: number;

  /** @internal */
  constructor(
    private readonly table: ShareTable,
    readonly key: string,
    readonly name: string,
    readonly lmr: LocalMr,
    readonly access: ShareAccess,
    /** Decides who may open it (the peer as the connection describes it); absent: everyone. */
    readonly allow: ((peer: unknown) => boolean) | null,
  ) {
    this.flags = accessFlags(access);
  }

  get revoked(): boolean {
    return this.ended;
  }

  get length(): number {
    return this.lmr.length;
  }

  /** Peers that have it open now. */
  get openCount(): number {
    let n = 0;
    for (const ids of this.opens.values()) n += ids.size;
    return n;
  }

  /** Registrations (one per protection domain with the share open). */
  get registrations(): number {
    return this.regs.size;
  }

  /**
   * Opens the share for a connection whose memory is in `pool`: the PD's
   * registration over exactly the shared bytes (made on first use).
   */
  open(pool: MrPool, opener: ShareOpener, id: number): MemoryRegion {
    if (this.ended) throw new RdmaError("NOT_FOUND", `shared region ${JSON.stringify(this.name)} was revoked`);
    this.lmr.mem.check("share");
    let r = this.regs.get(pool.pd);
    if (!r) {
      r = { mr: pool.grant(this.lmr.mem.alloc, this.lmr.start, this.lmr.length, this.flags), opens: 0 };
      this.regs.set(pool.pd, r);
    }
    r.opens++;
    let ids = this.opens.get(opener);
    if (!ids) this.opens.set(opener, (ids = new Set()));
    ids.add(id);
    return r.mr;
  }

  /** The peer closed its open (released, or its connection ended). */
  close(pd: ProtectionDomain, opener: ShareOpener, id: number): void {
    const ids = this.opens.get(opener);
    if (!ids?.delete(id)) return;
    if (ids.size === 0) this.opens.delete(opener);
    const r = this.regs.get(pd);
    if (r && --r.opens === 0) {
      this.regs.delete(pd);
      r.mr.deregister();
    }
    if (this.ended) this.settleIfDone();
  }

  private done: Promise<void> | null = null;
  private finish: (() => void) | null = null;
  private waitTimer: NodeJS.Timeout | null = null;
  /** Every opener was told (an orderly revoke is under way). */
  private told = false;

  private end(): Promise<void> {
    if (!this.done) {
      this.ended = true;
      this.table.forget(this);
      this.done = new Promise<void>((r) => (this.finish = r));
    }
    return this.done;
  }

  /**
   * Orderly revoke: new opens fail at once; every opener is told, and each
   * PD's registration is removed when its openers acknowledged (close) or
   * after `waitMs`. Resolves when no registration is left. Idempotent.
   */
  revoke(waitMs = REVOKE_WAIT_MS): Promise<void> {
    const done = this.end();
    if (this.told || this.finish === null) return done;
    if (waitMs <= 0 || this.opens.size === 0) {
      this.revokeNow();
      return done;
    }
    this.told = true;
    // Not unref'd: an owner awaiting revoke() must see it settle (it holds the process at most waitMs).
    this.waitTimer = setTimeout(() => this.revokeNow(), waitMs);
    for (const [opener, ids] of [...this.opens]) for (const id of [...ids]) opener.revoked(this, id);
    this.settleIfDone();
    return done;
  }

  /** Deregisters every registration now (later accesses fail), then tells the openers not told yet and forgets every open. Idempotent. */
  revokeNow(): void {
    void this.end();
    for (const r of this.regs.values()) r.mr.deregister();
    this.regs.clear();
    const opens = [...this.opens];
    this.opens.clear();
    for (const [opener, ids] of opens) {
      for (const id of ids) {
        if (!this.told) opener.revoked(this, id);
        opener.dropped(this, id);
      }
    }
    this.told = true;
    this.settleIfDone();
  }

  private settleIfDone(): void {
    if (this.regs.size > 0 || this.opens.size > 0 || !this.finish) return;
    if (this.waitTimer) clearTimeout(this.waitTimer);
    this.waitTimer = null;
    this.table.ended(this);
    this.lmr.mem.beforeFree.delete(this.onMemoryFree);
    const f = this.finish;
    this.finish = null;
    f();
  }

  /** @internal the shared memory is being freed: deregister first. */
  readonly onMemoryFree = (): void => this.revokeNow();
}

/**
 * The shares of a listener or a connection family, by name. A table may have
 * a parent (a listener's table for its connections' own tables): lookups
 * fall through to it.
 */
/** @internal */
export class ShareTable {
  private readonly byKey = new Map<string, Share>();
  private closed = false;

  constructor(readonly parent: ShareTable | null = null) {}

  add(name: string, lmr: LocalMr, access: ShareAccess, allow: ((peer: unknown) => boolean) | null): Share {
    if (this.closed) throw new RdmaError("INVALID_STATE", "share: the listener or connection is closed");
    const { key } = nameKey(name);
    if (this.byKey.has(key)) throw new RdmaError("INVALID_ARGUMENT", `share: the name ${JSON.stringify(name)} is already shared here; revoke it first`);
    lmr.mem.check("share");
    const s = new Share(this, key, name, lmr, access, allow);
    this.byKey.set(key, s);
    lmr.mem.beforeFree.add(s.onMemoryFree);
    return s;
  }

  find(key: string): Share | undefined {
    return this.byKey.get(key) ?? this.parent?.find(key);
  }

  /** Shares being revoked in order (out of the table by name, registrations not all gone yet). */
  private readonly ending = new Set<Share>();

  /** @internal a revoke started: the name is free again, the share ends in order. */
  forget(s: Share): void {
    if (this.byKey.get(s.key) === s) this.byKey.delete(s.key);
    this.ending.add(s);
  }

  /** @internal the share's last registration is gone. */
  ended(s: Share): void {
    this.ending.delete(s);
  }

  get size(): number {
    return this.byKey.size;
  }

  /** Revokes every share at once, also those already ending in order (the owner is closing). */
  close(): void {
    this.closed = true;
    for (const s of [...this.byKey.values(), ...this.ending]) s.revokeNow();
  }
}
