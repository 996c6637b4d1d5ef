/**
 * RdmaStream: a `stream.Duplex` of bytes over one RDMA connection, with the
 * shape of a `net.Socket` (so `http.Server` and `http.request` take it).
 *
 * Wire: every stream message is one two-sided message (send/receive, so the
 * connection's credits carry the back-pressure and large chunks go by the
 * connection's rendezvous READ). Byte 0 is the kind:
 *   0x01 DATA: the rest (1..MAX_CHUNK bytes) is stream data, in order;
 *   0x02 FIN: exactly one byte; the peer will write no more (half-close);
 *   0x03 WND: 5 bytes, a u32 (big-endian, 1..WINDOW): the reader consumed that
 *        much more, the writer may send that much more.
 * Anything else is a PROTOCOL error that destroys the stream (the process lives on).
 *
 * Back-pressure, as rsocket: a byte window per direction. The reader takes
 * every message as it arrives (so the connection's credits and rendezvous
 * never wait on the application) and gives window back as the application
 * consumes; the writer sends only within the window and keeps at most
 * MAX_INFLIGHT messages posted. Past either, write callbacks wait, so
 * `write()` returns false once the writable buffer is full and 'drain'
 * follows. A reader that does not read holds at most WINDOW bytes.
 */
import { Duplex } from "node:stream";
import { isIP } from "node:net";
import { RdmaError } from "../errors.js";
import type { LocalMr } from "../memory/mr.js";
import type { PeerInfo } from "./establish/auth.js";

/**
 * What a stream uses of its connection (an Rdma). Structural, so this file
 * does not import rdma.ts, which imports it for `createStream()`; a
 * stream's `connection` has its connection's own type (`RdmaStream<Rdma>`).
 */
export interface StreamConnection {
  readonly isClosed: boolean;
  readonly peer: PeerInfo;
  /** Registered memory a stream message is built in. */
  allocLocalMr(size: number): LocalMr;
  /** Sends one stream message. */
  send(data: LocalMr): Promise<void>;
  /** The next stream message. */
  receive(opts: { signal: AbortSignal }): Promise<LocalMr>;
  /** Closes the connection when the stream ends (unless `closeConnection: false`). */
  close(): Promise<void>;
  /** The connection keeps the process alive (stream.ref()). */
  ref(): unknown;
  /** The connection lets the process exit (stream.unref()). */
  unref(): unknown;
}

const DATA = 0x01;
const FIN = 0x02;
const WND = 0x03;
/** Bytes each side may send before the reader gives window back (what a reader that does not read holds). */
export const WINDOW = 4 * 1024 * 1024;
/** Largest payload of one DATA message (bigger writes are cut into this). */
export const MAX_CHUNK = 256 * 1024;
/** Messages one stream keeps posted at once. */
export const MAX_INFLIGHT = 4;
/** The writable side's buffer: writes made while MAX_INFLIGHT messages are posted are gathered (writev) into one message of up to about this. */
const WRITE_HWM = 256 * 1024;
/** The readable side's high-water mark (as a net.Socket's). */
const READ_HWM = 64 * 1024;

/** Options of {@link Rdma.createStream} and of `async-rdma/net` sockets. */
export interface StreamOptions {
  /** false (default, as `net.Socket`): the stream ends its writable side once the peer's has ended. */
  allowHalfOpen?: boolean;
  /** Whether destroying the stream, or its end in both directions, closes the connection (default true). */
  closeConnection?: boolean;
}

/** Connections that carry a stream (one at a time). */
const streams = new WeakSet<object>();

/**
 * A Duplex over an RDMA connection. Created by {@link Rdma.createStream},
 * by `async-rdma/net`'s `connect()`, or handed to a server's 'connection' listener.
 */
export class RdmaStream<C extends StreamConnection = StreamConnection> extends Duplex {
  private rdma: C | null = null;
  private ownsConn = true;
  /** Bytes this side allowed the peer to send so far (its window). */
  private granted = WINDOW;
  /** Bytes the peer allowed this side to send so far. */
  private window = WINDOW;
  /** Bytes this side has posted as DATA. */
  private posted = 0;
  private peerFin = false;
  private finSent = false;
  private inflight = 0;
  private waiting: (() => void) | null = null;
  private idleWaiters: (() => void)[] = [];
  private failed: Error | null = null;
  private queued: ((rdma: C) => void)[] = [];
  private timeoutMs = 0;
  private timer: NodeJS.Timeout | null = null;
  /** The peer's address (as `net.Socket`). */
  remoteAddress: string | undefined = undefined;
  /** The peer's port (as `net.Socket`). */
  remotePort: number | undefined = undefined;
  /** "IPv4" or "IPv6". */
  remoteFamily: string | undefined = undefined;
  /** Bytes received (stream data, without framing). */
  bytesRead = 0;
  /** Bytes written by the application and sent (stream data). */
  bytesWritten = 0;
  /** True until the connection is established. */
  connecting = false;

  /** @internal */
  constructor(rdma: C | null, opts: StreamOptions = {}) {
    super({ allowHalfOpen: opts.allowHalfOpen ?? false, writableHighWaterMark: WRITE_HWM, readableHighWaterMark: READ_HWM, emitClose: true, autoDestroy: true, decodeStrings: true });
    this.ownsConn = opts.closeConnection ?? true;
    if (rdma) this.attach(rdma);
    else this.connecting = true;
  }

  /** @internal The connection this stream runs on, once it exists. */
  attach(rdma: C): void {
    if (streams.has(rdma)) throw new RdmaError("INVALID_STATE", "createStream: this connection already carries a stream (one at a time)");
    if (rdma.isClosed) throw new RdmaError("CONNECTION_CLOSED", "createStream: the connection is closed");
    streams.add(rdma);
    this.rdma = rdma;
    this.connecting = false;
    this.remoteAddress = rdma.peer.address;
    this.remotePort = rdma.peer.port;
    this.remoteFamily = isIP(rdma.peer.address) === 6 ? "IPv6" : "IPv4";
    this.pump(rdma);
    if (!this.refed) this.applyRef();
    const p = this.queued;
    this.queued = [];
    for (const f of p) f(rdma);
  }

  /** The connection under the stream (null while connecting). */
  get connection(): C | null {
    return this.rdma;
  }

  /** "opening", "open", "readOnly", "writeOnly" or "closed" (as `net.Socket`). */
  get readyState(): string {
    if (this.connecting) return "opening";
    if (this.destroyed) return "closed";
    const r = this.readable;
    const w = this.writable;
    return r && w ? "open" : r ? "readOnly" : w ? "writeOnly" : "closed";
  }

  /** Whether the stream is not yet connected (as `net.Socket`). */
  get pending(): boolean {
    return this.rdma === null;
  }

  private withConn(f: (rdma: C) => void): void {
    if (this.rdma) f(this.rdma);
    else this.queued.push(f);
  }

  // ---- readable side

  /** Duplex: the reader wants more (the stream returns window to the peer as it is read). */
  override _read(): void {
    this.withConn(() => this.grant());
  }

  /** Bytes the application has taken from the readable side. */
  private consumed(): number {
    return this.bytesRead - this.readableLength;
  }

  /** Gives the peer back the window the application has consumed (in steps of a quarter window). */
  private grant(): void {
    const rdma = this.rdma;
    if (!rdma || this.destroyed || this.peerFin) return;
    const give = this.consumed() + WINDOW - this.granted;
    if (give < WINDOW / 4) return;
    this.granted += give;
    this.post(rdma, WND, null, 0, 0, (e) => this.sent(e), give);
  }

  /** Takes every message the peer sends, as it arrives (the byte window bounds them). */
  private pump(rdma: C): void {
    const next = (): void => {
      if (this.destroyed) return;
      rdma.receive({ signal: this.stop.signal }).then(
        (mr) => {
          if (this.destroyed) return void mr.dispose();
          let msg: Buffer;
          try {
            msg = Buffer.from(mr.bytes); // a copy: the registered buffer goes back to the pool at once
          } finally {
            mr.dispose();
          }
          const kind = msg.length > 0 ? msg[0] : -1;
          if (kind === DATA && msg.length > 1 && msg.length <= MAX_CHUNK + 1 && !this.peerFin) {
            const data = msg.subarray(1);
            if (this.bytesRead + data.length > this.granted) {
              return void this.destroy(new RdmaError("PROTOCOL", `stream: the peer sent past the window it was given (${this.granted - this.bytesRead} bytes left, got ${data.length})`));
            }
            this.bytesRead += data.length;
            this.touch();
            if (this.push(data)) this.grant();
            return next();
          }
          if (kind === WND && msg.length === 5) {
            const n = msg.readUInt32BE(1);
            if (n > 0 && n <= WINDOW) {
              this.window += n;
              this.sent(null);
              return next();
            }
          }
          if (kind === FIN && msg.length === 1 && !this.peerFin) {
            this.peerFin = true;
            this.push(null);
            return next(); // window updates may still come for what this side writes
          }
          this.destroy(new RdmaError("PROTOCOL", `stream: malformed message from the peer (kind ${kind}, ${msg.length} bytes)`));
        },
        (e: unknown) => {
          if (this.destroyed) return;
          if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED") {
            // The peer closes once both directions ended: after its FIN and ours, that is the normal end.
            if (this.peerFin && (this.writableFinished || this.finSent)) return void this.destroy();
            this.destroy(new RdmaError("CONNECTION_CLOSED", "stream: the peer closed the connection before ending the stream (reset)"));
          } else this.destroy(e instanceof Error ? e : new Error(String(e)));
        },
      );
    };
    next();
  }

  // ---- writable side

  private post(rdma: C, kind: number, data: Uint8Array | null, start: number, len: number, cb: (e: Error | null) => void, wnd = 0): void {
    let mr;
    try {
      mr = rdma.allocLocalMr(kind === WND ? 5 : 1 + len);
      const b = mr.bytes;
      b[0] = kind;
      if (data) b.set(data.subarray(start, start + len), 1);
      if (kind === WND) new DataView(b.buffer, b.byteOffset, 5).setUint32(1, wnd);
    } catch (e) {
      return cb(e as Error);
    }
    this.inflight++;
    const m = mr;
    rdma.send(m).then(
      () => {
        m.dispose();
        this.inflight--;
        this.bytesWritten += len;
        cb(null);
      },
      (e: unknown) => {
        try {
          m.dispose();
        } catch {
          /* freed with its connection */
        }
        this.inflight--;
        cb(e instanceof Error ? e : new Error(String(e)));
      },
    );
  }

  /** Posts `data` as DATA messages; `cb` once the window has room for more. */
  private sendData(data: Uint8Array, cb: (e?: Error | null) => void): void {
    this.withConn((rdma) => {
      if (this.failed) return cb(this.failed);
      this.touch();
      let off = 0;
      const step = (): void => {
        while (off < data.length) {
          const room = this.window - this.posted;
          if (this.inflight >= MAX_INFLIGHT || room <= 0) {
            this.waiting = step;
            return;
          }
          const len = Math.min(MAX_CHUNK, data.length - off, room);
          this.posted += len;
          this.post(rdma, DATA, data, off, len, (e) => this.sent(e));
          off += len;
        }
        if (this.inflight >= MAX_INFLIGHT) {
          this.waiting = () => cb(this.failed);
          return;
        }
        cb(this.failed);
      };
      step();
    });
  }

  private sent(e: Error | null): void {
    if (e && !this.failed) {
      this.failed = e;
      if (!this.destroyed) this.destroy(e);
    }
    const w = this.waiting;
    if (w && ((this.inflight < MAX_INFLIGHT && this.window > this.posted) || this.failed)) {
      this.waiting = null;
      w();
    }
    if (this.inflight === 0) {
      const ws = this.idleWaiters;
      this.idleWaiters = [];
      for (const f of ws) f();
    }
  }

  /** Duplex: one chunk to send. */
  override _write(chunk: Buffer, _enc: BufferEncoding, cb: (e?: Error | null) => void): void {
    if (chunk.length === 0) return cb();
    this.sendData(chunk, cb);
  }

  /** Duplex: chunks written meanwhile, gathered into one message. */
  override _writev(chunks: { chunk: Buffer }[], cb: (e?: Error | null) => void): void {
    const data = chunks.length === 1 ? chunks[0]!.chunk : Buffer.concat(chunks.map((c) => c.chunk));
    if (data.length === 0) return cb();
    this.sendData(data, cb);
  }

  /** Duplex: `end()` — the end of this side's bytes goes to the peer (half-close). */
  override _final(cb: (e?: Error | null) => void): void {
    this.withConn((rdma) => {
      const fin = (): void => {
        if (this.failed) return cb(this.failed);
        this.finSent = true;
        this.post(rdma, FIN, null, 0, 0, (e) => {
          // The peer closes only once both directions ended: a FIN whose completion lost that race had arrived.
          if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED" && this.readableEnded) e = null;
          this.sent(e);
          cb(e);
        });
      };
      if (this.inflight === 0) fin();
      else this.idleWaiters.push(fin);
    });
  }

  /** Duplex: `destroy()` — stops at once and closes the connection (unless `closeConnection: false`). */
  override _destroy(err: Error | null, cb: (e?: Error | null) => void): void {
    this.clearTimer();
    const rdma = this.rdma;
    if (!rdma) {
      // never connected: whoever attaches later finds the stream destroyed
      this.queued = [];
      return cb(err);
    }
    streams.delete(rdma);
    this.stop.abort();
    if (!this.ownsConn) return cb(err);
    rdma.close().then(
      () => cb(err),
      () => cb(err),
    );
  }

  // ---- net.Socket's knobs

  /** Accepted for `net.Socket` compatibility: an RDMA message is sent as soon as it is written (there is no Nagle). */
  setNoDelay(_noDelay?: boolean): this {
    return this;
  }

  /** Accepted for `net.Socket` compatibility: the connection's own keepalive (RdmaBuilder.setKeepalive) always runs. */
  setKeepAlive(_enable?: boolean, _initialDelay?: number): this {
    return this;
  }

  /**
   * As `net.Socket`: 'timeout' after `ms` without reads or writes (0 turns it off).
   * The stream is not ended; listen to 'timeout' and end it yourself.
   */
  setTimeout(ms: number, cb?: () => void): this {
    this.timeoutMs = ms > 0 ? ms : 0;
    if (cb) {
      if (this.timeoutMs > 0) this.once("timeout", cb);
      else this.removeListener("timeout", cb);
    }
    this.touch();
    return this;
  }

  /** The stream's idle timeout in ms (0: none). */
  get timeout(): number | undefined {
    return this.timeoutMs || undefined;
  }

  private touch(): void {
    if (this.timeoutMs === 0) return this.clearTimer();
    if (this.timer) return void this.timer.refresh();
    this.timer = setTimeout(() => {
      this.timer = null;
      if (!this.destroyed) this.emit("timeout");
    }, this.timeoutMs).unref();
  }

  private clearTimer(): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
  }

  /**
   * As `net.Socket`: whether this stream keeps the process alive. Forwarded
   * to the connection's own `ref()`/`unref()` when the connection has them;
   * where it does not, the open connection keeps the process alive whatever
   * is asked here.
   */
  ref(): this {
    this.refed = true;
    this.applyRef();
    return this;
  }

  /** Lets the process exit while this stream is open and idle (undoes `ref()`; see it). */
  unref(): this {
    this.refed = false;
    this.applyRef();
    return this;
  }

  private refed = true;
  /** Aborts the stream's waiting receive when it ends, so a connection it leaves open loses no message. */
  private readonly stop = new AbortController();
  private applyRef(): void {
    const c = this.rdma as unknown as { ref?: () => unknown; unref?: () => unknown } | null;
    if (!c) return;
    if (this.refed) c.ref?.();
    else c.unref?.();
  }

  /** `{ address, family, port }` of the peer's side (this side's local address is not tracked by the connection). */
  address(): { address: string; family: string; port: number } | Record<string, never> {
    return this.remoteAddress === undefined ? {} : { address: this.remoteAddress, family: this.remoteFamily ?? "IPv4", port: this.remotePort ?? 0 };
  }

  /** Closes the stream (and the connection under it) without ending it: the peer gets an error, as for a reset socket. */
  resetAndDestroy(): this {
    return this.destroy();
  }
}

/** @internal rdma.createStream() */
export function createStream<C extends StreamConnection>(rdma: C, opts?: StreamOptions): RdmaStream<C> {
  if (opts !== undefined && (opts === null || typeof opts !== "object")) throw new RdmaError("INVALID_ARGUMENT", "createStream: options must be an object");
  return new RdmaStream<C>(rdma, opts ?? {});
}
