/**
 * The outbox: frames queued before the next microtask checkpoint go out
 * together, in as few messages as the batch bound allows, each message a
 * registered buffer reused once its send completed. A frame is written into
 * its message's buffer when it is pushed (the payload's bytes are taken
 * then, and copied once). A frame counts
 * (`unsentFrames`, `unsentBytes`) from push until the send of its message
 * settles, so what the box holds is exactly what has not reached the peer
 * (the server's back-pressure reads it). A failed send fails only the calls
 * its message carried, unless the connection closed.
 */
import { RdmaError, type LocalMr, type Rdma } from "../index.js";
import { CALL, callIds, EMPTY, HDR, writeFrame } from "./frame.js";

/**
 * Frames are gathered into one message up to the peer's eager threshold
 * (rdma.peerEagerThreshold: the batch is one SEND, never a rendezvous), its
 * maxMessageSize, or MAX_BATCH_BYTES, whichever is least; a larger frame
 * travels alone. The connection's default eager threshold leaves 64 bytes
 * beyond 4 KiB for this framing, so a 4 KiB call alone is still one eager
 * message; a peer that raised its threshold (setEagerThreshold) gets larger
 * batches, so calls of a few KiB travel several to a message.
 */
const MIN_BATCH_BYTES = 256;
/** The largest batch, whatever the peer's threshold (up to 1 MiB). */
const MAX_BATCH_BYTES = 64 * 1024 + 64;
/**
 * Batch buffers are this small once the large ones' budget is spent: a batch
 * buffer is registered memory held until its send completes, so its size
 * must not follow a peer's threshold without bound — 128 small replies a
 * peer never takes would pin 128 buffers. The default eager threshold
 * (4 KiB + 64) fits: a 4 KiB call's frame (4,112 bytes) takes a reused small
 * buffer, never a fresh registration.
 */
const SMALL_BATCH_BYTES = 4096 + 64;
/**
 * Small batch buffers kept for reuse per connection (each one batch,
 * registered): enough for the sends a window of calls keeps in flight (the
 * peer's receive depth, 32 by default), so a steady stream of 4 KiB calls
 * registers nothing. Kept only after a burst needed them: at most 32 × 4,160
 * bytes.
 */
const SPARE_BUFFERS = 32;
/**
 * Buffers larger than SMALL_BATCH_BYTES (when the peer's threshold is larger)
 * are taken only while those allocated, in flight or kept for reuse, total at
 * most this many bytes: whatever the peer does, large batches pin no more;
 * past it, frames go in small buffers.
 */
const LARGE_BATCH_BUDGET = 512 * 1024;

/** What an Outbox reports to its owner. */
export interface OutboxHost {
  /** A message could not be sent (the connection lives on, unless `e` says it closed); `ids`: the CALL frames it carried. */
  failed(e: unknown, ids: number[]): void;
  /** Frames left the box (their send settled, or they were dropped): room may have come back. */
  drained(): void;
}


/**
 * A message being filled, or filled and waiting for the flush; once sent,
 * told how its send ended (no promise per message).
 */
class Batch {
  /** Bytes written. */
  len = 0;
  frames = 0;

  constructor(
    private readonly box: Outbox,
    readonly buf: LocalMr,
    readonly bytes: Uint8Array,
    /** Bytes frames may fill (0: a buffer of one frame's size, which no other frame joins). */
    readonly cap: number,
    /** A large batch buffer (counted in largeBytes). */
    readonly large: boolean,
  ) {}

  /**
   * SendListener: the send of this message completed (`err` null) or
   * failed. A failure is handled a microtask later, as a rejected promise
   * was: a send flushed by the connection's failure is told inside the
   * drain that found it, before the teardown, and the calls it carried
   * must end with the connection's own error (its receive loop's), not
   * with the flush.
   */
  sent(err: unknown): void {
    if (err === null) this.box.settle(this, null);
    else queueMicrotask(() => this.box.settle(this, err));
  }
}

/**
 * Frames queued before the next microtask checkpoint go out together. A
 * frame counts (`unsentFrames`, `unsentBytes`) from push until the send of
 * its message settles: what the box holds is what has not reached the peer.
 */
export class Outbox {
  /** Filled messages waiting for the flush, in order; the last may still take frames. */
  private batches: Batch[] = [];
  private scheduled = false;
  /** Set by the owner (or a closing connection): later frames are dropped. */
  failure: unknown = null;
  /** Frames pushed whose message's send has not settled. */
  unsentFrames = 0;
  /** Their bytes. */
  unsentBytes = 0;
  /** Small batch buffers whose send completed: reused, so a batch costs no allocation or registration. */
  private readonly spare: LocalMr[] = [];
  /** Large ones likewise. */
  private readonly spareLarge: LocalMr[] = [];
  /** Bytes of the large batch buffers allocated and not freed (in use or spare): at most LARGE_BATCH_BUDGET. */
  private largeBytes = 0;
  private readonly batchMax: number;
  private readonly smallMax: number;

  constructor(
    private readonly rdma: Rdma,
    private readonly host: OutboxHost,
    /** The peer's maxMessageSize: a batch never exceeds it (a single larger frame is the owner's to refuse). */
    peerMax: number,
  ) {
    this.batchMax = Math.min(peerMax, MAX_BATCH_BYTES, Math.max(MIN_BATCH_BYTES, rdma.peerEagerThreshold));
    this.smallMax = Math.min(this.batchMax, SMALL_BATCH_BYTES);
  }

  /** A frame encoded already (errors, cancels). */
  push(frame: Uint8Array): void {
    const b = this.room(frame.length, frame[1] === CALL ? new DataView(frame.buffer, frame.byteOffset, HDR).getUint32(4) : -1);
    if (b === null) return;
    b.bytes.set(frame, b.len);
    b.len += frame.length;
    b.frames++;
  }

  /** A frame written straight into its message: the payload's bytes are copied now, once. */
  pushFrame(kind: number, id: number, method: Uint8Array | null, payload: Uint8Array): void {
    const m = method ?? EMPTY;
    const b = this.room(HDR + m.length + payload.length, kind === CALL ? id : -1);
    if (b === null) return;
    b.len += writeFrame(b.bytes, b.len, kind, id, m, payload);
    b.frames++;
  }

  /** The connection ended: the spare buffers go back to it. */
  close(): void {
    // Batches whose sends settle later are freed, not kept (done()).
    this.failure ??= new RdmaError("CONNECTION_CLOSED", "rpc: the connection is closed");
    for (const m of this.spare.splice(0)) m[Symbol.dispose]();
    for (const m of this.spareLarge.splice(0)) this.freeLarge(m);
  }

  /** Bytes of large batch buffers allocated now (tests read it: never above LARGE_BATCH_BUDGET). */
  get largeBatchBytes(): number {
    return this.largeBytes;
  }

  private freeLarge(m: LocalMr): void {
    this.largeBytes -= m.length;
    m[Symbol.dispose]();
  }

  /**
   * The message a frame of `n` bytes goes into (counted from now), or null
   * when it is dropped: the box failed, or no buffer could be had (then the
   * call it carries, `callId` if not -1, fails, unless the connection closed).
   */
  private room(n: number, callId: number): Batch | null {
    if (this.failure) return null;
    this.unsentFrames++;
    this.unsentBytes += n;
    const last = this.batches.length > 0 ? this.batches[this.batches.length - 1]! : null;
    if (this.rdma.isClosed || last?.buf.disposed) {
      // Closed in this same turn: the batch being filled may have lost its memory.
      this.settled(1, n);
      this.failure = new RdmaError("CONNECTION_CLOSED", "rpc: the connection is closed");
      return null;
    }
    if (last !== null && last.len + n <= last.cap) return last;
    // Large while the budget lasts (spares are in it already), else small (see LARGE_BATCH_BUDGET).
    const large = n <= this.batchMax && this.batchMax > this.smallMax && (this.spareLarge.length > 0 || this.largeBytes + this.batchMax <= LARGE_BATCH_BUDGET);
    const cap = large ? this.batchMax : n <= this.smallMax ? this.smallMax : 0;
    let buf: LocalMr | undefined;
    try {
      const spares = large ? this.spareLarge : this.spare;
      buf = cap > 0 ? spares.pop() : undefined;
      // A spare freed with its connection's memory: the allocation below says why (CONNECTION_CLOSED).
      if (buf?.disposed) {
        if (large) for (const m of [buf, ...spares.splice(0)]) this.largeBytes -= m.length;
        spares.length = 0;
        buf = undefined;
      }
      if (buf === undefined) {
        buf = this.rdma.allocLocalMr(cap > 0 ? cap : n);
        if (large) this.largeBytes += buf.length;
      }
    } catch (e) {
      this.settled(1, n);
      // A closing connection: its receive loop ends every call with CONNECTION_CLOSED.
      if ((e instanceof RdmaError && e.code === "CONNECTION_CLOSED") || this.rdma.isClosed) this.failure ??= e;
      else this.host.failed(e, callId < 0 ? [] : [callId]);
      return null;
    }
    const b = new Batch(this, buf, buf.bytes, cap, large);
    this.batches.push(b);
    if (!this.scheduled) {
      this.scheduled = true;
      queueMicrotask(() => this.flush());
    }
    return b;
  }

  private settled(count: number, bytes: number): void {
    this.unsentFrames -= count;
    this.unsentBytes -= bytes;
    this.host.drained();
  }

  private flush(): void {
    this.scheduled = false;
    const batches = this.batches;
    this.batches = [];
    for (const b of batches) this.out(b);
  }

  /** A batch buffer whose send settled (`sent`: completed; else failed, or never made): kept for reuse, or freed. */
  private done(b: Batch, sent: boolean): void {
    const m = b.buf;
    const keep = sent && !this.failure && !m.disposed;
    // Large spares are within the budget already (largeBytes counts them).
    if (b.large) {
      if (keep) this.spareLarge.push(m);
      else this.freeLarge(m);
    } else if (keep && b.cap > 0 && this.spare.length < SPARE_BUFFERS) this.spare.push(m);
    else m[Symbol.dispose]();
  }

  private out(b: Batch): void {
    const { buf: whole, len: o, frames: count } = b;
    let msg: LocalMr;
    try {
      if (this.failure) throw this.failure;
      // The connection may have ended (its memory with it) between the push and this flush.
      msg = o === whole.length ? whole : whole.slice(0, o);
    } catch (e) {
      this.failure ??= e instanceof RdmaError ? e : new RdmaError("CONNECTION_CLOSED", "rpc: the connection is closed");
      this.done(b, false);
      this.settled(count, o);
      // Its receive loop (client) or serve() (server) ends what the frames belonged to.
      return;
    }
    // No promise per message: the batch is told how its send ended (settle). Nothing here
    // touches b after this call, whenever that comes.
    this.rdma.sendListened(msg, b);
  }

  /** A batch's send ended (`err` null: completed). */
  settle(b: Batch, err: unknown): void {
    const { buf: whole, len: o, frames: count } = b;
    if (err === null) {
      this.done(b, true);
      this.settled(count, o);
      return;
    }
    let ids: number[] = [];
    if (!this.rdma.isClosed) {
      try {
        ids = callIds(whole.bytes.subarray(0, o));
      } catch {
        /* the memory went with the connection */
      }
    }
    this.done(b, false);
    this.settled(count, o);
    if (err instanceof RdmaError && err.code === "CONNECTION_CLOSED") return;
    this.host.failed(err, ids);
  }
}
