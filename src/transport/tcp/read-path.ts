/**
 * How a data socket's bytes reach its frame reader: Node's `onread`, which
 * reads straight into a buffer we own, instead of the 'data' event, which
 * allocates a fresh 64 KiB buffer per read (page faults and scavenges at
 * bulk rates, measured at 0.4-0.7x the receiver throughput).
 *
 * Invariant: every read lands in one process-wide buffer, and the sink it is
 * handed to consumes all of it before returning (the frame reader copies
 * payload bytes into their placement and keeps at most a partial header,
 * copied). Node calls each socket's read callback synchronously after that
 * socket's read, one socket at a time, so one buffer serves every connection
 * and an idle connection holds none.
 *
 * Dialed sockets get `onread` from net.connect. Node's net.Server cannot give
 * `onread` to the sockets it accepts, so an accepted socket's handle is
 * wrapped in a new net.Socket that has it (the server accepts paused, so no
 * byte is read before). Where that cannot be done (the handle is not there,
 * or the wrap throws) the accepted socket stays as it is and is read through
 * the 'data' event into the same sink: slower, identical bytes.
 *
 * Large payloads skip the shared buffer: after a read that filled it (more
 * may be waiting), the QP's feed may read the rest of a payload segment
 * straight from the socket's descriptor into its registered memory
 * (`ReadPort.direct`, frame-reader.ts pullDirect). That read runs inside
 * the socket's own read callback, so never beside one of libuv's, and in
 * stream order (an `onread` socket keeps no bytes of its own); a socket
 * read through 'data' (which may hold bytes back) never gets one.
 */
import * as fs from "node:fs";
import * as net from "node:net";
import { deliverAfter } from "./cq.js";
import type { DirectRead } from "./frame-reader.js";

/** Size of the shared read buffer: the most one read takes from the kernel. */
export const READ_BUFFER_BYTES = 64 * 1024;

let shared: Buffer | null = null;
function readBuffer(): Buffer {
  return (shared ??= Buffer.allocUnsafe(READ_BUFFER_BYTES));
}

/** Where a socket's bytes go: `sink(buf, start, end)` must consume buf[start, end) before returning. */
export class ReadPort {
  sink: (buf: Buffer, start: number, end: number) => void = drop;
  /**
   * Set while `sink` runs: the read filled the whole read buffer, so more
   * bytes may be waiting in the socket (a short read means it is drained).
   */
  more = false;
  /** Reads the socket straight into registered memory (onread sockets with a file descriptor), or null. */
  direct: DirectRead | null = null;
}

/** Counters of direct reads (tests and benchmarks): reads tried, reads that placed bytes, and those bytes. */
export const directStats = { attempts: 0, reads: 0, bytes: 0 };

interface FdHandle {
  _handle: { fd?: unknown } | null;
}

/**
 * Bytes direct reads may still take in this event-loop turn, over every
 * socket of the process. libuv reads one socket up to 32 times per wake-up
 * while its reads come back full (32 × 64 KiB through the read buffer); a
 * direct read after each would multiply that. With this budget a turn moves
 * at most that plus DIRECT_TURN_MAX, however many sockets pull.
 */
export const DIRECT_TURN_MAX = 1024 * 1024;

/**
 * Tests turn direct reads off with `directReads = false` for sockets made
 * after (the read buffer then carries every byte), and may lower the
 * per-turn budget (`turnMax`, DIRECT_TURN_MAX unless a test lowered it).
 */
export const directOptions = { directReads: true, turnMax: DIRECT_TURN_MAX };
/** Bytes direct reads took in this turn (back to 0 at the end of a turn that took any). */
let turnUsed = 0;
let budgetReset: NodeJS.Immediate | null = null;
function resetBudget(): void {
  turnUsed = 0;
  budgetReset = null;
}

/** What direct reads may still take in this event-loop turn (tests). */
export function directTurnLeft(): number {
  return Math.max(0, directOptions.turnMax - turnUsed);
}

/**
 * A direct reader for `sock`: fs.readSync on its file descriptor, inside the
 * socket's own read callback (so never concurrently with libuv's reads, and
 * in stream order: onread sockets keep no bytes of their own); at most the
 * turn's budget (DIRECT_TURN_MAX), then 0 until the next turn. null when
 * direct reads are off; where the socket has no descriptor (Windows) every
 * read returns -1 and the read buffer carries the bytes.
 */
function directReader(sock: net.Socket): DirectRead | null {
  if (!directOptions.directReads) return null;
  const owner = sock as unknown as FdHandle;
  return (view: Uint8Array, at: number, len: number): number => {
    const fd = owner._handle?.fd;
    if (typeof fd !== "number" || fd < 0) return -1;
    const left = directOptions.turnMax - turnUsed;
    if (left <= 0) return 0;
    if (len > left) len = left;
    directStats.attempts++;
    let n: number;
    try {
      n = fs.readSync(fd, view, at, len, null);
    } catch (e) {
      const err = e as NodeJS.ErrnoException;
      // Nothing waiting.
      if (err.code === "EAGAIN" || err.code === "EWOULDBLOCK") return 0;
      // The socket failed (a reset, a timeout): the kernel reports that once, so it is this
      // read's to report. Anything else (an argument Node refused) left the bytes in the socket.
      if (err.syscall === "read" && typeof err.errno === "number") sock.destroy(err);
      return -1;
    }
    if (n > 0) {
      directStats.reads++;
      directStats.bytes += n;
      turnUsed += n;
      if (budgetReset === null) {
        budgetReset = setImmediate(resetBudget);
        budgetReset.unref();
      }
    }
    return n;
  };
}

function drop(): void {}

/** How accepted sockets were set up (for tests and benchmarks). */
export const readPathStats = { onread: 0, fallback: 0 };

/** Tests force the 'data' fallback for accepted sockets with `acceptWithOnread = false`. */
export const readPathOptions = { acceptWithOnread: true };

function onreadOf(port: ReadPort): { buffer: Buffer; callback: (n: number, buf: Uint8Array) => boolean } {
  return {
    buffer: readBuffer(),
    callback: (n: number, buf: Uint8Array): boolean => {
      // No try/finally here (it measured 2-3 % more CPU per RPC call): a sink that throws leaves
      // `more` set until the next read sets it again. The only feed that can see it meanwhile is a
      // parked socket's first (QP.connect feeding what its HELLO read left): a direct read then
      // takes the bytes that follow those, in stream order, as the next read would.
      port.more = n === READ_BUFFER_BYTES;
      deliverAfter(port.sink, buf as Buffer, 0, n);
      port.more = false;
      return true;
    },
  };
}

/** Dials `host:port`; its bytes go to `into`. */
export function dialData(host: string, port: number, into: ReadPort): net.Socket {
  const sock = net.connect({ host, port, noDelay: true, onread: onreadOf(into) });
  into.direct = directReader(sock);
  return sock;
}

interface HandleOwner {
  _handle: { readStart?: unknown } | null;
}

/**
 * Takes a socket net.Server accepted (paused: `pauseOnConnect`) and returns
 * the socket to use from now on, whose bytes go to `into`.
 */
export function adoptAccepted(orig: net.Socket, into: ReadPort): net.Socket {
  const owner = orig as unknown as HandleOwner;
  const handle = owner._handle;
  if (readPathOptions.acceptWithOnread && handle !== null && typeof handle === "object" && typeof handle.readStart === "function") {
    owner._handle = null;
    try {
      const s = new net.Socket({ handle: handle as never, readable: true, writable: true, onread: onreadOf(into) } as net.SocketConstructorOpts);
      // The original object let go of the handle; destroying it only settles the server's connection count.
      s.once("close", () => orig.destroy());
      s.resume();
      // Only a socket read through onread may be read directly (the 'data' path may hold bytes back).
      into.direct = directReader(s);
      readPathStats.onread++;
      return s;
    } catch {
      owner._handle = handle;
    }
  }
  readPathStats.fallback++;
  orig.on("data", (chunk: Buffer) => deliverAfter(into.sink, chunk, 0, chunk.length));
  orig.resume();
  return orig;
}
