/**
 * Accepting streams on a tcp device's port. The first frame on an accepted
 * stream must be a HELLO of this wire version naming a local QP that waits
 * for its peer's stream; that QP then takes the stream
 * (TcpQueuePair.incoming). A HELLO of another version is refused (counted in
 * `versionRefused`; the QP it names, if that QP waits for exactly that peer,
 * fails with a PROTOCOL reason naming both versions). Until then the stream is "pending", and what
 * strangers can make the device hold is bounded three ways:
 *
 * - per source (an IPv4 address, or an IPv6 /64): at most
 *   `maxPendingHelloPerSource` pending streams; a new one from the same source
 *   evicts that source's oldest;
 * - in total: at most `maxPendingHello`; when full, a newcomer evicts the
 *   oldest stream of the source holding the most, so a new source always gets
 *   a slot (a legitimate dialer says HELLO at once and is pending for
 *   microseconds);
 * - in time: a stream that has not said HELLO within `helloTimeoutMs` is
 *   destroyed.
 */
import type * as net from "node:net";
import { QpState } from "../types.js";
import { FrameType, HEADER_LEN, MAGIC, VERSION_MISMATCH } from "./codec.js";
import { FrameReader } from "./frame-reader.js";
import { ReadPort, adoptAccepted } from "./read-path.js";

/** Defaults of the device's limits on streams that have not said HELLO (see docs/architecture.md, Limits). */
export const HELLO_TIMEOUT_MS = 10_000;
export const MAX_PENDING_HELLO = 4096;
export const MAX_PENDING_HELLO_PER_SOURCE = 64;

/** A QP as the device's port sees it: HELLO names it, and it takes the stream (TcpQueuePair). */
export interface HelloTarget {
  readonly state: QpState;
  /** The peer's stream (its bytes go to `port`): `srcQp` and `psn` from its HELLO, `rest` the bytes that followed it. */
  incoming(sock: net.Socket, port: ReadPort, srcQp: number, psn: number, rest: Buffer | null): void;
  /** A HELLO of another wire version named this QP (`reason` names both versions); the stream is closed. */
  refusedVersion(srcQp: number, psn: number, reason: string): void;
}

/** What acceptIncoming needs from the device. */
export interface AcceptingDevice {
  readonly qps: Map<number, HelloTarget>;
  readonly pendingHello: PendingStreams;
  helloTimeoutMs: number;
  maxPendingHello: number;
  maxPendingHelloPerSource: number;
}

/** The key a stream's source is counted under: an IPv4 address, or the /64 of an IPv6 address. */
export function sourceKey(addr: string | undefined): string {
  if (!addr) return "?";
  const mapped = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(addr);
  if (mapped) return mapped[1]!;
  if (!addr.includes(":")) return addr;
  const bare = addr.replace(/%.*$/, "");
  const [head = "", tail] = bare.split("::");
  const left = head === "" ? [] : head.split(":");
  const right = tail === undefined || tail === "" ? [] : tail.split(":");
  const groups = tail === undefined ? left : [...left, ...Array<string>(Math.max(0, 8 - left.length - right.length)).fill("0"), ...right];
  return groups
    .slice(0, 4)
    .map((g) => parseInt(g || "0", 16).toString(16))
    .join(":") + "::/64";
}

interface Pending {
  readonly sock: net.Socket;
  readonly source: string;
}

/** Streams waiting for their HELLO, by source, oldest first. */
export class PendingStreams {
  private readonly bySource = new Map<string, Set<Pending>>();
  private count = 0;
  /** Streams destroyed to make room (per-source or total bound) and for missing the HELLO deadline. */
  evicted = 0;
  timedOut = 0;
  /** Streams whose HELLO was of another wire version (closed). */
  versionRefused = 0;

  get size(): number {
    return this.count;
  }

  countOf(source: string): number {
    return this.bySource.get(source)?.size ?? 0;
  }

  add(source: string, sock: net.Socket): Pending {
    const p: Pending = { sock, source };
    let set = this.bySource.get(source);
    if (!set) this.bySource.set(source, (set = new Set()));
    set.add(p);
    this.count++;
    return p;
  }

  /** No longer pending (HELLO arrived, or the stream closed). Idempotent. */
  remove(p: Pending): void {
    const set = this.bySource.get(p.source);
    if (!set?.delete(p)) return;
    this.count--;
    if (set.size === 0) this.bySource.delete(p.source);
  }

  /** Destroys the oldest pending stream of `source`. */
  evictOldest(source: string): void {
    const set = this.bySource.get(source);
    const oldest = set?.values().next().value;
    if (oldest === undefined) return;
    this.remove(oldest);
    this.evicted++;
    oldest.sock.destroy();
  }

  /** Destroys the oldest pending stream of the source holding the most. */
  evictFromLargest(): void {
    let best: string | null = null;
    let most = 0;
    for (const [source, set] of this.bySource) {
      if (set.size > most) {
        most = set.size;
        best = source;
      }
    }
    if (best !== null) this.evictOldest(best);
  }

  /** Device closing: every pending stream goes. */
  destroyAll(): void {
    for (const set of [...this.bySource.values()]) for (const p of [...set]) p.sock.destroy();
    this.bySource.clear();
    this.count = 0;
  }
}

/**
 * First frame on an accepted socket must be HELLO naming the QP; then that
 * QP's responder takes the stream. `accepted` comes from a server with
 * `pauseOnConnect` (read-path.ts wraps it for `onread` before any read).
 */
export function acceptIncoming(device: AcceptingDevice, accepted: net.Socket): void {
  const port = new ReadPort();
  const sock = adoptAccepted(accepted, port);
  const pending = device.pendingHello;
  const source = sourceKey(sock.remoteAddress);
  if (pending.countOf(source) >= device.maxPendingHelloPerSource) pending.evictOldest(source);
  if (pending.size >= device.maxPendingHello) pending.evictFromLargest();
  const entry = pending.add(source, sock);
  sock.once("close", () => pending.remove(entry));
  sock.setNoDelay(true);
  let hello: { qp: HelloTarget; srcQp: number; psn: number } | null = null;
  // The first header as received: a HELLO of another version is read from it (the reader refuses it undecoded).
  const first = Buffer.alloc(HEADER_LEN);
  let firstFill = 0;
  const reader = new FrameReader(
    (h) => {
      reader.stopped = true;
      const target = h.type === FrameType.HELLO ? device.qps.get(h.aux) : undefined;
      // No such QP: the requester sees its connection close and fails with RETRY_EXC_ERR, as verbs would after its retries.
      if (!target || target.state === QpState.ERR) sock.destroy();
      else hello = { qp: target, srcQp: Number(h.op1), psn: h.psn };
    },
    () => {},
    (reason) => {
      if (reason.startsWith(VERSION_MISMATCH) && first[0] === MAGIC) {
        pending.versionRefused++;
        if (first[2] === FrameType.HELLO) device.qps.get(first.readUInt32BE(28))?.refusedVersion(first.readUInt32BE(36), first.readUInt32BE(4), reason);
      }
      sock.destroy();
    },
  );
  port.sink = (buf: Buffer, start: number, end: number): void => {
    if (firstFill < HEADER_LEN) {
      const n = Math.min(HEADER_LEN - firstFill, end - start);
      buf.copy(first, firstFill, start, start + n);
      firstFill += n;
    }
    reader.feed(buf, start, end);
    if (reader.stopped) {
      port.sink = dropBytes;
      clearTimeout(deadline);
      pending.remove(entry);
      if (hello !== null && !sock.destroyed) hello.qp.incoming(sock, port, hello.srcQp, hello.psn, reader.leftover);
      else sock.destroy();
    }
  };
  sock.on("error", () => {});
  // A stream that never says HELLO is dropped at the deadline.
  const deadline = setTimeout(() => {
    if (sock.destroyed) return;
    pending.timedOut++;
    sock.destroy();
  }, device.helloTimeoutMs);
  deadline.unref();
  sock.once("close", () => clearTimeout(deadline));
}

function dropBytes(): void {}
