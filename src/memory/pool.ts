/**
 * The MR pool: registered memory handed out in size classes, so small
 * allocations do not each cost a registration (ibv_reg_mr pins pages and
 * talks to the kernel: microseconds to milliseconds).
 *
 * Two strategies, chosen by what the provider can do:
 * - slabs (native memory, MemoryRegion.aliasBuffer present): one registration
 *   per slab; each allocation gets its own ArrayBuffer aliasing its bytes, so
 *   freeing it detaches exactly its views.
 * - per-allocation registration (tcp provider: memory is a plain JS
 *   ArrayBuffer, which cannot be aliased): registration there is a map insert,
 *   so nothing is lost, and each allocation still detaches on free.
 *
 * Pool memory is registered with LOCAL_WRITE only: a slab's rkey would expose
 * every allocation in it. Remote access is granted per range (see grant()).
 *
 * With native memory every allocation's ArrayBuffer is an alias of its own
 * (also for allocations above the largest class, which get their own
 * registration), so it can be detached while the memory is lent to the peer
 * and replaced by a fresh one when it comes back (suspend/resume).
 */
import { RdmaError, checkInt } from "../errors.js";
import { Access, type MemoryRegion, type ProtectionDomain } from "../transport/types.js";
import { detachArrayBuffer } from "../transport/buffers.js";

/**
 * Tests set ASYNC_RDMA_POISON_RECYCLED=1: recycled memory is filled with 0xa5,
 * so a view that wrongly aliased a recycled buffer would see its bytes change.
 */
let poison: boolean | undefined;

const CLASSES = [64, 256, 1024, 4096, 16384, 65536];
const SLAB_BYTES = 1 << 20;
/**
 * The first slab of a class holds only this many chunks (at least a page):
 * registering 1 MiB pins 256 pages (~0.3 ms on hardware, ~45 ms on rxe under
 * emulation), which a connection that allocates a few small buffers should
 * not pay up front. Later slabs of the class are SLAB_BYTES.
 */
const FIRST_SLAB_CHUNKS = 16;

/**
 * What the pool needs of kept received memory (a LocalMemory, mr.ts), stated here so pool.ts
 * does not import mr.ts, which imports it (no import cycle, type-only ones included).
 */
export interface KeptMemory {
  readonly alloc: Allocation;
  readonly userHeld: boolean;
  migrate(): boolean;
  releaseCharge(): void;
}

export interface Allocation {
  /** The registration covering the bytes. */
  readonly mr: MemoryRegion;
  /** Address of the first byte (for scatter/gather elements). */
  readonly addr: number;
  readonly length: number;
  /** ArrayBuffer for JS views and its offset. */
  readonly buffer: ArrayBuffer;
  readonly bufOffset: number;
  /** Offset of the first byte inside `mr.buffer` (for sub-registrations). */
  readonly mrBufOffset: number;
}

interface Slab {
  mr: MemoryRegion;
  chunk: number;
  free: number[];
}

interface PooledAllocation extends Allocation {
  /** Replaced by resume() (an alias buffer); otherwise fixed. */
  buffer: ArrayBuffer;
  slab: Slab | null;
  chunkIndex: number;
  /** `buffer` is an alias of its own (native memory): detachable without freeing. */
  aliased: boolean;
  /** Received memory to move out, not free, when the pool closes (keep()). */
  kept: KeptMemory | null;
}

/** A connection family's memory pool: registrations made, slabs, and what is allocated now. */
export interface PoolStats {
  registrations: number;
  slabs: number;
  liveAllocations: number;
  liveBytes: number;
}

/** @internal */
export class MrPool {
  readonly pd: ProtectionDomain;
  private readonly slabs = new Map<number, Slab[]>();
  private useSlabs: boolean | null = null;
  private live = new Set<PooledAllocation>();
  private liveBytes = 0;
  private registrations = 0;
  private closed = false;

  constructor(pd: ProtectionDomain) {
    this.pd = pd;
  }

  stats(): PoolStats {
    let slabs = 0;
    for (const l of this.slabs.values()) slabs += l.length;
    return { registrations: this.registrations, slabs, liveAllocations: this.live.size, liveBytes: this.liveBytes };
  }

  /** Zeroed, registered memory of `size` bytes. */
  alloc(size: number): Allocation {
    if (this.closed) throw new RdmaError("INVALID_STATE", "memory pool is closed (the connection was closed)");
    checkInt("size", size, 1, this.pd.device.attr.maxMrSize);
    const cls = CLASSES.find((c) => c >= size);
    if (cls !== undefined && this.slabsSupported()) return this.fromSlab(cls, size);
    const mr = this.pd.registerMr(size, Access.LOCAL_WRITE);
    this.registrations++;
    const aliased = this.slabsSupported();
    const buffer = aliased ? mr.aliasBuffer!(mr.offset, size) : mr.buffer;
    const bufOffset = aliased ? 0 : mr.offset;
    const a: PooledAllocation = { mr, addr: mr.addr, length: size, buffer, bufOffset, mrBufOffset: mr.offset, slab: null, chunkIndex: -1, aliased, kept: null };
    this.live.add(a);
    this.liveBytes += size;
    return a;
  }

  /** Returns memory to the pool and detaches its views. */
  free(alloc: Allocation): void {
    const a = alloc as PooledAllocation;
    if (!this.live.delete(a)) return;
    this.liveBytes -= a.length;
    if (a.slab === null) {
      a.mr.deregister(); // detaches its buffer and every alias of it
      return;
    }
    detachArrayBuffer(a.buffer);
    a.slab.free.push(a.chunkIndex);
  }

  /**
   * The allocation's memory is lent to the peer: detaches its ArrayBuffer, so
   * views obtained before lending cannot touch it (native memory only; a
   * plain JS buffer cannot be detached without losing the memory).
   */
  suspend(alloc: Allocation): void {
    const a = alloc as PooledAllocation;
    if (a.aliased && this.live.has(a)) detachArrayBuffer(a.buffer);
  }

  /** The memory came back: a fresh ArrayBuffer over the same bytes. */
  resume(alloc: Allocation): void {
    const a = alloc as PooledAllocation;
    if (!a.aliased || !this.live.has(a) || a.mr.deregistered) return;
    a.buffer = a.mr.aliasBuffer!(a.mrBufOffset, a.length);
  }

  /** The allocation is live and registered (recycling without renew: no view of it was handed out). */
  isLive(alloc: Allocation): boolean {
    const a = alloc as PooledAllocation;
    return this.live.has(a) && !a.mr.deregistered;
  }

  /**
   * Recycling: detaches every view of a live allocation and gives it a fresh
   * ArrayBuffer over the same registered bytes (native memory: a new alias;
   * tcp: the MR's buffer transferred). False when the provider cannot, and
   * the caller frees it instead.
   */
  renew(alloc: Allocation): boolean {
    const a = alloc as PooledAllocation;
    if (!this.live.has(a) || a.mr.deregistered) return false;
    if (a.aliased) {
      detachArrayBuffer(a.buffer);
      a.buffer = a.mr.aliasBuffer!(a.mrBufOffset, a.length);
    } else if (a.slab === null && a.mr.renewBuffer?.()) {
      a.buffer = a.mr.buffer;
    } else return false;
    poison ??= process.env.ASYNC_RDMA_POISON_RECYCLED === "1";
    if (poison) new Uint8Array(a.buffer, a.bufOffset, a.length).fill(0xa5);
    return true;
  }

  private slabsSupported(): boolean {
    if (this.useSlabs === null) {
      const probe = this.pd.registerMr(4096, Access.LOCAL_WRITE);
      this.useSlabs = typeof probe.aliasBuffer === "function";
      probe.deregister();
    }
    return this.useSlabs;
  }

  private fromSlab(cls: number, size: number): Allocation {
    let list = this.slabs.get(cls);
    if (!list) this.slabs.set(cls, (list = []));
    let slab = list.find((s) => s.free.length > 0);
    if (!slab) {
      const bytes = list.length === 0 ? Math.min(SLAB_BYTES, Math.max(4096, cls * FIRST_SLAB_CHUNKS)) : SLAB_BYTES;
      const mr = this.pd.registerMr(bytes, Access.LOCAL_WRITE);
      this.registrations++;
      const n = bytes / cls;
      slab = { mr, chunk: cls, free: Array.from({ length: n }, (_, i) => n - 1 - i) };
      list.push(slab);
    }
    const idx = slab.free.pop()!;
    const off = idx * cls;
    const buffer = slab.mr.aliasBuffer!(slab.mr.offset + off, size);
    new Uint8Array(buffer).fill(0);
    const a: PooledAllocation = { mr: slab.mr, addr: slab.mr.addr + off, length: size, buffer, bufOffset: 0, mrBufOffset: slab.mr.offset + off, slab, chunkIndex: idx, aliased: true, kept: null };
    this.live.add(a);
    this.liveBytes += size;
    return a;
  }

  /**
   * A registration over exactly [offset, offset+length) of an allocation with
   * the given remote access: what a peer gets, never a whole slab. Revoking it
   * (deregister) makes any later access fail with a remote access error.
   */
  grant(alloc: Allocation, offset: number, length: number, access: number): MemoryRegion {
    this.registrations++;
    return this.pd.registerMr(alloc.mr.buffer, access | Access.LOCAL_WRITE, alloc.mrBufOffset + offset, length);
  }

  /**
   * Received memory handed to the user, or kept unread past its connection's
   * end: when the pool closes it is moved out (LocalMemory.migrate), not
   * freed, so a received message stays readable. Marked on the allocation
   * (no set to maintain per message); a LocalMemory is unmarked when freed.
   */
  keep(m: KeptMemory): void {
    (m.alloc as PooledAllocation).kept = m;
  }

  unkeep(m: KeptMemory): void {
    const a = m.alloc as PooledAllocation;
    if (a.kept === m) a.kept = null;
  }

  /** Frees everything (the last connection of the pool's family ended), moving kept received memory out first. */
  close(): void {
    if (this.closed) return;
    for (const a of [...this.live]) {
      const m = a.kept;
      if (m === null) continue;
      a.kept = null;
      // A message the user holds is plain memory now: it stops counting as memory the peer makes
      // us hold. One kept unread keeps its charge until it is read or dropped; memory that could
      // not move (lent, in flight) is freed below.
      const moved = m.migrate();
      if (!moved || m.userHeld) m.releaseCharge();
    }
    this.closed = true;
    for (const a of [...this.live]) this.free(a);
    for (const list of this.slabs.values()) for (const s of list) s.mr.deregister();
    this.slabs.clear();
  }
}
