/**
 * The outbox: frames queued before the next microtask checkpoint go out
 * together, in as few messages as the batch bound allows, each message a
 * registered buffer reused once its send completed. A frame counts
 * (`unsentFrames`, `unsentBytes`) from push until the send of its message
 * settles, so what the box holds is exactly what has not reached the peer
 * (the server's back-pressure reads it). A failed send fails only the calls
 * its message carried, unless the connection closed.
 */
import { RdmaError, type LocalMr, type Rdma } from "../index.js";
import { CALL, callIds, HDR } from "./frame.js";

/**
 * Frames are gathered into one message up to the peer's eager threshold
 * (rdma.peerEagerThreshold: the batch is one SEND, never a rendezvous), its
 * maxMessageSize, or 4 KiB, whichever is least; a larger frame travels alone.
 * The connection's default eager threshold leaves 64 bytes beyond 4 KiB for
 * this framing, so a 4 KiB call alone is still one eager message.
 */
const MIN_BATCH_BYTES = 256;
/**
 * And at most this: a batch buffer is registered memory held until its send
 * completes, so its size must not follow a peer's advertised threshold (up
 * to 1 MiB) — 128 small replies the peer never takes would pin 128 buffers.
 */
const MAX_BATCH_BYTES = 4096;
/** Batch buffers kept for reuse per connection (each one batch, registered). */
const SPARE_BUFFERS = 8;

/** What an Outbox reports to its owner. */
export interface OutboxHost {
  /** A message could not be sent (the connection lives on, unless `e` says it closed); `ids`: the CALL frames it carried. */
  failed(e: unknown, ids: number[]): void;
  /** Frames left the box (their send settled, or they were dropped): room may have come back. */
  drained(): void;
}


/**
 * Frames queued before the next microtask checkpoint go out together. A
 * frame counts (`unsentFrames`, `unsentBytes`) from push until the send of
 * its message settles: what the box holds is what has not reached the peer.
 */
export class Outbox {
  private frames: Uint8Array[] = [];
  private scheduled = false;
  /** Set by the owner (or a closing connection): later frames are dropped. */
  failure: unknown = null;
  /** Frames pushed whose message's send has not settled. */
  unsentFrames = 0;
  /** Their bytes. */
  unsentBytes = 0;
  /** Registered batch buffers whose send completed: reused, so a batch costs no allocation or registration. */
  private readonly spare: LocalMr[] = [];
  private readonly batchMax: number;

  constructor(
    private readonly rdma: Rdma,
    private readonly host: OutboxHost,
    /** The peer's maxMessageSize: a batch never exceeds it (a single larger frame is the owner's to refuse). */
    peerMax: number,
  ) {
    this.batchMax = Math.min(peerMax, MAX_BATCH_BYTES, Math.max(MIN_BATCH_BYTES, rdma.peerEagerThreshold));
  }

  push(frame: Uint8Array): void {
    if (this.failure) return;
    this.frames.push(frame);
    this.unsentFrames++;
    this.unsentBytes += frame.length;
    if (!this.scheduled) {
      this.scheduled = true;
      queueMicrotask(() => this.flush());
    }
  }

  /** The connection ended: the spare buffers go back to it. */
  close(): void {
    for (const m of this.spare.splice(0)) m[Symbol.dispose]();
  }

  private settled(count: number, bytes: number): void {
    this.unsentFrames -= count;
    this.unsentBytes -= bytes;
    this.host.drained();
  }

  private flush(): void {
    this.scheduled = false;
    const frames = this.frames;
    this.frames = [];
    let batch: Uint8Array[] = [];
    let bytes = 0;
    const out = (list: Uint8Array[], n: number): void => {
      const count = list.length;
      if (count === 0) return;
      if (this.failure) return this.settled(count, n);
      let buf: LocalMr | undefined;
      try {
        buf = n <= this.batchMax ? this.spare.pop() : undefined;
        buf ??= this.rdma.allocLocalMr(Math.max(n, this.batchMax));
      } catch (e) {
        this.settled(count, n);
        // A closing connection: its receive loop ends every call with CONNECTION_CLOSED.
        if ((e instanceof RdmaError && e.code === "CONNECTION_CLOSED") || this.rdma.isClosed) {
          this.failure ??= e;
          return;
        }
        const ids: number[] = [];
        for (const f of list) if (f[1] === CALL) ids.push(new DataView(f.buffer, f.byteOffset, HDR).getUint32(4));
        return this.host.failed(e, ids);
      }
      const whole = buf;
      const b = whole.bytes;
      let o = 0;
      for (const f of list) {
        b.set(f, o);
        o += f.length;
      }
      this.rdma.send(o === whole.length ? whole : whole.slice(0, o)).then(
        () => {
          if (whole.length === this.batchMax && !this.failure && this.spare.length < SPARE_BUFFERS) this.spare.push(whole);
          else whole[Symbol.dispose]();
          this.settled(count, n);
        },
        (e: unknown) => {
          let ids: number[] = [];
          if (!this.rdma.isClosed) {
            try {
              ids = callIds(whole.bytes.subarray(0, o));
            } catch {
              /* the memory went with the connection */
            }
          }
          whole[Symbol.dispose]();
          this.settled(count, n);
          if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED") return;
          this.host.failed(e, ids);
        },
      );
    };
    for (const f of frames) {
      if (bytes > 0 && bytes + f.length > this.batchMax) {
        out(batch, bytes);
        batch = [];
        bytes = 0;
      }
      batch.push(f);
      bytes += f.length;
    }
    out(batch, bytes);
  }
}
