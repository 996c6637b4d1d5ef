/**
 * Bounce memory of one connection: where rendezvous messages of mid size wait
 * for the peer's READ.
 *
 * Invariant: BOUNCE_SLOTS slots of BOUNCE_SLOT bytes, allocated on first use
 * and registered once for remote READ in this connection's protection domain
 * (its peer only), instead of a registration per message (a system call and
 * page pinning on a NIC cost more than copying that many bytes). A slot holds
 * a message's bytes only from when its announcement is posted (the peer knows
 * the key from earlier messages: a message aborted while queued is never
 * there) until the peer took it; a slot whose message the peer did not take
 * is wiped before reuse. If the memory cannot be had, the connection
 * registers per message instead.
 */
import { Access, type MemoryRegion } from "../transport/types.js";
import { LocalMemory } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";

/** Largest message copied into a slot; larger ones are lent (a registration over exactly their bytes). */
export const BOUNCE_SLOT = 128 * 1024;
export const BOUNCE_SLOTS = 8;

export class Bounce {
  private mem: LocalMemory | null = null;
  private region: MemoryRegion | null = null;
  private readonly free: number[] = [];
  private failed = false;

  constructor(private readonly pool: MrPool) {}

  /** A free slot for a message of `len` bytes, or -1 (too small or too large for bounce, none free, or no memory). */
  take(len: number, eagerMax: number): number {
    if (len > BOUNCE_SLOT || len <= eagerMax || this.failed) return -1;
    if (this.region === null) {
      let mem: LocalMemory | null = null;
      try {
        mem = new LocalMemory(this.pool, this.pool.alloc(BOUNCE_SLOT * BOUNCE_SLOTS));
        this.region = this.pool.grant(mem.alloc, 0, BOUNCE_SLOT * BOUNCE_SLOTS, Access.REMOTE_READ);
        this.mem = mem;
        for (let i = BOUNCE_SLOTS - 1; i >= 0; i--) this.free.push(i);
      } catch {
        // No memory or keys for it (a registration limit): this connection registers per message.
        mem?.release();
        this.failed = true;
        return -1;
      }
    }
    return this.free.pop() ?? -1;
  }

  /** The registration the peer reads slots through. */
  get mr(): MemoryRegion {
    return this.region!;
  }

  /** The address the peer reads `slot` at. */
  addr(slot: number): number {
    return this.region!.addr + slot * BOUNCE_SLOT;
  }

  /** Copies a message into its slot (when its announcement is posted). */
  copyIn(slot: number, bytes: Uint8Array): void {
    const a = this.mem!.alloc;
    new Uint8Array(a.buffer, a.bufOffset + slot * BOUNCE_SLOT, bytes.length).set(bytes);
  }

  /** The slot is free again; `wipe`: its message was never taken, zero it first. */
  put(slot: number, wipe: boolean): void {
    const mem = this.mem;
    if (mem === null || this.region!.deregistered) return;
    if (wipe) new Uint8Array(mem.alloc.buffer, mem.alloc.bufOffset + slot * BOUNCE_SLOT, BOUNCE_SLOT).fill(0);
    this.free.push(slot);
  }

  /** Teardown: deregisters (any late READ fails), then frees. */
  release(): void {
    if (this.region === null) return;
    this.region.deregister();
    this.mem!.release();
  }
}
