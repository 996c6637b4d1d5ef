/**
 * The process-wide budget for memory that peers make this process hold:
 * regions granted through requestRemoteMr and buffers allocated to receive
 * rendezvous messages, over every connection and listener of the process.
 * Per-connection quotas bound one peer; this bounds all of them together, so
 * many connections (or many peers) cannot take the process down.
 */
import { RdmaError, checkInt } from "../errors.js";
import { totalmem } from "node:os";

/** Default: a quarter of the machine's memory, at most 4 GiB. */
export const DEFAULT_PEER_MEMORY_LIMIT = Math.min(4 * 2 ** 30, Math.floor(totalmem() / 4));

class PeerMemoryBudget {
  limit = DEFAULT_PEER_MEMORY_LIMIT;
  used = 0;
  private readonly waiters = new Set<() => void>();

  /** Takes `n` bytes if they fit; false otherwise (nothing taken). */
  take(n: number): boolean {
    if (this.used + n > this.limit) return false;
    this.used += n;
    return true;
  }

  give(n: number): void {
    this.used -= n;
    if (this.used < 0) throw new RdmaError("DEVICE", `peer memory budget underflow (${this.used})`);
    if (this.waiters.size > 0) for (const w of [...this.waiters]) w();
  }

  /** Calls `f` each time memory is given back, until the returned function is called. */
  onFree(f: () => void): () => void {
    this.waiters.add(f);
    return () => this.waiters.delete(f);
  }
}

export const peerMemory = new PeerMemoryBudget();

/**
 * Sets the process-wide limit on memory peers can make this process hold
 * (granted regions and rendezvous receive buffers, all connections together).
 * Requests past it are denied with QUOTA_EXCEEDED; rendezvous messages wait.
 */
export function setPeerMemoryLimit(bytes: number): void {
  peerMemory.limit = checkInt("peerMemoryLimit", bytes, 0, Number.MAX_SAFE_INTEGER);
  // A raised limit may let waiting rendezvous messages in.
  peerMemory.give(0);
}

/** The process-wide peer memory limit and how much of it is in use, in bytes. */
export function peerMemoryUsage(): { limit: number; used: number } {
  return { limit: peerMemory.limit, used: peerMemory.used };
}
