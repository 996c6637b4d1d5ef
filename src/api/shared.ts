/**
 * SharedMr: the owner's handle on a region shared by name (`share()` on a
 * listener or a connection). Peers open it with `openSharedMr(name)`.
 */
import { RdmaError, checkInt } from "../errors.js";
import { REVOKE_WAIT_MS, checkAccess, type Share, type ShareAccess, type ShareTable } from "../agent/shares.js";
import type { LocalMr } from "../memory/mr.js";
import type { PeerInfo } from "./establish/auth.js";

export type { ShareAccess };

/** Options of `share(name, lmr, opts)`. */
export interface ShareOptions {
  /** What openers may do: "read", "write" (read and write) or "atomic" (read, write and atomics). Default "read". */
  access?: ShareAccess;
  /**
   * Decides, when a peer opens the region, whether it may (synchronous;
   * `peer` is the connection's `rdma.peer`). Absent: every peer of the
   * listener or connection may open it.
   */
  allow?: (peer: PeerInfo) => boolean;
}

/**
 * The owner's handle on a region shared by name; peers open it with `openSharedMr(name)`. Revoke it (or dispose it) to end the sharing.
 *
 * @example
 * const shared = listener.share("counter", listener.allocLocalMr(8), { access: "atomic" });
 * // ... peers call rdma.openSharedMr("counter")
 * await shared.revoke();
 */
export class SharedMr {
  /** @internal */
  constructor(private readonly share: Share) {}

  /** The name peers open it by. */
  get name(): string {
    return this.share.name;
  }

  /** Its length in bytes. */
  get length(): number {
    return this.share.length;
  }

  /** What openers may do. */
  get access(): ShareAccess {
    return this.share.access;
  }

  /** Whether it was revoked. */
  get revoked(): boolean {
    return this.share.revoked;
  }

  /** Peers that have it open now. */
  get openCount(): number {
    return this.share.openCount;
  }

  /**
   * Ends the share, in order: new opens fail with NOT_FOUND at once; every
   * opener is told, and its registration is removed once its connection
   * acknowledged (from then on its RemoteMr fails locally with REMOTE_ACCESS
   * and its connection lives), when its connection ends, or after
   * `timeoutMs` (default 1000) for an opener that did not answer. Resolves
   * when no peer can reach the memory any more: until then, do not reuse
   * the bytes for something a peer must not see. The LocalMr stays the
   * owner's. `timeoutMs: 0` deregisters at once (an operation a peer has in
   * flight then fails with REMOTE_ACCESS and ends its connection).
   */
  revoke(opts?: { timeoutMs?: number }): Promise<void> {
    if (opts !== undefined && (opts === null || typeof opts !== "object")) throw new RdmaError("INVALID_ARGUMENT", "revoke: options must be an object");
    const ms = opts?.timeoutMs === undefined ? REVOKE_WAIT_MS : checkInt("timeoutMs", opts.timeoutMs, 0, 2 ** 31 - 1);
    return this.share.revoke(ms);
  }

  /** `using shared = ...`: revokes it at once at the end of the scope (deregisters, then tells the openers). */
  [Symbol.dispose](): void {
    this.share.revokeNow();
  }

  /** `await using shared = ...`: revokes it in order at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.share.revoke();
  }
}

/** @internal shares `lmr` in `table` after validating the arguments. */
export function shareIn(table: ShareTable, name: unknown, lmr: LocalMr, opts: ShareOptions | undefined | null): SharedMr {
  if (opts !== undefined && (opts === null || typeof opts !== "object")) throw new RdmaError("INVALID_ARGUMENT", "share: options must be an object");
  const access = opts?.access === undefined ? "read" : checkAccess(opts.access, "share");
  const allow = opts?.allow;
  if (allow !== undefined && typeof allow !== "function") throw new RdmaError("INVALID_ARGUMENT", "share: allow must be a function (peer) => boolean");
  if (typeof name !== "string") throw new RdmaError("INVALID_ARGUMENT", "share: the name must be a non-empty string");
  return new SharedMr(table.add(name, lmr, access, allow ? (peer) => allow(peer as PeerInfo) : null));
}
