/**
 * RdmaStream: a `stream.Duplex` of bytes over one RDMA connection, with the
 * shape of a `net.Socket` (so `http.Server` and `http.request` take it).
 *
 * Data moves one-sided, as rsocket's: each side that receives data owns a
 * receive ring of RING bytes (registered memory, allocated when the peer
 * first has data to send, so an idle stream holds none) and shares it with
 * the peer by a random name (`share()`, which has no lease: a stream may live
 * for hours). The writer copies a chunk into registered memory and RDMA
 * WRITEs it WITH IMMEDIATE at the ring's tail; the immediate is the chunk's
 * length (1..MAX_CHUNK). A chunk never wraps: the writer cuts it at the
 * ring's end and goes on at offset 0, so both sides know every chunk's
 * offset from the byte count alone. The reader copies each chunk out (so the
 * ring space is free again at once) and gives ring credit back as the
 * application consumes, so a reader that does not read holds at most RING bytes.
 *
 * Control messages are two-sided (send/receive); byte 0 is the kind:
 *   0x02 FIN: 9 bytes, then a u64 (big-endian): the total bytes this side
 *        wrote; the peer will write no more (half-close). The reader ends
 *        once it has read that many (the FIN may overtake the last WRITEs).
 *   0x03 WND: 5 bytes, a u32 (big-endian, 1..RING): the reader consumed that
 *        much more, the writer may write that much more. A WND that returns
 *        more than was written is a PROTOCOL error.
 *   0x04 RING?: 1 byte: the writer has data; the reader allocates and shares its ring.
 *   0x05 RING: 1 + 1..256 bytes: the UTF-8 name of the reader's shared ring (RING bytes).
 * Anything else, an immediate that runs past the ring or past the credit, a
 * second RING? or an unasked RING is a PROTOCOL error that destroys the
 * stream (the process lives on).
 */
import { Duplex } from "node:stream";
import { isIP } from "node:net";
import { randomUUID } from "node:crypto";
import { RdmaError } from "../errors.js";
import type { LocalMr, RemoteMr } from "../memory/mr.js";
import type { PeerInfo } from "./establish/auth.js";
import type { SharedMr, ShareOptions } from "./shared.js";

/**
 * What a stream uses of its connection (an Rdma). Structural, so this file
 * does not import rdma.ts, which imports it for `createStream()`; a
 * stream's `connection` has its connection's own type (`RdmaStream<Rdma>`).
 */
export interface StreamConnection {
  readonly isClosed: boolean;
  readonly peer: PeerInfo;
  /** Registered memory a control message lives in. */
  allocLocalMr(size: number): LocalMr;
  /** Registers the receive ring in place. */
  registerMr(buffer: ArrayBuffer): LocalMr;
  /** Sends one control message. */
  send(data: LocalMr): Promise<void>;
  /** The next control message. */
  receive(opts: { signal: AbortSignal }): Promise<LocalMr>;
  /** Writes one chunk into the peer's ring (copied into registered memory first). */
  writeWithImm(data: Uint8Array, rmr: RemoteMr, imm: number): Promise<void>;
  /** The length of the next chunk the peer wrote into this side's ring. */
  receiveWriteImm(opts: { signal: AbortSignal }): Promise<number>;
  /** Shares this side's ring with the peer. */
  share(name: string, lmr: LocalMr, opts?: ShareOptions): SharedMr;
  /** Opens the peer's ring. */
  openSharedMr(name: string, opts: { signal: AbortSignal }): Promise<RemoteMr>;
  /** Closes the connection when the stream ends (unless `closeConnection: false`). */
  close(): Promise<void>;
  /** The connection keeps the process alive (stream.ref()). */
  ref(): unknown;
  /** The connection lets the process exit (stream.unref()). */
  unref(): unknown;
}

const FIN = 0x02;
const WND = 0x03;
const RING_REQ = 0x04;
const RING_NAME = 0x05;
/** Bytes of each side's receive ring: what the writer may have written and the reader's application not yet read. */
export const RING = 1024 * 1024;
/** Largest chunk of one WRITE (bigger writes are cut into this). */
export const MAX_CHUNK = 256 * 1024;
/** WRITEs one stream keeps posted at once. */
export const MAX_INFLIGHT = 8;
/** The writable side's buffer: writes made while the ring is full or MAX_INFLIGHT are posted are gathered (writev) into one chunk of up to about this. */
const WRITE_HWM = 256 * 1024;
/** The readable side's high-water mark (as a net.Socket's). */
const READ_HWM = 64 * 1024;
/** Longest ring name a peer may send (as a share name). */
const MAX_NAME = 256;

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
  /** Ring bytes this side allowed the peer to write so far (bytesRead may reach it). */
  private granted = RING;
  /** Ring bytes the peer allowed this side to write so far. */
  private window = RING;
  /** Bytes this side has posted as WRITEs (its offset in the peer's ring is posted % RING). */
  private posted = 0;
  /** The peer's ring once opened; `ringAsked` once RING? went out. */
  private peerRing: RemoteMr | null = null;
  private ringAsked = false;
  /**
   * This side's receive ring (allocated on the peer's RING?), its bytes and
   * its share. The ring is the stream's own ArrayBuffer registered in place,
   * not pool memory: a connection that closes frees its pool (on verbs at
   * once), and chunks the peer wrote before closing are still to be copied out.
   */
  private ring: LocalMr | null = null;
  private ringBytes: Uint8Array | null = null;
  private shared: SharedMr | null = null;
  /** The peer's total from its FIN (-1: none yet). */
  private peerFinAt = -1;
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

  /** Gives the peer back the ring credit the application has consumed (in steps of a quarter ring). */
  private grant(): void {
    const rdma = this.rdma;
    if (!rdma || this.destroyed || this.peerFin) return;
    const give = this.consumed() + RING - this.granted;
    if (give < RING / 4) return;
    this.granted += give;
    const b = Buffer.alloc(5);
    b[0] = WND;
    b.writeUInt32BE(give, 1);
    // Credit for a peer that has closed has nowhere to go: the receive loops, still draining what
    // it wrote before closing, decide whether that close was the normal end.
    this.post(rdma, b, (e) => this.sent(e instanceof RdmaError && e.code === "CONNECTION_CLOSED" ? null : e));
  }

  private protocol(what: string): void {
    this.destroy(new RdmaError("PROTOCOL", `stream: ${what}`));
  }

  /** Receive loops still running (the messages', and the ring's once it exists). */
  private loops = 0;

  /**
   * A receive loop ended with `e`. Each loop takes everything queued before
   * its failure, so once both have ended a closed connection means: the
   * normal end if both directions had ended, a reset otherwise (one loop
   * alone cannot tell: the FIN may still wait in the other's queue).
   */
  private loopFailed(e: unknown): void {
    this.loops--;
    if (this.destroyed) return;
    if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED") {
      if (this.loops > 0) return;
      // The peer closes once both directions ended: after its FIN and ours, that is the normal end.
      if (this.peerFin && (this.writableFinished || this.finSent)) return void this.destroy();
      this.destroy(new RdmaError("CONNECTION_CLOSED", "stream: the peer closed the connection before ending the stream (reset)"));
    } else this.destroy(e instanceof Error ? e : new Error(String(e)));
  }

  /** The peer's data has all been read once its FIN came and its total is in. */
  private checkEnd(): void {
    if (this.peerFin || this.peerFinAt < 0 || this.bytesRead < this.peerFinAt) return;
    this.peerFin = true;
    this.push(null);
  }

  /** Takes every control message the peer sends, as it arrives. */
  private pump(rdma: C): void {
    this.loops++;
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
          if (kind === WND && msg.length === 5) {
            const n = msg.readUInt32BE(1);
            if (n === 0 || this.window + n > this.posted + RING) return this.protocol(`the peer returned ${n} bytes of ring credit, more than was written (${this.posted + RING - this.window} at most)`);
            this.window += n;
            this.sent(null);
            return next();
          }
          if (kind === FIN && msg.length === 9 && this.peerFinAt < 0) {
            const total = msg.readUInt32BE(1) * 2 ** 32 + msg.readUInt32BE(5);
            if (total < this.bytesRead || total > this.granted) return this.protocol(`the peer's FIN counts ${total} bytes, ${this.bytesRead} were read and ${this.granted} allowed`);
            this.peerFinAt = total;
            this.checkEnd();
            return next(); // window updates may still come for what this side writes
          }
          if (kind === RING_REQ && msg.length === 1 && this.ring === null) {
            if (!this.openRing(rdma)) return;
            return next();
          }
          if (kind === RING_NAME && msg.length > 1 && msg.length <= 1 + MAX_NAME && this.ringAsked && this.peerRing === null && !this.ringOpening) {
            this.ringOpening = true;
            rdma.openSharedMr(msg.toString("utf8", 1), { signal: this.stop.signal }).then(
              (rmr) => {
                if (this.destroyed) return void freeRemote(rmr);
                if (rmr.length !== RING) {
                  freeRemote(rmr);
                  return this.protocol(`the peer's ring is ${rmr.length} bytes, not ${RING}`);
                }
                this.peerRing = rmr;
                this.sent(null);
              },
              (e: unknown) => {
                if (this.destroyed) return;
                if (e instanceof RdmaError && e.code === "NOT_FOUND") return this.protocol(`the peer's ring cannot be opened (${e.message})`);
                if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED") return; // the message loop decides
                this.destroy(e instanceof Error ? e : new Error(String(e)));
              },
            );
            return next();
          }
          this.protocol(`malformed message from the peer (kind ${kind}, ${msg.length} bytes)`);
        },
        (e: unknown) => this.loopFailed(e),
      );
    };
    next();
  }

  private ringOpening = false;

  /** The peer has data: allocates this side's ring, shares it and sends its name; takes the peer's WRITEs from then on. */
  private openRing(rdma: C): boolean {
    const name = `async-rdma/stream/${randomUUID()}`;
    try {
      const buffer = new ArrayBuffer(RING);
      this.ring = rdma.registerMr(buffer);
      this.ringBytes = new Uint8Array(buffer);
      this.shared = rdma.share(name, this.ring, { access: "write" });
    } catch (e) {
      this.destroy(e as Error);
      return false;
    }
    const b = Buffer.alloc(1 + Buffer.byteLength(name));
    b[0] = RING_NAME;
    b.write(name, 1);
    this.post(rdma, b, (e) => this.sent(e));
    this.drainRing(rdma);
    return true;
  }

  /** Takes each chunk the peer WRITEs into the ring, as it arrives (the ring credit bounds them). */
  private drainRing(rdma: C): void {
    this.loops++;
    const next = (): void => {
      if (this.destroyed) return;
      rdma.receiveWriteImm({ signal: this.stop.signal }).then((len) => {
        const ring = this.ringBytes;
        if (this.destroyed || !ring) return;
        const off = this.bytesRead % RING;
        if (len < 1 || len > MAX_CHUNK || off + len > RING) return this.protocol(`the peer wrote a chunk of ${len} bytes at ring offset ${off} (the ring is ${RING} bytes, a chunk at most ${MAX_CHUNK})`);
        if (this.bytesRead + len > this.granted) return this.protocol(`the peer wrote past the ring credit it was given (${this.granted - this.bytesRead} bytes left, got ${len})`);
        if (this.peerFinAt >= 0 && this.bytesRead + len > this.peerFinAt) return this.protocol(`the peer wrote past the end its FIN announced (${this.peerFinAt} bytes)`);
        const data = Buffer.from(ring.subarray(off, off + len)); // a copy: that ring space is free again
        this.bytesRead += len;
        this.touch();
        if (this.push(data)) this.grant();
        this.checkEnd();
        next();
      }, (e: unknown) => this.loopFailed(e));
    };
    next();
  }

  // ---- writable side

  /** Sends one control message (copied into registered memory). */
  private post(rdma: C, msg: Uint8Array, cb: (e: Error | null) => void): void {
    let mr: LocalMr;
    try {
      mr = rdma.allocLocalMr(msg.length);
      mr.bytes.set(msg);
    } catch (e) {
      return cb(e as Error);
    }
    this.inflight++;
    const m = mr;
    rdma.send(m).then(
      () => {
        m.dispose();
        this.inflight--;
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

  /** WRITEs `len` bytes of `data` at the tail of the peer's ring. */
  private postData(rdma: C, ring: RemoteMr, data: Uint8Array, start: number, len: number): void {
    const at = this.posted % RING;
    this.posted += len;
    this.inflight++;
    let p: Promise<void>;
    try {
      p = rdma.writeWithImm(data.subarray(start, start + len), ring.slice(at, at + len), len);
    } catch (e) {
      p = Promise.reject(e as Error);
    }
    p.then(
      () => {
        this.inflight--;
        this.bytesWritten += len;
        this.sent(null);
      },
      (e: unknown) => {
        this.inflight--;
        this.sent(e instanceof Error ? e : new Error(String(e)));
      },
    );
  }

  /** WRITEs `data` into the peer's ring; `cb` once the ring has room for more. */
  private sendData(data: Uint8Array, cb: (e?: Error | null) => void): void {
    this.withConn((rdma) => {
      if (this.failed) return cb(this.failed);
      this.touch();
      let off = 0;
      const step = (): void => {
        if (this.failed) return cb(this.failed);
        const ring = this.peerRing;
        if (!ring) {
          if (!this.ringAsked) {
            this.ringAsked = true;
            this.post(rdma, Buffer.of(RING_REQ), (e) => this.sent(e));
          }
          this.waiting = step;
          return;
        }
        while (off < data.length) {
          const room = this.window - this.posted;
          if (this.inflight >= MAX_INFLIGHT || room <= 0) {
            this.waiting = step;
            return;
          }
          // a chunk never wraps: cut at the ring's end, the next one starts at 0
          const len = Math.min(MAX_CHUNK, data.length - off, room, RING - (this.posted % RING));
          this.postData(rdma, ring, data, off, len);
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
    if (w && ((this.peerRing !== null && this.inflight < MAX_INFLIGHT && this.window > this.posted) || this.failed)) {
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

  /** Duplex: `end()` — the end of this side's bytes goes to the peer (half-close), once every WRITE completed. */
  override _final(cb: (e?: Error | null) => void): void {
    this.withConn((rdma) => {
      const fin = (): void => {
        if (this.failed) return cb(this.failed);
        this.finSent = true;
        const b = Buffer.alloc(9);
        b[0] = FIN;
        b.writeUInt32BE(Math.floor(this.posted / 2 ** 32), 1);
        b.writeUInt32BE(this.posted % 2 ** 32, 5);
        this.post(rdma, b, (e) => {
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
    if (this.peerRing) freeRemote(this.peerRing);
    this.peerRing = null;
    // The ring is freed once the peer can no longer reach it (the share revoked in order, or the connection gone).
    const ring = this.ring;
    const shared = this.shared;
    this.ring = null;
    this.ringBytes = null;
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
    const freed = revoked.then(freeRing, freeRing);
    if (!this.ownsConn) return void freed.then(() => cb(err));
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

function freeRemote(rmr: RemoteMr): void {
  try {
    rmr.dispose();
  } catch {
    /* closed with its connection */
  }
}

/** @internal rdma.createStream() */
export function createStream<C extends StreamConnection>(rdma: C, opts?: StreamOptions): RdmaStream<C> {
  if (opts !== undefined && (opts === null || typeof opts !== "object")) throw new RdmaError("INVALID_ARGUMENT", "createStream: options must be an object");
  return new RdmaStream<C>(rdma, opts ?? {});
}
