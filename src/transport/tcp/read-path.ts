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
 */
import * as net from "node:net";
import { deliverAfter } from "./cq.js";

/** Size of the shared read buffer: the most one read takes from the kernel. */
export const READ_BUFFER_BYTES = 64 * 1024;

let shared: Buffer | null = null;
function readBuffer(): Buffer {
  return (shared ??= Buffer.allocUnsafe(READ_BUFFER_BYTES));
}

/** Where a socket's bytes go: `sink(buf, start, end)` must consume buf[start, end) before returning. */
export class ReadPort {
  sink: (buf: Buffer, start: number, end: number) => void = drop;
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
      deliverAfter(port.sink, buf as Buffer, 0, n);
      return true;
    },
  };
}

/** Dials `host:port`; its bytes go to `into`. */
export function dialData(host: string, port: number, into: ReadPort): net.Socket {
  return net.connect({ host, port, noDelay: true, onread: onreadOf(into) });
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
