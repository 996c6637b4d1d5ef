/**
 * Stream → frames. Each header is decoded and validated by the codec (size
 * and format; a malformed one stops the reader with a reason); a payload is
 * copied straight into its placement (registered memory) as bytes arrive,
 * with no reassembly buffer, and only while the placement's guard says the
 * memory is still registered. What a frame *means* is the handlers' business.
 */
import { HEADER_LEN, decodeHeader, newHeader, type DecodedHeader } from "./codec.js";

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
  private targets: Uint8Array[] | null = null;
  /** Checked before every placement: false once the target memory was deregistered. */
  private guard: (() => boolean) | null = null;
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

  /** Called from onHeader: where the payload goes (null = discard), and what keeps it valid. */
  place(targets: Uint8Array[] | null, guard: (() => boolean) | null = null): void {
    this.targets = targets;
    this.guard = guard;
    this.ti = 0;
    this.toff = 0;
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
        if (this.targets !== null) {
          if (this.guard !== null && !this.guard()) {
            // Deregistered while its payload was arriving: no byte may land after deregister returned.
            this.targets = null;
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
      this.targets = null;
      this.guard = null;
      this.remaining = this.h.payloadLen;
      this.onHeader(this.h);
      if (this.stopped) {
        if (off < len) this.leftover = Buffer.from(chunk.subarray(off, len));
        return;
      }
      if (this.remaining === 0) this.onPayloadDone(this.h);
    }
  }

  private scatter(chunk: Buffer, off: number, n: number): void {
    const ts = this.targets!;
    while (n > 0 && this.ti < ts.length) {
      const t = ts[this.ti]!;
      const k = Math.min(n, t.length - this.toff);
      chunk.copy(t, this.toff, off, off + k);
      this.toff += k;
      off += k;
      n -= k;
      if (this.toff === t.length) {
        this.ti++;
        this.toff = 0;
      }
    }
  }
}
