/**
 * The control messages of an RdmaStream: the one place that knows their
 * bytes. They are two-sided (send/receive); byte 0 is the kind:
 *   0x02 FIN: 9 bytes, then a u64 (big-endian): the total bytes this side
 *        wrote; the peer will write no more (half-close). The reader ends
 *        once it has read that many (the FIN may overtake the last WRITEs).
 *   0x03 WND: 5 bytes, a u32 (big-endian, 1..RING): the reader consumed that
 *        much more, the writer may write that much more. A WND that returns
 *        more than was written is a PROTOCOL error.
 *   0x04 RING?: 1 byte: the writer has data; the reader allocates and shares its ring.
 *   0x05 RING: 1 + 1..256 bytes: the UTF-8 name of the reader's shared ring (RING bytes).
 *
 * Invariant: a message is decoded by its kind and exact length only; a
 * message of an unknown kind or of the wrong length decodes to null (the
 * stream's PROTOCOL error). Whether a well-formed message is welcome now (a
 * second FIN or RING?, an unasked RING) is the stream's state to judge, not
 * the codec's. A control message is sent from registered memory of its
 * own, freed once its send settles, whatever the outcome.
 */
import type { LocalMr } from "../memory/mr.js";
import type { StreamConnection } from "./stream-connection.js";

const FIN = 0x02;
const WND = 0x03;
const RING_REQ = 0x04;
const RING_NAME = 0x05;
/** Longest ring name a peer may send (as a share name). */
const MAX_NAME = 256;

/** A control message, decoded. */
export type Control = { kind: "fin"; total: number } | { kind: "wnd"; n: number } | { kind: "ringRequest" } | { kind: "ringName"; name: string };

/** FIN: this side wrote `total` bytes and will write no more. */
export function encodeFin(total: number): Buffer {
  const b = Buffer.alloc(9);
  b[0] = FIN;
  b.writeUInt32BE(Math.floor(total / 2 ** 32), 1);
  b.writeUInt32BE(total % 2 ** 32, 5);
  return b;
}

/** WND: the peer may write `n` more bytes. */
export function encodeWnd(n: number): Buffer {
  const b = Buffer.alloc(5);
  b[0] = WND;
  b.writeUInt32BE(n, 1);
  return b;
}

/** RING?: this side has data to write. */
export function encodeRingRequest(): Buffer {
  return Buffer.of(RING_REQ);
}

/** RING: the name this side's ring is shared under. */
export function encodeRingName(name: string): Buffer {
  const b = Buffer.alloc(1 + Buffer.byteLength(name));
  b[0] = RING_NAME;
  b.write(name, 1);
  return b;
}

/** The message in `msg`, or null when its kind is unknown or its length wrong for its kind. */
export function decodeControl(msg: Buffer): Control | null {
  const kind = msg.length > 0 ? msg[0] : -1;
  if (kind === WND && msg.length === 5) return { kind: "wnd", n: msg.readUInt32BE(1) };
  if (kind === FIN && msg.length === 9) return { kind: "fin", total: msg.readUInt32BE(1) * 2 ** 32 + msg.readUInt32BE(5) };
  if (kind === RING_REQ && msg.length === 1) return { kind: "ringRequest" };
  if (kind === RING_NAME && msg.length > 1 && msg.length <= 1 + MAX_NAME) return { kind: "ringName", name: msg.toString("utf8", 1) };
  return null;
}

/** How a malformed (or unwelcome) message is named in the stream's PROTOCOL error. */
export function describeControl(msg: Buffer): string {
  return `kind ${msg.length > 0 ? msg[0] : -1}, ${msg.length} bytes`;
}

/** A control message copied into registered memory of its own (throws what allocation throws: nothing is sent). */
export function controlMr(rdma: Pick<StreamConnection, "allocLocalMr">, msg: Uint8Array): LocalMr {
  const mr = rdma.allocLocalMr(msg.length);
  mr.bytes.set(msg);
  return mr;
}

/** Sends a control message from `mr`; `done` once the send settled, after `mr` is freed. */
export function sendControl(rdma: Pick<StreamConnection, "send">, mr: LocalMr, done: (e: Error | null) => void): void {
  rdma.send(mr).then(
    () => {
      mr.dispose();
      done(null);
    },
    (e: unknown) => {
      try {
        mr.dispose();
      } catch {
        /* freed with its connection */
      }
      done(e instanceof Error ? e : new Error(String(e)));
    },
  );
}
