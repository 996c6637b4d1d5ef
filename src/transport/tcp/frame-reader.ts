/**
 * Stream → frames. Each header is decoded and validated by the codec (size
 * and format; a malformed one stops the reader with a reason); a payload is
 * copied straight into its placement (registered memory) as bytes arrive,
 * with no reassembly buffer, and only while every MR of the placement is
 * still registered (and a window's key unchanged). What a frame *means* is
 * the handlers' business.
 *
 * The rest of a large segment can instead be read from the socket straight
 * into its memory (pullDirect, called by the QP's feed after a read that
 * filled the read buffer): the same checks, one read at a time.
 *
 * A placement is a list of (MR, offset, length) segments copied into the
 * reader's own arrays (reused frame after frame): it holds no view and no
 * closure, and nothing of the request or send-queue record it came from. The
 * MR's current view is taken at each copy.
 */
import { SMALL_COPY, copyWords, dvOf, type DvCache } from "./bytes.js";
import { HEADER_LEN, decodeHeader, newHeader, type DecodedHeader } from "./codec.js";

/** Registered memory a payload is placed in (TcpMr). */
export interface PlacementMr {
  readonly view: Uint8Array;
  readonly dvc: DvCache;
  /** Deregistered, or its buffer detached: nothing more lands in it. */
  readonly unusable: boolean;
}

/** A memory window a payload is placed through: placement stops once its key changes (invalidated, rebound). */
export interface PlacementWindow {
  readonly rkey: number;
}

/**
 * Reads up to `len` bytes of the socket straight into `view[at, at + len)`
 * (read-path.ts): the bytes read, 0 when none were waiting (or the stream
 * ended), -1 when the read failed (the stream is destroyed with that error,
 * or, for a read that could not be made, the read buffer carries the bytes).
 */
export type DirectRead = (view: Uint8Array, at: number, len: number) => number;

/**
 * Most bytes one pullDirect reads: one socket read callback handles at most
 * a read buffer and this (read-path.ts also bounds direct reads per
 * event-loop turn, over all sockets).
 */
export const DIRECT_MAX = 1024 * 1024;

/** Payload bytes still to come, in one segment, from which a read goes straight into registered memory. */
export const DIRECT_MIN = 64 * 1024;

/** DataView over the buffer reads land in (read-path.ts's shared buffer, or a fallback chunk). */
const chunkDvc: DvCache = { ab: null, dv: null };

/**
 * Incremental frame reader: header first (possibly split across chunks), then
 * the payload copied straight into its placement (registered memory) as bytes
 * arrive, with no reassembly buffer.
 */
export class FrameReader {
  private readonly hdrBuf = Buffer.alloc(HEADER_LEN);
  private hdrFill = 0;
  readonly h: DecodedHeader = newHeader();
  private remaining = 0;
  /** Payload bytes of the current frame still to come (0 between frames). */
  get payloadLeft(): number {
    return this.remaining;
  }
  /** The payload is placed (else discarded), in segMr/segOff/segLen[0, nseg). */
  private placing = false;
  private readonly segMr: (PlacementMr | null)[] = [];
  private readonly segOff: number[] = [];
  private readonly segLen: number[] = [];
  private nseg = 0;
  /** Placement through a window stops once its key is not `winKey` any more. */
  private win: PlacementWindow | null = null;
  private winKey = 0;
  private ti = 0;
  private toff = 0;
  stopped = false;
  /** Set when the handler wants the rest of the current chunk (parking a socket). */
  leftover: Buffer | null = null;

  constructor(
    public onHeader: (h: DecodedHeader) => void,
    public onPayloadDone: (h: DecodedHeader) => void,
    /** A header failed validation; `type` is its type byte as received (whatever it says). */
    public onMalformed: (reason: string, type: number) => void,
    /** The target memory went away mid-payload: the rest of it is discarded. */
    public onRevoked: (h: DecodedHeader) => void = () => {},
  ) {}

  /** Called from onHeader: the payload is discarded. */
  discard(): void {
    this.clearPlacement();
    this.placing = false;
  }

  /** Called from onHeader: the payload is placed in the segments added next (placeSeg, in order; none: nothing to place). */
  placeBegin(): void {
    this.clearPlacement();
    this.placing = true;
  }

  /** The next `len` bytes (> 0) of the payload go to `mr`'s bytes at `off` (checked by the caller). */
  placeSeg(mr: PlacementMr, off: number, len: number): void {
    const k = this.nseg++;
    this.segMr[k] = mr;
    this.segOff[k] = off;
    this.segLen[k] = len;
  }

  /** The placement is through window `w` with key `key` (its MR was added by placeSeg). */
  placeWindow(w: PlacementWindow, key: number): void {
    this.win = w;
    this.winKey = key;
  }

  private clearPlacement(): void {
    for (let k = 0; k < this.nseg; k++) this.segMr[k] = null;
    this.nseg = 0;
    this.win = null;
    this.ti = 0;
    this.toff = 0;
  }

  /** Every MR of the placement is still registered (and the window's key unchanged). */
  private alive(): boolean {
    for (let k = 0; k < this.nseg; k++) if (this.segMr[k]!.unusable) return false;
    return this.win === null || this.win.rkey === this.winKey;
  }

  /**
   * Parses chunk[start, end) in place. The chunk may be a buffer reused for
   * the next read (read-path.ts): nothing of it is kept past this call (a
   * split header is copied, `leftover` is a copy).
   */
  feed(chunk: Buffer, start = 0, end = chunk.length): void {
    let off = start;
    const len = end;
    while (off < len && !this.stopped) {
      if (this.remaining > 0) {
        const n = Math.min(this.remaining, len - off);
        if (this.placing) {
          if (!this.alive()) {
            // Deregistered while its payload was arriving: no byte may land after deregister returned.
            this.discard();
            this.onRevoked(this.h);
          } else this.scatter(chunk, off, n);
        }
        off += n;
        this.remaining -= n;
        if (this.remaining === 0) this.onPayloadDone(this.h);
        continue;
      }
      let src: Buffer;
      let at: number;
      if (this.hdrFill === 0 && len - off >= HEADER_LEN) {
        src = chunk;
        at = off;
        off += HEADER_LEN;
      } else {
        const n = Math.min(HEADER_LEN - this.hdrFill, len - off);
        chunk.copy(this.hdrBuf, this.hdrFill, off, off + n);
        this.hdrFill += n;
        off += n;
        if (this.hdrFill < HEADER_LEN) return;
        this.hdrFill = 0;
        src = this.hdrBuf;
        at = 0;
      }
      const err = decodeHeader(src, at, this.h);
      if (err !== null) {
        this.stopped = true;
        this.onMalformed(err, src[at + 2]!);
        return;
      }
      this.discard();
      this.remaining = this.h.payloadLen;
      this.onHeader(this.h);
      if (this.stopped) {
        if (off < len) this.leftover = Buffer.from(chunk.subarray(off, len));
        return;
      }
      if (this.remaining === 0) this.onPayloadDone(this.h);
    }
  }

  /**
   * Reads the rest of the current payload segment straight from the socket
   * into its registered memory (no copy through the read buffer), while at
   * least DIRECT_MIN bytes of it are still to come and every read is whole.
   * Synchronous: each read checks the placement first (as `feed` does for
   * every chunk) and lands inside the segment the header's checks gave;
   * nothing is armed across event-loop turns, so a deregister or a detach
   * between two reads stops the next one. A read that comes back short (the
   * socket is drained) ends the pull, and libuv's own reads go on. One pull
   * reads at most DIRECT_MAX bytes, so one socket callback handles at most a
   * read buffer and DIRECT_MAX.
   */
  pullDirect(read: DirectRead): void {
    let budget = DIRECT_MAX;
    while (this.remaining >= DIRECT_MIN && this.placing && !this.stopped && this.ti < this.nseg && budget > 0) {
      const segLeft = this.segLen[this.ti]! - this.toff;
      if (segLeft < DIRECT_MIN || !this.alive()) return;
      const mr = this.segMr[this.ti]!;
      const want = Math.min(segLeft, this.remaining, budget);
      const n = read(mr.view, this.segOff[this.ti]! + this.toff, want);
      if (n <= 0) return;
      budget -= n;
      this.toff += n;
      if (this.toff === this.segLen[this.ti]!) {
        this.ti++;
        this.toff = 0;
      }
      this.remaining -= n;
      if (this.remaining === 0) {
        this.onPayloadDone(this.h);
        return;
      }
      if (n < want) return;
    }
  }

  private scatter(chunk: Buffer, off: number, n: number): void {
    while (n > 0 && this.ti < this.nseg) {
      const mr = this.segMr[this.ti]!;
      const len = this.segLen[this.ti]!;
      const k = Math.min(n, len - this.toff);
      const v = mr.view;
      const at = this.segOff[this.ti]! + this.toff;
      if (k <= SMALL_COPY) copyWords(dvOf(chunk, chunkDvc), chunk.byteOffset + off, dvOf(v, mr.dvc), v.byteOffset + at, k);
      else v.set(new Uint8Array(chunk.buffer, chunk.byteOffset + off, k), at);
      this.toff += k;
      off += k;
      n -= k;
      if (this.toff === len) {
        this.ti++;
        this.toff = 0;
      }
    }
  }
}
