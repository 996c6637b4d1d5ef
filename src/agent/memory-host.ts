/**
 * What the memory protocol's parts share: the narrow view of their
 * connection (`MemoryHost`), this side's limits and the peer's, and the one
 * rule for access flags read from the wire. No part imports connection.ts,
 * nor another part.
 */
import { Access } from "../transport/types.js";
import type { RemoteAccess } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import type { CtrlMessage } from "./codec.js";
import type { Share } from "./shares.js";

/** The control message of one kind. */
export type Kind<T extends CtrlMessage["type"]> = Extract<CtrlMessage, { type: T }>;

const ALL_REMOTE = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC;

/** Access flags from the wire: a non-empty subset of remote read, write and atomic, with read always included. */
export function accessOfFlags(f: number): RemoteAccess | null {
  if (f === Access.REMOTE_READ) return "read";
  if (f === (Access.REMOTE_READ | Access.REMOTE_WRITE)) return "write";
  if (f === ALL_REMOTE) return "atomic";
  return null;
}

/** The peer's limits (its LIMITS message). */
export interface PeerLimits {
  /** Bytes of its memory it grants this connection at most. */
  quotaBytes: number;
  /** Regions it grants (or opens for) this connection at most. */
  maxRegions: number;
  /** The longest lease it gives. */
  maxLeaseMs: number;
  /** The largest message it accepts. */
  maxMessageSize: number;
}

/** A control message to send (codec.ts names each kind's fields). */
export type CtrlMsg = CtrlMessage;

/** @internal */
/** What the memory protocol needs from its connection. */
export interface MemoryHost {
  readonly pool: MrPool;
  /** Fire-and-forget control message. */
  sendCtrl(m: CtrlMsg): void;
  /** Fire-and-forget control message posted after every operation queued before it. */
  sendCtrlOrdered(m: CtrlMsg): void;
  /** A control message whose promise settles when its SEND completes. */
  postCtrl(m: CtrlMsg, signal?: AbortSignal): Promise<void>;
  checkOpen(what: string): void;
  /** The connection failed or is closing: send nothing more. */
  readonly down: boolean;
  protocolError(reason: string): void;
  /** A shared region of this side by its name key (shares.ts). */
  findShare(key: string): Share | undefined;
  /** The peer, as `allow(peer)` callbacks see it. */
  peerInfo(): unknown;
}

export interface MemoryLimits {
  quotaBytes: number;
  maxRegions: number;
  defaultLeaseMs: number;
  maxLeaseMs: number;
  leaseGraceMs: number;
  maxRegionSize: number;
}
