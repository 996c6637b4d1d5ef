/**
 * The rings of an RdmaStream: how many bytes each side may write into the
 * other's ring, where each chunk goes, and this side's ring memory.
 *
 * Invariants:
 * - A reader that does not read holds at most RING bytes: the writer writes
 *   only within the credit the reader gave (`window - posted`), and the
 *   reader gives credit back only for what its application consumed, in
 *   steps of at least a quarter ring.
 * - A chunk never wraps: the writer cuts it at the ring's end and goes on at
 *   offset 0, so both sides know every chunk's offset from the byte count
 *   alone (`posted % RING` here, `bytesRead % RING` at the reader).
 * - Whatever the peer claims is checked against this accounting before it
 *   counts: a WND that returns more than was written, a FIN whose total was
 *   not allowed or is below what was read, a chunk past the ring, past the
 *   credit or past the FIN's total is refused with the text of the stream's
 *   PROTOCOL error.
 * - The peer's ring is asked for once (RING?) and opened once, from the
 *   first RING after it, and must be exactly RING bytes.
 * - A side that writes copies each chunk into its send ring (registered
 *   once, RING bytes, at the chunk's offset in the peer's ring) and WRITEs
 *   it from there; a region of the send ring is copied into again only once
 *   every WRITE posted before the one that last used it has completed.
 * - This side's ring is the stream's own ArrayBuffer registered in place,
 *   not pool memory (a connection that closes frees its pool, on verbs at
 *   once, and chunks the peer wrote before closing are still to be copied
 *   out); it is freed only once the peer can no longer reach it (the share
 *   revoked in order, or the connection gone).
 */
import { randomUUID } from "node:crypto";
import { RdmaError } from "../errors.js";
import type { LocalMr, RemoteMr } from "../memory/mr.js";
import type { SharedMr } from "./shared.js";
import type { StreamConnection } from "./stream-connection.js";

/** Bytes of each side's receive ring: what the writer may have written and the reader's application not yet read. */
export const RING = 1024 * 1024;
/** Largest chunk of one WRITE (bigger writes are cut into this). */
export const MAX_CHUNK = 256 * 1024;
/** WRITEs one stream keeps posted at once. */
export const MAX_INFLIGHT = 8;

/** Ring credit both ways, and the peer's FIN total. */
export class RingCredit {
  /** Ring bytes this side allowed the peer to write so far (bytesRead may reach it). */
  granted = RING;
  /** Ring bytes the peer allowed this side to write so far. */
  window = RING;
  /** Bytes this side has posted as WRITEs (its offset in the peer's ring is posted % RING). */
  posted = 0;
  /** The peer's total from its FIN (-1: none yet). */
  peerFinAt = -1;

  /** The credit to give back now that the application consumed `consumed` bytes, counted as given; 0 while it is under a quarter ring. */
  give(consumed: number): number {
    const give = consumed + RING - this.granted;
    if (give < RING / 4) return 0;
    this.granted += give;
    return give;
  }

  /** The peer's WND of `n` bytes; the PROTOCOL error's text when it returns more than was written. */
  windowUpdate(n: number): string | null {
    if (n === 0 || this.window + n > this.posted + RING) return `the peer returned ${n} bytes of ring credit, more than was written (${this.posted + RING - this.window} at most)`;
    this.window += n;
    return null;
  }

  /** The peer's FIN of `total` bytes, `bytesRead` read so far; the PROTOCOL error's text when it cannot be. */
  fin(total: number, bytesRead: number): string | null {
    if (total < bytesRead || total > this.granted) return `the peer's FIN counts ${total} bytes, ${bytesRead} were read and ${this.granted} allowed`;
    this.peerFinAt = total;
    return null;
  }

  /** A chunk of `len` bytes the peer wrote after `bytesRead`; the PROTOCOL error's text when it may not be there. */
  chunkError(len: number, bytesRead: number): string | null {
    const off = bytesRead % RING;
    if (len < 1 || len > MAX_CHUNK || off + len > RING) return `the peer wrote a chunk of ${len} bytes at ring offset ${off} (the ring is ${RING} bytes, a chunk at most ${MAX_CHUNK})`;
    if (bytesRead + len > this.granted) return `the peer wrote past the ring credit it was given (${this.granted - bytesRead} bytes left, got ${len})`;
    if (this.peerFinAt >= 0 && bytesRead + len > this.peerFinAt) return `the peer wrote past the end its FIN announced (${this.peerFinAt} bytes)`;
    return null;
  }

  /** Bytes this side may still write into the peer's ring. */
  room(): number {
    return this.window - this.posted;
  }

  /** The next chunk of at most `left` bytes this side may write: within the room (and `cap`), MAX_CHUNK, and cut at the ring's end (a chunk never wraps). */
  nextChunk(left: number, cap: number = RING): number {
    return Math.min(MAX_CHUNK, left, this.room(), cap, RING - (this.posted % RING));
  }

  /** Counts `len` bytes as posted; returns their offset in the peer's ring. */
  post(len: number): number {
    const at = this.posted % RING;
    this.posted += len;
    return at;
  }
}

/**
 * This side's send ring: registered once, when the stream first writes, and
 * RING bytes like the peer's ring, so a chunk takes the same offset in both
 * (posted % RING). Each chunk is copied into it and WRITTEN from there: one
 * copy per byte, no registration or staging memory per write.
 */
export class SendRing {
  /** The registered ring (null until the first write, and once freed). */
  mr: LocalMr | null = null;
  /** Its bytes, where chunks are copied in. */
  bytes: Uint8Array | null = null;
  /** Bytes posted whose WRITEs, and every WRITE before them, completed. */
  private done = 0;
  /** The end (posted count) of each WRITE in flight, in post order, and whether it completed. */
  private readonly ends: number[] = [];
  private readonly completed: boolean[] = [];

  /** Registers the ring (throws what registration throws). */
  open(rdma: Pick<StreamConnection, "registerMr">): void {
    const buffer = new ArrayBuffer(RING);
    this.mr = rdma.registerMr(buffer);
    this.bytes = new Uint8Array(buffer);
  }

  /** Bytes of the ring free to copy into once `posted` bytes were posted: those whose WRITEs are all complete. */
  room(posted: number): number {
    return RING - (posted - this.done);
  }

  /** A WRITE ending at `end` (the posted count after it) was posted. */
  posted(end: number): void {
    this.ends.push(end);
    this.completed.push(false);
  }

  /** The WRITE ending at `end` completed: the ring is free up to the first one still in flight. */
  complete(end: number): void {
    const i = this.ends.indexOf(end);
    if (i < 0) return;
    this.completed[i] = true;
    while (this.completed.length > 0 && this.completed[0]) {
      this.done = this.ends.shift()!;
      this.completed.shift();
    }
  }

  /** Frees the ring (once no WRITE holds it: a LocalMr disposed in flight is freed when its operations end). */
  free(): void {
    const mr = this.mr;
    this.mr = null;
    this.bytes = null;
    try {
      mr?.dispose();
    } catch {
      /* freed with its connection */
    }
  }
}

/** This side's receive ring: allocated on the peer's RING?, shared under a random name, released in order. */
export class ReceiveRing {
  /** The registered ring (null until opened, and once released). */
  mr: LocalMr | null = null;
  /** Its bytes, where the peer's chunks are copied out from. */
  bytes: Uint8Array | null = null;
  private shared: SharedMr | null = null;

  /** Allocates the ring, registers it in place and shares it for writing; returns the name it is shared under. Throws what registration or sharing throws. */
  open(rdma: Pick<StreamConnection, "registerMr" | "share">): string {
    const name = `async-rdma/stream/${randomUUID()}`;
    const buffer = new ArrayBuffer(RING);
    this.mr = rdma.registerMr(buffer);
    this.bytes = new Uint8Array(buffer);
    this.shared = rdma.share(name, this.mr, { access: "write" });
    return name;
  }

  /** Forgets the ring at once; settles once it is freed, after the peer can no longer reach it. */
  release(): Promise<void> {
    const ring = this.mr;
    const shared = this.shared;
    this.mr = null;
    this.bytes = null;
    this.shared = null;
    const freeRing = (): void => {
      try {
        ring?.dispose();
      } catch {
        /* freed with its connection */
      }
    };
    let revoked: Promise<void> = Promise.resolve();
    try {
      if (shared) revoked = shared.revoke();
    } catch {
      /* the connection's shares are already gone */
    }
    return revoked.then(freeRing, freeRing);
  }
}

/** What the stream hears of opening the peer's ring. */
export interface PeerRingHost {
  /** The stream is destroyed: a ring opened now is freed at once. */
  gone(): boolean;
  /** The peer named something that is not its ring: the stream's PROTOCOL error. */
  protocol(what: string): void;
  /** The ring is open: writes may go. */
  opened(): void;
  /** Opening failed otherwise. */
  fail(e: Error): void;
}

/** The peer's ring, as this side writes into it: asked for once (RING?), opened once from the name the peer answers (RING), RING bytes exactly. */
export class PeerRing {
  /** The peer's ring once opened. */
  rmr: RemoteMr | null = null;
  /** RING? went out. */
  asked = false;
  private opening = false;

  /** Whether a RING is welcome now: asked for, and the first. */
  welcome(): boolean {
    return this.asked && this.rmr === null && !this.opening;
  }

  /** Opens the ring the peer named. */
  open(rdma: Pick<StreamConnection, "openSharedMr">, name: string, signal: AbortSignal, host: PeerRingHost): void {
    this.opening = true;
    rdma.openSharedMr(name, { signal }).then(
      (rmr) => {
        if (host.gone()) return void freeRemote(rmr);
        if (rmr.length !== RING) {
          freeRemote(rmr);
          return host.protocol(`the peer's ring is ${rmr.length} bytes, not ${RING}`);
        }
        this.rmr = rmr;
        host.opened();
      },
      (e: unknown) => {
        if (host.gone()) return;
        if (e instanceof RdmaError && e.code === "NOT_FOUND") return host.protocol(`the peer's ring cannot be opened (${e.message})`);
        if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED") return; // the message loop decides
        host.fail(e instanceof Error ? e : new Error(String(e)));
      },
    );
  }

  /** Disposes the ring (the stream ends). */
  free(): void {
    if (this.rmr) freeRemote(this.rmr);
    this.rmr = null;
  }
}

/** Disposes the peer's ring, which may already be gone with its connection. */
function freeRemote(rmr: RemoteMr): void {
  try {
    rmr.dispose();
  } catch {
    /* closed with its connection */
  }
}
