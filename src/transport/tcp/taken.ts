/**
 * How far the kernel has taken a socket's written bytes, read at the moment
 * of asking rather than when Node runs a write's callback (libuv may run that
 * callback an event-loop iteration later, after the peer has already read the
 * bytes and answered).
 *
 * Offsets count every byte written to the socket since it was created, in
 * write order (`socket.bytesWritten`'s coordinates): the end of a write is
 * `socket.bytesWritten` right after `write()` returns.
 */
import type * as net from "node:net";

interface SocketInternals {
  /** Bytes handed to the libuv handle (Node's net.Socket; the rest of bytesWritten waits in the stream's buffer). */
  _bytesDispatched?: unknown;
  _handle?: { writeQueueSize?: unknown } | null;
}

/**
 * Bytes of `sock` the kernel has taken: those handed to libuv less those libuv
 * still holds. -1 when this Node does not expose the two counters (the caller
 * then relies on write callbacks alone).
 */
export function kernelTaken(sock: net.Socket): number {
  const s = sock as unknown as SocketInternals;
  const dispatched = s._bytesDispatched;
  const queued = s._handle?.writeQueueSize;
  if (typeof dispatched !== "number" || typeof queued !== "number") return -1;
  return dispatched - queued;
}
