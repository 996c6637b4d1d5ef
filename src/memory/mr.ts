/**
 * LocalMr and RemoteMr: the user's handles on registered memory.
 */
import { RdmaError } from "../errors.js";
import type { MemoryRegion, Sge } from "../transport/types.js";
import type { Allocation, MrPool } from "./pool.js";

type TypedArrayCtor<T> = { new (buffer: ArrayBuffer, byteOffset: number, length: number): T; BYTES_PER_ELEMENT: number };

/** %TypedArray%, the constructor every typed array class extends. */
const TypedArray = Object.getPrototypeOf(Uint8Array) as abstract new (...a: never[]) => unknown;

function checkTypedArrayCtor(ctor: unknown): void {
  const ok = typeof ctor === "function" && (ctor as { prototype?: unknown }).prototype instanceof TypedArray && Number.isInteger((ctor as { BYTES_PER_ELEMENT?: unknown }).BYTES_PER_ELEMENT);
  if (!ok) throw new RdmaError("INVALID_ARGUMENT", `view takes a typed array constructor (e.g. Float64Array), got ${ctor === null ? "null" : typeof ctor === "function" ? (ctor as { name?: string }).name || "a function" : typeof ctor}`);
}

/** @internal */
/** Owner of the memory behind a LocalMr (the allocation, its pool and its state). */
export class LocalMemory {
  /** Null for memory of no pool (registerMr), or after migrate(). */
  pool: MrPool | null;
  alloc: Allocation;
  /** Operations in flight that use this memory: freeing waits for them. */
  inflight = 0;
  disposed = false;
  private _lentTo: string | null = null;
  private freePending = false;
  private onFree: (() => void) | null;
  /** Run when the memory is released, before it is freed (shares revoke themselves here). */
  get beforeFree(): Set<() => void> {
    return (this._beforeFree ??= new Set());
  }
  /** Made when first asked for (a share): most memory never has any, and receive buffers come and go per message. */
  private _beforeFree: Set<() => void> | null = null;
  /**
   * Set by the owner of recyclable memory (a connection's receive buffers):
   * takes the allocation back instead of freeing it; false frees it.
   * `viewed`: a view of the bytes was handed out, so the allocation's
   * ArrayBuffer must be replaced (its views detached) before it is reused.
   */
  recycle: ((alloc: Allocation, viewed: boolean) => boolean) | null = null;
  /**
   * A view of the bytes was handed out (`bytes`, `view`). Memory whose bytes
   * were only read through `peekBytes` by the library itself (which copies
   * what it keeps) can be reused without detaching anything.
   */
  viewed = false;

  constructor(pool: MrPool | null, alloc: Allocation, onFree: (() => void) | null = null) {
    this.pool = pool;
    this.alloc = alloc;
    this.onFree = onFree;
  }

  /**
   * Lent to the peer (sendLocalMr) or granted for a remote request: not
   * usable locally. On native memory, lending detaches the allocation's
   * ArrayBuffer (every view obtained before lending goes dead) and the return
   * gives it a fresh one.
   */
  get lentTo(): string | null {
    return this._lentTo;
  }

  set lentTo(to: string | null) {
    const was = this._lentTo;
    this._lentTo = to;
    if (!this.pool || this.disposed) return;
    if (was === null && to !== null) this.pool.suspend(this.alloc);
    else if (was !== null && to === null) this.pool.resume(this.alloc);
  }

  /** Freed behind the user's back: the connection (and the pool) it came from was closed, which detaches its memory. */
  get freed(): boolean {
    return this.alloc.length > 0 && (this.alloc.mr.deregistered || this.alloc.buffer.byteLength === 0);
  }

  check(what: string): void {
    if (this.disposed) throw new RdmaError("INVALID_STATE", `${what}: this memory region was disposed`);
    if (this.lentTo !== null) throw new RdmaError("INVALID_STATE", `${what}: this memory region is lent to the peer (${this.lentTo}); it is usable again when it comes back`);
    if (this.freed) throw new RdmaError("INVALID_STATE", `${what}: this memory region was freed: the connection it belonged to is closed`);
  }

  release(): void {
    if (this.disposed) return;
    this.disposed = true;
    const before = this._beforeFree;
    if (before !== null && before.size > 0) {
      for (const f of [...before]) f();
      before.clear();
    }
    if (this.inflight > 0) this.freePending = true;
    else this.doFree();
  }

  /** A received message handed to the user (receive), as opposed to one kept unread. */
  userHeld = false;

  /**
   * Moves the bytes out of the pool into memory of no connection and no
   * protection domain, and frees the pool's allocation: a received message
   * that outlives its connection's pool stays readable. Views taken before
   * are detached (read `bytes` again); any connection refuses the memory as
   * an operand. The peer-memory charge stays (releaseCharge). False when it
   * cannot move (disposed, freed, in flight or lent).
   */
  migrate(): boolean {
    const pool = this.pool;
    if (pool === null || this.disposed || this.freed || this.inflight > 0 || this._lentTo !== null) return false;
    const a = this.alloc;
    const buffer = new ArrayBuffer(a.length);
    new Uint8Array(buffer).set(new Uint8Array(a.buffer, a.bufOffset, a.length));
    const mr = { pd: null, buffer, offset: 0, addr: 0, length: a.length, lkey: 0, rkey: 0, access: 0, deregistered: false, deregister() {} } as unknown as MemoryRegion;
    this.alloc = { mr, addr: 0, length: a.length, buffer, bufOffset: 0, mrBufOffset: 0 };
    this.pool = null;
    this.recycle = null;
    pool.free(a);
    return true;
  }

  /** Gives back what freeing this memory would give back (a rendezvous message's peer-memory charge), once. */
  releaseCharge(): void {
    const f = this.onFree;
    this.onFree = null;
    f?.();
  }

  opDone(): void {
    this.inflight--;
    if (this.inflight === 0 && this.freePending) this.doFree();
  }

  private doFree(): void {
    this.freePending = false;
    this.pool?.unkeep(this);
    if (this.pool && this.recycle?.(this.alloc, this.viewed)) return this.onFree?.();
    if (this.pool) this.pool.free(this.alloc);
    else this.alloc.mr.deregister();
    this.onFree?.();
  }
}

/**
 * Registered local memory: `bytes` is a Uint8Array over it. Dispose returns
 * it to the pool and detaches every view, so freed memory cannot be touched.
 *
 * @example
 * using lmr = rdma.allocLocalMr(8);
 * lmr.bytes.set([1, 2, 3, 4, 5, 6, 7, 8]);
 * await rdma.send(lmr.slice(0, 4));
 */
export class LocalMr {
  /** @internal */ readonly mem: LocalMemory;
  /** Offset of this view inside the allocation. */
  readonly start: number;
  readonly length: number;

  /** @internal */
  constructor(mem: LocalMemory, start: number, length: number) {
    this.mem = mem;
    this.start = start;
    this.length = length;
  }

  /** A Uint8Array over the bytes (throws if disposed or lent). */
  get bytes(): Uint8Array {
    this.mem.check("bytes");
    this.mem.viewed = true;
    const a = this.mem.alloc;
    return new Uint8Array(a.buffer, a.bufOffset + this.start, this.length);
  }

  /** A typed view, e.g. `lmr.view(Float64Array)`; the region's offset must be aligned to the element size. */
  view<T>(ctor: TypedArrayCtor<T>): T {
    checkTypedArrayCtor(ctor);
    this.mem.check("view");
    this.mem.viewed = true;
    const a = this.mem.alloc;
    const off = a.bufOffset + this.start;
    const size = ctor.BYTES_PER_ELEMENT;
    if (off % size !== 0 || this.length % size !== 0) {
      throw new RdmaError("INVALID_ARGUMENT", `a ${size}-byte element view needs an aligned offset and length (offset ${this.start}, length ${this.length})`);
    }
    return new ctor(a.buffer, off, this.length / size);
  }

  /** Bytes [start, end) of this region, sharing its memory (no registration). */
  slice(start: number, end: number = this.length): LocalMr {
    this.mem.check("slice");
    if (!Number.isInteger(start) || !Number.isInteger(end) || start < 0 || end > this.length || start > end) {
      throw new RdmaError("OUT_OF_RANGE", `slice(${start}, ${end}) is outside this ${this.length}-byte region`);
    }
    return new LocalMr(this.mem, this.start + start, end - start);
  }

  /** Whether the memory was given back (dispose, or its connection closed). */
  get disposed(): boolean {
    return this.mem.disposed || this.mem.freed;
  }

  /** @internal scatter/gather element for this view. */
  sge(): Sge {
    const a = this.mem.alloc;
    return { addr: a.addr + this.start, length: this.length, lkey: a.mr.lkey };
  }

  /** Returns the memory (the whole allocation, also for a slice) and detaches its views. */
  dispose(): void {
    if (this.mem.lentTo !== null) throw new RdmaError("INVALID_STATE", "cannot dispose a memory region that is lent to the peer");
    this.mem.release();
  }

  /** `using lmr = ...`: disposes at the end of the scope. */
  [Symbol.dispose](): void {
    if (!this.mem.disposed && this.mem.lentTo === null) this.mem.release();
  }
}

/** The lease state shared by a RemoteMr and its slices. */
export class RemoteLease {
  released = false;
  /** The owner revoked the region (a shared region): every later use fails locally. */
  revoked = false;
  /** Asks the owner for a longer lease (set by the connection the region came from). */
  renewer: ((rmr: RemoteMr, leaseMs: number, signal: AbortSignal | undefined) => Promise<void>) | null = null;
  /** The connection this region was granted or lent to (null: not checked, internal use). */
  owner: object | null = null;
  constructor(
    readonly token: number,
    /** performance.now() deadline on this side's monotonic clock (Infinity: none). */
    public deadline: number,
    private readonly onRelease: ((token: number) => void) | null,
  ) {}

  /** A renewal moved the deadline (never earlier). */
  extend(deadline: number): void {
    if (deadline > this.deadline) this.deadline = deadline;
  }

  check(what: string): void {
    if (this.released) throw new RdmaError("INVALID_STATE", `${what}: this remote memory region was released`);
    if (this.revoked) throw new RdmaError("REMOTE_ACCESS", `${what}: the owner revoked this shared region`);
    if (performance.now() >= this.deadline) throw new RdmaError("LEASE_EXPIRED", `${what}: the lease on this remote memory region expired; request a new one`);
  }

  release(): void {
    if (this.released) return;
    this.released = true;
    this.onRelease?.(this.token);
  }
}

/** Where a RemoteMr came from: requestRemoteMr ("granted"), receiveRemoteMr ("lent") or openSharedMr ("shared"). */
export type RemoteOrigin = "granted" | "lent" | "shared";
/** Rights on a remote region: "read", "write" (read and write) or "atomic" (read, write and atomics). */
export type RemoteAccess = "read" | "write" | "atomic";

/**
 * Memory of the peer that this side may read, write and apply atomics to,
 * for as long as its lease lasts.
 *
 * @example
 * const rmr = await rdma.requestRemoteMr(8, { timeoutMs: 5_000 });
 * await rdma.write(lmr, rmr);
 */
export class RemoteMr {
  /** Address of the first byte in the peer's address space. */
  readonly addr: number;
  readonly length: number;
  readonly rkey: number;
  /** @internal */ readonly lease: RemoteLease;
  /** @internal where the region came from: "granted" (requestRemoteMr), "lent" (receiveRemoteMr) or "shared" (openSharedMr). */
  readonly origin: RemoteOrigin;
  /** What the owner lets this side do: "read", "write" (read and write) or "atomic" (read, write and atomics). */
  readonly access: RemoteAccess;

  /** @internal */
  constructor(addr: number, length: number, rkey: number, lease: RemoteLease, origin: RemoteOrigin, access: RemoteAccess = "atomic") {
    this.addr = addr;
    this.length = length;
    this.rkey = rkey;
    this.lease = lease;
    this.origin = origin;
    this.access = access;
  }

  /** Whether the owner revoked it (shared regions). */
  get revoked(): boolean {
    return this.lease.revoked;
  }

  /** Monotonic deadline (performance.now() scale) after which the peer revokes access. */
  get leaseDeadline(): number {
    return this.lease.deadline;
  }

  /** Whether this side gave the region up (dispose, sendRemoteMr) or its connection closed. */
  get released(): boolean {
    return this.lease.released;
  }

  /** Bytes [start, end) of the remote region (empty slices allowed), with the same lease and rights. */
  slice(start: number, end: number = this.length): RemoteMr {
    if (!Number.isInteger(start) || !Number.isInteger(end) || start < 0 || end > this.length || start > end) {
      throw new RdmaError("OUT_OF_RANGE", `slice(${start}, ${end}) is outside this ${this.length}-byte remote region`);
    }
    return new RemoteMr(this.addr + start, end - start, this.rkey, this.lease, this.origin, this.access);
  }

  /**
   * Asks the owner to extend the lease to `leaseMs` from now (granted and lent
   * regions). The owner's maximum lease applies: asking for more fails with
   * OUT_OF_RANGE naming it; a region whose lease already ended fails with
   * LEASE_EXPIRED.
   */
  renew(leaseMs: number, opts?: { signal?: AbortSignal }): Promise<void> {
    if (!Number.isInteger(leaseMs) || leaseMs < 1 || leaseMs > 2 ** 31) return Promise.reject(new RdmaError("INVALID_ARGUMENT", `renew: leaseMs must be an integer in 1 .. 2^31, got ${String(leaseMs)}`));
    const signal = opts?.signal;
    if (signal !== undefined && !(signal instanceof AbortSignal)) return Promise.reject(new RdmaError("INVALID_ARGUMENT", "signal must be an AbortSignal"));
    if (!this.lease.renewer) return Promise.reject(new RdmaError("INVALID_ARGUMENT", this.origin === "shared" ? "renew: a shared region has no lease (it lasts until the owner revokes it)" : "renew: this region cannot be renewed"));
    try {
      return this.lease.renewer(this, leaseMs, signal);
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /** Gives the region back to its owner early (a no-op when already released). */
  dispose(): void {
    this.lease.release();
  }

  /** `using rmr = ...`: gives the region back at the end of the scope. */
  [Symbol.dispose](): void {
    this.lease.release();
  }
}

/**
 * @internal The bytes of `lmr`, for the library's own readers that copy what
 * they keep and drop the view before disposing (the RPC layer's frame
 * decoder): memory read only this way is recycled without detaching its
 * buffer. A function of this module, not a method, so no user of the
 * package can reach it.
 */
export function peekBytes(lmr: LocalMr): Uint8Array {
  lmr.mem.check("bytes");
  const a = lmr.mem.alloc;
  return new Uint8Array(a.buffer, a.bufOffset + lmr.start, lmr.length);
}
