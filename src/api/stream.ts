/**
 * RdmaStream: a `stream.Duplex` of bytes over one RDMA connection, with the
 * shape of a `net.Socket` (so `http.Server` and `http.request` take it).
 *
 * Data moves one-sided, as rsocket's: each side that receives data owns a
 * receive ring of RING bytes (registered memory, allocated when the peer
 * first has data to send, so an idle stream holds none) and shares it with
 * the peer by a random name (`share()`, which has no lease: a stream may live
 * for hours). The writer copies a chunk into its send ring (registered once,
 * the same size, the chunk at the same offset) and RDMA WRITEs it WITH
 * IMMEDIATE from there at the ring's tail; the immediate is the chunk's
 * length (1..MAX_CHUNK). The reader copies each chunk out (so the ring space
 * is free again at once) and gives ring credit back as the application
 * consumes. The parts: the control messages' bytes (stream-wire.ts), the
 * credit both ways, the chunk rules and the ring memory (stream-ring.ts),
 * the idle timeout (stream-idle.ts), what a stream sees of its connection
 * (stream-connection.ts).
 *
 * Invariant of this file, the Duplex glue: every message and chunk from the
 * peer is judged against that state before it counts; anything malformed or
 * unwelcome (an immediate past the ring or the credit, a second RING?, an
 * unasked RING) is a PROTOCOL error that destroys the stream (the process
 * lives on); the stream ends cleanly only once both directions ended.
 */
import { Duplex } from "node:stream";
import { isIP } from "node:net";
import { RdmaError } from "../errors.js";
import type { LocalMr, RemoteMr } from "../memory/mr.js";
import type { OnRead, StreamConnection, StreamOptions } from "./stream-connection.js";
import { MAX_CHUNK, MAX_INFLIGHT, RING, PeerRing, ReceiveRing, RingCredit, SendRing } from "./stream-ring.js";
import { controlMr, decodeControl, describeControl, encodeFin, encodeRingName, encodeRingRequest, encodeWnd, sendControl } from "./stream-wire.js";
import { IdleTimer } from "./stream-idle.js";

export type { OnRead, StreamConnection, StreamOptions };
export { MAX_CHUNK, MAX_INFLIGHT, RING };

/** The writable side's buffer: writes made while the ring is full or MAX_INFLIGHT are posted wait in it, then are copied into the send ring together (writev). */
const WRITE_HWM = 256 * 1024;
/** The readable side's high-water mark (as a net.Socket's). */
const READ_HWM = 64 * 1024;
/** How long a stream destroyed after its end was sent waits for the peer to receive it before the connection closes anyway. */
const END_FLUSH_MS = 2000;

/** Connections that carry a stream (one at a time). */
const streams = new WeakSet<object>();

/**
 * A Duplex over an RDMA connection. Created by {@link Rdma.createStream},
 * by `async-rdma/net`'s `connect()`, or handed to a server's 'connection' listener.
 */
export class RdmaStream<C extends StreamConnection = StreamConnection> extends Duplex {
  private rdma: C | null = null;
  private ownsConn = true;
  /** Ring credit both ways, and the peer's FIN total. */
  private readonly credit = new RingCredit();
  /** The peer's ring: asked for (RING?), then opened (see stream-ring.ts). */
  private readonly peerRing = new PeerRing();
  /** This side's receive ring (allocated on the peer's RING?, see stream-ring.ts). */
  private readonly recvRing = new ReceiveRing();
  /** This side's send ring (registered on the first write, see stream-ring.ts). */
  private readonly sendRing = new SendRing();
  private peerFin = false;
  private finSent = false;
  private inflight = 0;
  private waiting: (() => void) | null = null;
  private idleWaiters: (() => void)[] = [];
  private failed: Error | null = null;
  private queued: ((rdma: C) => void)[] = [];
  /** The idle timeout (setTimeout), restarted by every read and write. */
  private readonly idle = new IdleTimer(() => {
    if (!this.destroyed) this.emit("timeout");
  });
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
  /** The `onread` option: bytes go to its callback instead of 'data' (null: the Readable gets them). */
  private readonly onread: OnRead | null;
  /** With `onread`: bytes handed to its callback (the rest of bytesRead waits in the ring). */
  private delivered = 0;
  private deliverScheduled = false;
  /**
   * With `onread`: delivery stopped (pause(), or a callback's false), as
   * net's readStop; not the Readable's flowing state, which a 'readable'
   * listener also turns off.
   */
  private stopped = false;

  /** @internal */
  constructor(rdma: C | null, opts: StreamOptions = {}) {
    super({ allowHalfOpen: opts.allowHalfOpen ?? false, writableHighWaterMark: WRITE_HWM, readableHighWaterMark: READ_HWM, emitClose: true, autoDestroy: true, decodeStrings: true });
    this.onread = checkOnRead(opts.onread);
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

  /** Bytes the application has taken from the readable side (with `onread`: handed to its callback). */
  private consumed(): number {
    return this.onread !== null ? this.delivered : this.bytesRead - this.readableLength;
  }

  /** Gives the peer back the ring credit the application has consumed (in steps of a quarter ring). */
  private grant(): void {
    const rdma = this.rdma;
    if (!rdma || this.destroyed || this.peerFin || this.allIn()) return;
    const give = this.credit.give(this.consumed());
    if (give === 0) return;
    const b = encodeWnd(give);
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
      // The peer closes once both directions ended: after its FIN and ours, that is the normal end
      // (with onread, bytes may still wait in the ring, undelivered: the stream ends once they are).
      if (this.allIn() && (this.writableFinished || this.finSent)) {
        if (this.peerFin) this.destroy();
        return;
      }
      // The peer ended its side, then closed (destroyed right after end()): all its data is here. With
      // nothing of ours waiting to go, the stream ends as if the peer had waited: the readable side ends
      // once read, and this side's end meets the closed connection as one that arrived (_final).
      if (this.allIn() && this.inflight === 0 && this.writableLength === 0) return;
      this.destroy(new RdmaError("CONNECTION_CLOSED", "stream: the peer closed the connection before ending the stream (reset)"));
    } else this.destroy(e instanceof Error ? e : new Error(String(e)));
  }

  /** The peer's FIN came and every byte it counts has arrived (with `onread`, some may wait in the ring, undelivered). */
  private allIn(): boolean {
    return this.credit.peerFinAt >= 0 && this.bytesRead >= this.credit.peerFinAt;
  }

  /** The peer's data has all been read once its FIN came and its total is in (with `onread`: delivered). */
  private checkEnd(): void {
    // as net: a socket whose onread delivery is stopped sees its end only once it goes on
    if (this.onread !== null && this.stopped) return;
    if (this.peerFin || this.credit.peerFinAt < 0 || (this.onread !== null ? this.delivered : this.bytesRead) < this.credit.peerFinAt) return;
    this.peerFin = true;
    this.push(null);
    // With onread nothing is ever buffered: read(0) lets 'end' out even if no one made the stream flow (as net)
    if (this.onread !== null) this.read(0);
  }

  /**
   * With `onread`: copies what waits in the ring into the caller's buffer and
   * calls back, until all is delivered or the stream is paused; then gives
   * the ring credit back. A callback that throws destroys the stream with
   * that error (the process lives on).
   */
  private deliver(): void {
    const o = this.onread!;
    while (!this.destroyed && !this.stopped && this.delivered < this.bytesRead) {
      const ring = this.recvRing.bytes;
      if (!ring) return;
      let buf: Uint8Array;
      let more: boolean | void;
      try {
        buf = typeof o.buffer === "function" ? o.buffer() : o.buffer;
        if (!(buf instanceof Uint8Array) || buf.length === 0) throw new RdmaError("INVALID_ARGUMENT", "stream: onread.buffer() must return a non-empty Uint8Array");
        const off = this.delivered % RING;
        // bytes are at stream offset % RING (a chunk never wraps), so a span ends at most at the ring's end
        const n = Math.min(this.bytesRead - this.delivered, RING - off, buf.length);
        buf.set(ring.subarray(off, off + n));
        this.delivered += n;
        more = o.callback(n, buf);
      } catch (e) {
        this.destroy(e instanceof Error ? e : new Error(String(e)));
        return;
      }
      if (more === false) this.pause();
    }
    if (this.destroyed) return;
    this.grant();
    this.checkEnd();
  }

  /** As `net.Socket`: with `onread`, also stops delivery (as net stops reading), until `resume()` or `read()`. */
  override pause(): this {
    if (this.onread !== null) this.stopped = true;
    return super.pause();
  }

  /** As `net.Socket`: with `onread`, read() also goes on with a stopped delivery (the return type is Readable.read's). */
  override read(n?: number): any {
    if (this.onread !== null && this.stopped) this.restart();
    return super.read(n);
  }

  /** As `net.Socket`: with `onread`, delivery goes on where `pause()` or a callback's false stopped it. */
  override resume(): this {
    super.resume();
    if (this.onread !== null) this.restart();
    return this;
  }

  /** With `onread`: delivery goes on, from the next tick (never inside the caller's resume() or read()). */
  private restart(): void {
    this.stopped = false;
    if (!this.deliverScheduled) {
      this.deliverScheduled = true;
      process.nextTick(() => {
        this.deliverScheduled = false;
        if (this.rdma && !this.destroyed) this.deliver();
      });
    }
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
          const c = decodeControl(msg);
          if (c?.kind === "wnd") {
            const bad = this.credit.windowUpdate(c.n);
            if (bad !== null) return this.protocol(bad);
            this.sent(null);
            return next();
          }
          if (c?.kind === "fin" && this.credit.peerFinAt < 0) {
            const bad = this.credit.fin(c.total, this.bytesRead);
            if (bad !== null) return this.protocol(bad);
            this.checkEnd();
            return next(); // window updates may still come for what this side writes
          }
          if (c?.kind === "ringRequest" && this.recvRing.mr === null) {
            if (!this.openRing(rdma)) return;
            return next();
          }
          if (c?.kind === "ringName" && this.peerRing.welcome()) {
            this.peerRing.open(rdma, c.name, this.stop.signal, { gone: () => this.destroyed, protocol: (what) => this.protocol(what), opened: () => this.sent(null), fail: (e) => this.destroy(e) });
            return next();
          }
          this.protocol(`malformed message from the peer (${describeControl(msg)})`);
        },
        (e: unknown) => this.loopFailed(e),
      );
    };
    next();
  }

  /** The peer has data: allocates this side's ring, shares it and sends its name; takes the peer's WRITEs from then on. */
  private openRing(rdma: C): boolean {
    let name: string;
    try {
      name = this.recvRing.open(rdma);
    } catch (e) {
      this.destroy(e as Error);
      return false;
    }
    this.post(rdma, encodeRingName(name), (e) => this.sent(e));
    this.drainRing(rdma);
    return true;
  }

  /** Takes each chunk the peer WRITEs into the ring, as it arrives (the ring credit bounds them). */
  private drainRing(rdma: C): void {
    this.loops++;
    const next = (): void => {
      if (this.destroyed) return;
      rdma.receiveWriteImm({ signal: this.stop.signal }).then((len) => {
        const ring = this.recvRing.bytes;
        if (this.destroyed || !ring) return;
        const bad = this.credit.chunkError(len, this.bytesRead);
        if (bad !== null) return this.protocol(bad);
        if (this.onread !== null) {
          // the chunk waits in the ring until delivered: the credit keeps the peer off undelivered bytes
          this.bytesRead += len;
          this.idle.touch();
          this.deliver();
          return next();
        }
        const off = this.bytesRead % RING;
        // a copy (that ring space is free again), into a buffer no one zeroed first: every byte is written
        const data = Buffer.allocUnsafe(len);
        data.set(ring.subarray(off, off + len));
        this.bytesRead += len;
        this.idle.touch();
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
      mr = controlMr(rdma, msg);
    } catch (e) {
      return cb(e as Error);
    }
    this.inflight++;
    sendControl(rdma, mr, (e) => {
      this.inflight--;
      cb(e);
    });
  }

  /** Ring bytes this side may copy and WRITE now: within the peer's credit and its own send ring's free space. */
  private room(): number {
    return Math.min(this.credit.room(), this.sendRing.room(this.credit.posted));
  }

  /** WRITEs the `len` bytes just copied into the send ring at the tail of the peer's ring. */
  private postData(rdma: C, ring: RemoteMr, src: LocalMr, len: number): void {
    const at = this.credit.post(len);
    const end = this.credit.posted;
    this.sendRing.posted(end);
    this.inflight++;
    let p: Promise<void>;
    try {
      p = rdma.writeWithImm(src.slice(at, at + len), ring.slice(at, at + len), len);
    } catch (e) {
      p = Promise.reject(e as Error);
    }
    p.then(
      () => {
        this.inflight--;
        this.sendRing.complete(end);
        this.bytesWritten += len;
        this.sent(null);
      },
      (e: unknown) => {
        this.inflight--;
        this.sent(e instanceof Error ? e : new Error(String(e)));
      },
    );
  }

  /** Copies `chunks` into the send ring and WRITEs them into the peer's ring; `cb` once all are copied and the ring has room for more. */
  private sendData(chunks: readonly Uint8Array[], cb: (e?: Error | null) => void): void {
    this.withConn((rdma) => {
      if (this.failed) return cb(this.failed);
      this.idle.touch();
      let left = 0;
      for (const c of chunks) left += c.length;
      if (left === 0) return cb();
      // where the next byte to copy is: chunk ci, offset co
      let ci = 0;
      let co = 0;
      const step = (): void => {
        if (this.failed) return cb(this.failed);
        const ring = this.peerRing.rmr;
        if (!ring) {
          if (!this.peerRing.asked) {
            this.peerRing.asked = true;
            this.post(rdma, encodeRingRequest(), (e) => this.sent(e));
          }
          this.waiting = step;
          return;
        }
        if (this.sendRing.mr === null) {
          try {
            this.sendRing.open(rdma);
          } catch (e) {
            this.destroy(e as Error);
            return cb(e as Error);
          }
        }
        const src = this.sendRing.mr!;
        const bytes = this.sendRing.bytes!;
        while (left > 0) {
          const room = this.room();
          if (this.inflight >= MAX_INFLIGHT || room <= 0) {
            this.waiting = step;
            return;
          }
          // a chunk never wraps: cut at the ring's end, the next one starts at 0
          const len = this.credit.nextChunk(left, room);
          let at = this.credit.posted % RING;
          for (let need = len; need > 0; ) {
            const c = chunks[ci]!;
            const n = Math.min(need, c.length - co);
            bytes.set(co === 0 && n === c.length ? c : c.subarray(co, co + n), at);
            at += n;
            co += n;
            need -= n;
            if (co === c.length) {
              ci++;
              co = 0;
            }
          }
          this.postData(rdma, ring, src, len);
          left -= len;
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
    if (w && ((this.peerRing.rmr !== null && this.inflight < MAX_INFLIGHT && this.room() > 0) || this.failed)) {
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
    this.sendData([chunk], cb);
  }

  /** Duplex: chunks written meanwhile, copied into the send ring together (no concatenation first). */
  override _writev(chunks: { chunk: Buffer }[], cb: (e?: Error | null) => void): void {
    this.sendData(
      chunks.map((c) => c.chunk),
      cb,
    );
  }

  /** Duplex: `end()` — the end of this side's bytes goes to the peer (half-close), once every WRITE completed. */
  override _final(cb: (e?: Error | null) => void): void {
    this.withConn((rdma) => {
      const fin = (): void => {
        if (this.failed) return cb(this.failed);
        this.finSent = true;
        this.post(rdma, encodeFin(this.credit.posted), (e) => {
          // The peer closes only once both directions ended: a FIN whose completion lost that race had arrived.
          if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED" && (this.readableEnded || this.peerFin || this.allIn())) e = null;
          this.sent(e);
          cb(e);
        });
      };
      if (this.inflight === 0) fin();
      else this.idleWaiters.push(fin);
    });
  }

  /**
   * Duplex: `destroy()` — stops at once and closes the connection (unless
   * `closeConnection: false`); writes still waiting call back with an
   * error. Destroyed without an error after `end()`, once every byte
   * written was posted, the end still reaches the peer (its FIN, which waits
   * for the WRITEs in flight, goes now, and the connection closes behind it
   * with a bounded flush), as a `net.Socket`'s peer sees the end of a socket
   * destroyed after `end()`. With bytes still unsent, an error or
   * `resetAndDestroy()` the peer sees a reset, never a clean end of
   * truncated data.
   */
  override _destroy(err: Error | null, cb: (e?: Error | null) => void): void {
    this.idle.clear();
    const rdma = this.rdma;
    if (!rdma) {
      // never connected: whoever attaches later finds the stream destroyed
      this.queued = [];
      return cb(err);
    }
    streams.delete(rdma);
    const endNow = err === null && !this.resetting && this.writableEnded && this.writableLength === 0 && !this.finSent && this.failed === null && !rdma.isClosed;
    if (endNow) {
      this.finSent = true;
      this.post(rdma, encodeFin(this.credit.posted), () => this.sent(null));
    }
    // a write waiting for credit or ring space settles now (its callback, and those buffered behind it, are called)
    const w = this.waiting;
    this.waiting = null;
    if (w) {
      this.failed ??= err ?? new RdmaError("CONNECTION_CLOSED", "stream: destroyed");
      w();
    }
    // an end _final deferred until the WRITEs in flight complete never goes after this (it went above, or the peer sees a reset)
    this.idleWaiters = [];
    this.stop.abort();
    // Giving up the peer's ring revokes this side's access to it: with our end on its way, only once the
    // WRITEs ahead of it (and the end itself) completed or failed, so none is cut off mid-payload.
    if (endNow && this.inflight > 0) this.idleWaiters.push(() => this.peerRing.free());
    else this.peerRing.free();
    // WRITEs still in flight hold it: it is freed when they end
    this.sendRing.free();
    // The ring is freed once the peer can no longer reach it (the share revoked in order, or the connection gone).
    const freed = this.recvRing.release();
    if (!this.ownsConn) return void freed.then(() => cb(err));
    // an end posted (now, or by _final and not yet complete): the close waits, a bounded time, until the
    // peer has it; a close without flush would overtake it (it goes in the control lane)
    const flush = endNow || (err === null && !this.resetting && this.finSent && this.failed === null && !this.writableFinished);
    rdma.close(flush ? { flush: true, timeoutMs: END_FLUSH_MS } : undefined).then(
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
    this.idle.ms = ms > 0 ? ms : 0;
    if (cb) {
      if (this.idle.ms > 0) this.once("timeout", cb);
      else this.removeListener("timeout", cb);
    }
    this.idle.touch();
    return this;
  }

  /** The stream's idle timeout in ms (0: none). */
  get timeout(): number | undefined {
    return this.idle.ms || undefined;
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
  private resetting = false;
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
    this.resetting = true;
    return this.destroy();
  }
}

/** The `onread` option, checked: null when not given. */
function checkOnRead(o: OnRead | null | undefined): OnRead | null {
  if (o === undefined || o === null) return null;
  const b = (o as Partial<OnRead>).buffer;
  const ok = typeof o === "object" && typeof o.callback === "function" && (typeof b === "function" || (b instanceof Uint8Array && b.length > 0));
  if (!ok) throw new RdmaError("INVALID_ARGUMENT", "onread: expected { buffer: a non-empty Uint8Array or a function returning one, callback: a function }");
  return o;
}

/** @internal rdma.createStream() */
export function createStream<C extends StreamConnection>(rdma: C, opts?: StreamOptions): RdmaStream<C> {
  if (opts !== undefined && (opts === null || typeof opts !== "object")) throw new RdmaError("INVALID_ARGUMENT", "createStream: options must be an object");
  return new RdmaStream<C>(rdma, opts ?? {});
}
