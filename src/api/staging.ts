/**
 * Staging memory of one connection: where a plain buffer given to send(),
 * sendWithImm(), write() or writeWithImm() is copied before the operation
 * (registered memory the device can read). The user never sees it, so no
 * view of it escapes: once its operation settles it is reused as it is,
 * without being detached, freed or registered again.
 *
 * Invariants:
 * - memory is handed out in size classes (STAGE_CLASSES) and written only
 *   through peekBytes, so its `viewed` flag stays false; memory someone did
 *   view (none should) is freed, never reused;
 * - it comes back through LocalMemory.recycle, which runs only once the
 *   memory is released and no operation holds it (inflight 0): a rendezvous
 *   READ's grant is revoked before that, so the peer cannot read it after;
 * - at most STAGE_SPARE_BYTES of each class are kept spare per connection,
 *   none once the connection failed or closed, and those kept go back to the
 *   pool when the connection's resources are released (release()); a message longer than the largest class is staged in
 *   memory of its own, freed after.
 */
import { LocalMemory, LocalMr, peekBytes } from "../memory/mr.js";
import type { Allocation, MrPool } from "../memory/pool.js";

/** Size classes of staging memory (a staged message takes the smallest that fits). */
const STAGE_CLASSES = [256, 1024, 4096, 16384, 65536];
/**
 * Spare staging memory kept per connection and size class, in bytes (and at
 * most STAGE_SPARE_COUNT buffers of a class): a class of its own for each,
 * so large messages never crowd small ones out. At most 464 KiB in all.
 */
const STAGE_SPARE_BYTES = 128 * 1024;
const STAGE_SPARE_COUNT = 64;

export class Staging {
  private readonly spare: LocalMemory[][] = STAGE_CLASSES.map(() => []);
  /** Bytes kept spare, all classes (tests read it). */
  spareBytes = 0;

  constructor(
    private readonly pool: MrPool,
    /** The connection ended: nothing more is kept. */
    private readonly ended: () => boolean,
  ) {}

  /** Registered memory holding a copy of `v`'s bytes, in a LocalMr of exactly its length (release it once the operation is made). */
  copy(v: ArrayBufferView): LocalMr {
    const n = v.byteLength;
    const c = classOf(n);
    let mem: LocalMemory | undefined;
    if (c >= 0) {
      mem = this.spare[c]!.pop();
      if (mem !== undefined) this.spareBytes -= STAGE_CLASSES[c]!;
      else {
        mem = new LocalMemory(this.pool, this.pool.alloc(STAGE_CLASSES[c]!));
        mem.recycle = this.recycle;
      }
    } else mem = new LocalMemory(this.pool, this.pool.alloc(n));
    const lmr = new LocalMr(mem, 0, n);
    if (n > 0) peekBytes(lmr).set(new Uint8Array(v.buffer, v.byteOffset, n));
    return lmr;
  }

  /** The connection's resources are released: the spares go back to the pool (which newConnection() siblings share), and nothing more is kept. */
  release(): void {
    this.released = true;
    for (const spare of this.spare) for (const m of spare.splice(0)) m.release();
    this.spareBytes = 0;
  }

  private released = false;

  /** LocalMemory.recycle: an operation's staging memory came back; kept for the next copy, or freed (false). */
  private readonly recycle = (alloc: Allocation, viewed: boolean): boolean => {
    if (this.released || viewed || this.ended() || !this.pool.isLive(alloc)) return false;
    const c = STAGE_CLASSES.indexOf(alloc.length);
    if (c < 0) return false;
    const spare = this.spare[c]!;
    if (spare.length >= STAGE_SPARE_COUNT || (spare.length + 1) * alloc.length > STAGE_SPARE_BYTES) return false;
    const m = new LocalMemory(this.pool, alloc);
    m.recycle = this.recycle;
    spare.push(m);
    this.spareBytes += alloc.length;
    return true;
  };
}

function classOf(n: number): number {
  for (let i = 0; i < STAGE_CLASSES.length; i++) if (n <= STAGE_CLASSES[i]!) return i;
  return -1;
}
