/**
 * What the requester (requester.ts) and the responder (responder.ts) of one
 * tcp QP share, through the QP (qp.ts) that wires them: its identity, PD and
 * CQs, its state, its frame counters, and the one way into ERR. Also what the
 * QP needs from its device, so that qp.ts never imports device.ts (the device
 * creates QPs; a QP only sees this narrow view of it).
 */
import type { AsyncEventType, ProtectionDomain, QpState } from "../types.js";
import type { TcpCq } from "./cq.js";
import type { MemoryDevice, MemoryPd, WindowOwner } from "./memory.js";
import type { HelloTarget } from "./accept.js";

export const PSN_MASK = 0xffffff;

/** psn a is before b in 24-bit serial arithmetic. */
export function psnBefore(a: number, b: number): boolean {
  return ((b - a) & PSN_MASK) !== 0 && ((b - a) & PSN_MASK) < 0x800000;
}

/** What a QP needs from its device (TcpDevice). */
export interface QpDevice extends MemoryDevice {
  /** Address and TCP port the device listens on (the QP's endpoint). */
  readonly host: string;
  readonly port: number;
  /** Live QPs by number: the device's port hands them the streams that name them (accept.ts). */
  readonly qps: Map<number, HelloTarget>;
  /** How long a stream may take to say HELLO; also how long a waiting QP waits for its peer's stream. */
  readonly helloTimeoutMs: number;
  allocQpn(): number;
}

/** What a QP needs from its protection domain (TcpPd). */
export interface QpPd extends ProtectionDomain, MemoryPd {
  readonly device: QpDevice;
  released(kind: "qp" | "mr" | "mw"): void;
}

/** Frame counters of one tcp QP (for tests and benchmarks; not part of the seam). */
export interface TcpQpStats {
  /** Request frames written: SEND, WRITE, READ_REQ, ATOMIC (retransmissions after an RNR NAK included). */
  readonly requests: number;
  /** Standalone ACK frames (syndrome ACK) written by the responder. */
  readonly acks: number;
  /** Requests written that carried a piggybacked ACK. */
  readonly piggybackedAcks: number;
  /** Piggybacked ACKs received (on the peer's requests). */
  readonly piggybackedAcksReceived: number;
  /** Received piggybacked ACKs that overtook a READ/ATOMIC response and were held until it arrived. */
  readonly piggybackedAcksHeld: number;
  /** Duplicate ACKs the responder wrote to signal progress during a long request payload. */
  readonly progressAcks: number;
  /** Times the QP stopped reading its stream because its responses were not being read (and its own requests awaited nothing). */
  readonly requestPauses: number;
}

export type QpCounters = { -readonly [K in keyof TcpQpStats]: number };

export type Side = "requester" | "responder";

/** The QP as its requester and responder see it. */
export interface QpCore extends WindowOwner {
  readonly qpNum: number;
  readonly pd: QpPd;
  readonly state: QpState;
  readonly sendCq: TcpCq;
  readonly recvCq: TcpCq;
  readonly counters: QpCounters;
  /** ERR: flush every WR, close the stream, tell the application when `notify`. */
  enterError(reason: string, notify: boolean, type?: AsyncEventType): void;
  /** A malformed or hostile frame for `stream`'s half, found by `side`: ERR with a reason. */
  protocolError(side: Side, reason: string, stream?: Side): void;
  /** A stream closed or failed: the oldest started WR fails with RETRY_EXC_ERR, then ERR. */
  connectionLost(reason: string): void;
}
