/**
 * The transport seam: a verbs-shaped interface that both providers implement
 * one to one (`tcp`: RC semantics over TCP in TypeScript; `verbs`: a Node-API
 * addon over libibverbs). Everything above this layer (memory, agent, api) is
 * written once against these interfaces.
 *
 * Names and numeric values follow <infiniband/verbs.h> so the native provider
 * passes them through unchanged: ibv_wr_opcode, ibv_wc_opcode, ibv_wc_status,
 * ibv_access_flags, ibv_send_flags, ibv_qp_state.
 *
 * Addresses are plain numbers: user-space virtual addresses on x86-64 are
 * below 2^48, well inside the 2^53 a double holds exactly, and numbers keep
 * the hot path free of BigInt allocation. Only atomic operands are bigint.
 */

/** ibv_access_flags */
export const Access = {
  LOCAL_WRITE: 1,
  REMOTE_WRITE: 2,
  REMOTE_READ: 4,
  REMOTE_ATOMIC: 8,
  MW_BIND: 16,
} as const;

/** ibv_send_flags */
export const SendFlags = {
  FENCE: 1,
  SIGNALED: 2,
  SOLICITED: 4,
  INLINE: 8,
} as const;

/** ibv_wr_opcode */
export const WrOpcode = {
  RDMA_WRITE: 0,
  RDMA_WRITE_WITH_IMM: 1,
  SEND: 2,
  SEND_WITH_IMM: 3,
  RDMA_READ: 4,
  ATOMIC_CMP_AND_SWP: 5,
  ATOMIC_FETCH_AND_ADD: 6,
  LOCAL_INV: 7,
  BIND_MW: 8,
} as const;
export type WrOpcode = (typeof WrOpcode)[keyof typeof WrOpcode];

/** ibv_wc_opcode */
export const WcOpcode = {
  SEND: 0,
  RDMA_WRITE: 1,
  RDMA_READ: 2,
  COMP_SWAP: 3,
  FETCH_ADD: 4,
  BIND_MW: 5,
  LOCAL_INV: 6,
  RECV: 128,
  RECV_RDMA_WITH_IMM: 129,
} as const;
export type WcOpcode = (typeof WcOpcode)[keyof typeof WcOpcode];

/** ibv_wc_status */
export const WcStatus = {
  SUCCESS: 0,
  LOC_LEN_ERR: 1,
  LOC_QP_OP_ERR: 2,
  LOC_EEC_OP_ERR: 3,
  LOC_PROT_ERR: 4,
  WR_FLUSH_ERR: 5,
  MW_BIND_ERR: 6,
  BAD_RESP_ERR: 7,
  LOC_ACCESS_ERR: 8,
  REM_INV_REQ_ERR: 9,
  REM_ACCESS_ERR: 10,
  REM_OP_ERR: 11,
  RETRY_EXC_ERR: 12,
  RNR_RETRY_EXC_ERR: 13,
  LOC_RDD_VIOL_ERR: 14,
  REM_INV_RD_REQ_ERR: 15,
  REM_ABORT_ERR: 16,
  INV_EECN_ERR: 17,
  INV_EEC_STATE_ERR: 18,
  FATAL_ERR: 19,
  RESP_TIMEOUT_ERR: 20,
  GENERAL_ERR: 21,
} as const;
export type WcStatus = (typeof WcStatus)[keyof typeof WcStatus];

const wcStatusNames: string[] = [];
for (const [k, v] of Object.entries(WcStatus)) wcStatusNames[v] = k;
/** "REM_ACCESS_ERR" for 10, like ibv_wc_status_str without the prose. */
export function wcStatusName(s: number): string {
  return wcStatusNames[s] ?? `STATUS_${s}`;
}

/** ibv_wc_flags */
export const WcFlags = {
  WITH_IMM: 2,
} as const;

/** ibv_qp_state */
export const QpState = {
  RESET: 0,
  INIT: 1,
  RTR: 2,
  RTS: 3,
  SQD: 4,
  SQE: 5,
  ERR: 6,
} as const;
export type QpState = (typeof QpState)[keyof typeof QpState];

/** The two providers. */
export type ProviderName = "tcp" | "verbs";

/** The limits a user tunes against (ibv_device_attr, shortened). */
export interface DeviceAttr {
  /** "tcp" or "verbs". */
  readonly provider: ProviderName;
  readonly fwVer: string;
  readonly nodeGuid: string;
  readonly maxMrSize: number;
  readonly maxQp: number;
  readonly maxQpWr: number;
  readonly maxSge: number;
  readonly maxCq: number;
  readonly maxCqe: number;
  readonly maxMr: number;
  readonly maxPd: number;
  readonly maxQpRdAtom: number;
  readonly maxQpInitRdAtom: number;
  /** Largest inline payload a send WR can carry (measured by creating a QP). */
  readonly maxInline: number;
  /** IBV_ATOMIC_NONE | HCA | GLOB */
  readonly atomicCap: "NONE" | "HCA" | "GLOB";
  /** Memory windows supported (0 = none, 1 = type 1, 2 = type 1 and 2). */
  readonly maxMw: number;
  readonly mwTypes: readonly (1 | 2)[];
  /**
   * Whether the device enforces a memory window's bounds. rxe (kernel 6.1)
   * does not: a write past a window's end but inside its MR succeeds, so
   * grants to a peer must use a dedicated MR over exactly the bytes lent.
   */
  readonly mwEnforcesBounds: boolean;
  readonly physPortCnt: number;
}

/** A port's attributes (ibv_query_port), with its GIDs. */
export interface PortAttr {
  readonly portNum: number;
  readonly state: "DOWN" | "INIT" | "ARMED" | "ACTIVE" | "ACTIVE_DEFER" | "NOP";
  /** Active path MTU in bytes (256..4096). */
  readonly activeMtu: number;
  readonly maxMtu: number;
  readonly linkLayer: "InfiniBand" | "Ethernet" | "TCP";
  readonly lid: number;
  readonly gidTblLen: number;
  /** Non-zero GIDs of the port: index and text form (ipv6 notation). */
  readonly gids: readonly { index: number; gid: string; type?: string }[];
}

/** A device a provider lists: its name, provider and GUID. */
export interface DeviceInfo {
  readonly name: string;
  readonly provider: ProviderName;
  readonly guid: string;
}

/** A scatter/gather element: bytes [addr, addr+length) of the MR with `lkey`. */
export interface Sge {
  addr: number;
  length: number;
  lkey: number;
}

/** What a memory-window bind attaches: a range of an MR and the window's access. */
export interface MwBindInfo {
  mr: MemoryRegion;
  addr: number;
  length: number;
  /** Access flags of the window (REMOTE_*); the MR must allow MW_BIND. */
  access: number;
}

/** ibv_send_wr: one work request for {@link QueuePair.postSend}. */
export interface SendWr {
  /** Caller's id (a small integer, returned in the completion). */
  wrId: number;
  opcode: WrOpcode;
  /** SendFlags bits. */
  flags?: number;
  sgList?: readonly Sge[];
  /** Immediate data (u32, host order here; network order on the wire). */
  imm?: number;
  remoteAddr?: number;
  rkey?: number;
  /** ATOMIC_CMP_AND_SWP: compare; ATOMIC_FETCH_AND_ADD: the addend. */
  compareAdd?: bigint;
  /** ATOMIC_CMP_AND_SWP: the swap value. */
  swap?: bigint;
  /** BIND_MW: the window, the new rkey (from {@link MemoryWindow.nextRkey}) and the range. */
  mw?: MemoryWindow;
  bindRkey?: number;
  bind?: MwBindInfo;
  /** LOCAL_INV: the rkey to invalidate. */
  invalidateRkey?: number;
}

/** ibv_recv_wr */
export interface RecvWr {
  wrId: number;
  sgList?: readonly Sge[];
}

/**
 * A caller-owned buffer that {@link CompletionQueue.poll} fills (struct of
 * arrays, so polling allocates nothing). Entry i is valid for i < count.
 */
export class CompletionBuffer {
  readonly capacity: number;
  readonly wrId: Float64Array;
  readonly status: Uint8Array;
  readonly opcode: Uint8Array;
  readonly flags: Uint8Array;
  readonly byteLen: Uint32Array;
  readonly imm: Uint32Array;
  readonly qpNum: Uint32Array;
  readonly vendorErr: Uint32Array;

  /** Room for `capacity` completions. */
  constructor(capacity: number) {
    this.capacity = capacity;
    this.wrId = new Float64Array(capacity);
    this.status = new Uint8Array(capacity);
    this.opcode = new Uint8Array(capacity);
    this.flags = new Uint8Array(capacity);
    this.byteLen = new Uint32Array(capacity);
    this.imm = new Uint32Array(capacity);
    this.qpNum = new Uint32Array(capacity);
    this.vendorErr = new Uint32Array(capacity);
  }
}

/** A completion as a plain object: convenient for tests and slow paths. */
export interface WorkCompletion {
  wrId: number;
  status: WcStatus;
  opcode: WcOpcode;
  flags: number;
  byteLen: number;
  imm: number;
  qpNum: number;
  vendorErr: number;
}

/** Entry `i` of a CompletionBuffer as a WorkCompletion object. */
export function completionAt(b: CompletionBuffer, i: number): WorkCompletion {
  return {
    wrId: b.wrId[i]!,
    status: b.status[i]! as WcStatus,
    opcode: b.opcode[i]! as WcOpcode,
    flags: b.flags[i]!,
    byteLen: b.byteLen[i]!,
    imm: b.imm[i]!,
    qpNum: b.qpNum[i]!,
    vendorErr: b.vendorErr[i]!,
  };
}

/** Async events (ibv_event_type subset) delivered to QP / device handlers. */
export type AsyncEventType = "QP_FATAL" | "QP_REQ_ERR" | "QP_ACCESS_ERR" | "COMM_EST" | "CQ_ERR" | "PORT_ACTIVE" | "PORT_ERR" | "DEVICE_FATAL";
/** An asynchronous event (ibv_async_event) with the reason the provider knows. */
export interface AsyncEvent {
  type: AsyncEventType;
  /** Human-readable reason (e.g. which malformed frame moved the QP to ERR). */
  reason: string;
  qpNum?: number;
}

/**
 * What a QP's peer needs to connect to it, exchanged out of band (TCP side
 * channel or RDMA CM private data). For verbs: LID/GID, QPN and PSN. For tcp:
 * `gid` is the IP address the device listens on and `port` its TCP port.
 */
export interface Endpoint {
  provider: ProviderName;
  qpNum: number;
  psn: number;
  lid: number;
  /** GID in ipv6 text form (verbs) or the host address (tcp). */
  gid: string;
  /** tcp: the device's TCP port; verbs: 0. */
  port: number;
  /** Path MTU the endpoint's port supports, bytes. */
  mtu: number;
}

/** ibv_qp_init_attr (RC only) */
export interface QpInitAttr {
  sendCq: CompletionQueue;
  recvCq: CompletionQueue;
  maxSendWr: number;
  maxRecvWr: number;
  maxSendSge?: number;
  maxRecvSge?: number;
  maxInlineData?: number;
  /** Every send WR generates a completion (ibv sq_sig_all). */
  sqSigAll?: boolean;
  /** Port the QP is bound to at INIT (default 1). */
  portNum?: number;
  /**
   * qp_access_flags set at INIT: which remote operations the peer may target
   * at this QP (REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC; default all).
   */
  access?: number;
}

/** The attributes of INIT → RTR → RTS, with verbs' encodings. */
export interface QpConnectAttr {
  portNum?: number;
  gidIndex?: number;
  /** Path MTU in bytes: 256, 512, 1024, 2048 or 4096. */
  mtu?: number;
  /** Local ACK timeout exponent: 4.096 µs × 2^timeout (0 = infinite). */
  timeout?: number;
  /** Retries on ACK timeout (0..7). */
  retryCnt?: number;
  /** Retries on RNR NAK (0..7; 7 = infinite). */
  rnrRetry?: number;
  /** Minimal RNR NAK timer, IB encoding 0..31 (12 = 0.64 ms). */
  minRnrTimer?: number;
  maxRdAtomic?: number;
  maxDestRdAtomic?: number;
  /**
   * tcp provider only (verbs ignores it: there the NIC answers, not the
   * peer's event loop). How long, in ms, a requester with work outstanding
   * tolerates hearing nothing from a peer whose TCP streams are still up (a
   * stopped process, a blocked event loop, a long GC pause) before failing
   * the oldest WR with RETRY_EXC_ERR. The limit is
   * max(timeout × (retryCnt + 1), livenessMs); `timeout` 0 still means
   * infinite. Anything the peer sends (an ACK, a response, response bytes)
   * restarts the count. A cut stream (FIN, RST, killed process) is detected
   * at once whatever this says. Default 15 000; 0 keeps verbs' limit alone.
   */
  livenessMs?: number;
}

/** A protection domain (ibv_pd): memory and QPs in one PD can reach each other, never another PD's. */
export interface ProtectionDomain {
  readonly device: Device;
  /**
   * Registers memory. With a number, the provider allocates that many zeroed,
   * page-aligned bytes; with an ArrayBuffer, the caller's memory is registered
   * (the MR keeps it alive; `offset`/`length` select a range).
   * Remote write or atomic access without LOCAL_WRITE is refused (EINVAL), as verbs does.
   */
  registerMr(memory: number | ArrayBuffer | SharedArrayBuffer, access: number, offset?: number, length?: number): MemoryRegion;
  /** Allocates a type-2 memory window (throws PROVIDER/INVALID if unsupported). */
  allocMw(type?: 1 | 2): MemoryWindow;
  /** ibv_create_qp followed by the RESET → INIT transition: the QP comes back in INIT, ready for postRecv. */
  createQp(init: QpInitAttr): QueuePair;
  /** ibv_dealloc_pd. */
  dealloc(): void;
}

/** Registered memory (ibv_mr): its keys, its range and its access. */
export interface MemoryRegion {
  readonly pd: ProtectionDomain;
  /** The registered bytes. Detached after {@link deregister} when the provider allocated them. */
  readonly buffer: ArrayBuffer;
  /** Offset of the registered range within `buffer`. */
  readonly offset: number;
  /** Virtual address of the first registered byte. */
  readonly addr: number;
  readonly length: number;
  readonly lkey: number;
  readonly rkey: number;
  readonly access: number;
  readonly deregistered: boolean;
  /** ibv_dereg_mr; any later remote access with `rkey` fails with REM_ACCESS_ERR. */
  deregister(): void;
  /**
   * Optional (native memory only): a new ArrayBuffer aliasing bytes
   * [offset, offset+length) of `buffer`, detachable on its own. The memory
   * layer hands one to each allocation carved from a slab, so freeing an
   * allocation detaches exactly its views. Providers whose memory is a plain
   * JS ArrayBuffer cannot alias and leave this undefined; the memory layer
   * then registers each allocation separately.
   */
  aliasBuffer?(offset: number, length: number): ArrayBuffer;
  /**
   * Optional (providers whose memory is a plain JS ArrayBuffer they
   * allocated): detaches every view of `buffer` and replaces it with a fresh
   * ArrayBuffer over the same bytes, which stay registered. Returns false
   * when it cannot now (a socket write still reads the bytes). The memory
   * layer recycles receive buffers with it: a buffer handed to the user and
   * disposed is re-posted, and no view the user kept can see its next use.
   */
  renewBuffer?(): boolean;
}

/** A memory window (ibv_mw): a remote key over part of an MR, bound and invalidated by work requests. */
export interface MemoryWindow {
  readonly pd: ProtectionDomain;
  readonly type: 1 | 2;
  /** Current rkey (0 when unbound). */
  readonly rkey: number;
  /** The rkey to put in the next BIND_MW WR (ibv_inc_rkey of the current one). */
  nextRkey(): number;
  /** ibv_dealloc_mw. */
  dealloc(): void;
}

/** A completion queue (ibv_cq), polled into a CompletionBuffer. */
export interface CompletionQueue {
  readonly device: Device;
  readonly depth: number;
  /** Moves up to `max` (default: buffer capacity) completions into `out`; returns how many. */
  poll(out: CompletionBuffer, max?: number): number;
  /**
   * ibv_req_notify_cq: the handler runs once (asynchronously) when a
   * completion is added after this call. As with verbs, completions already
   * queued do not trigger it: arm, then poll once more to close the race.
   */
  requestNotify(): void;
  /** Handler for notifications requested by {@link requestNotify}. */
  onNotify: (() => void) | null;
  /**
   * Completions are produced only by this thread's event loop (a software
   * provider), never by hardware behind its back: an armed CQ is always
   * notified, and polling between events can find nothing new. Busy and
   * adaptive polling then keep the CQ armed and spin by keeping the event
   * loop turning, so the next event is read without a sleep and a wake-up.
   */
  readonly eventDriven?: boolean;
  /**
   * Whether an armed CQ with a handler keeps the process alive (default
   * true, as a socket being read does); false lets the process exit while
   * the CQ waits, as `socket.unref()` does.
   */
  setKeepAlive?(on: boolean): void;
  /** ibv_destroy_cq. */
  destroy(): void;
}

/** A reliable-connection queue pair (ibv_qp). */
export interface QueuePair {
  readonly pd: ProtectionDomain;
  readonly qpNum: number;
  readonly state: QpState;
  readonly sendCq: CompletionQueue;
  readonly recvCq: CompletionQueue;
  /** Effective caps after creation (maxInlineData may exceed what was asked). */
  readonly caps: { maxSendWr: number; maxRecvWr: number; maxSendSge: number; maxRecvSge: number; maxInlineData: number };
  /** RNR NAKs answered with a retry, where the provider counts them (the tcp provider; an HCA retries unseen). */
  readonly rnrRetries?: number;
  /** This QP's half of the out-of-band exchange. */
  localEndpoint(attr?: { portNum?: number; gidIndex?: number }): Endpoint;
  /** INIT → RTR → RTS against the peer's endpoint (ibv_modify_qp twice). */
  connect(remote: Endpoint, attr?: QpConnectAttr): void;
  /** Moves the QP to ERR: outstanding and later WRs complete with WR_FLUSH_ERR. */
  setError(): void;
  /**
   * ibv_post_send of a chained list. Throws INVALID_ARGUMENT (or
   * RESOURCE_EXHAUSTED when the send queue is full) naming the index of the
   * first bad WR; WRs before it were posted, as with verbs' bad_wr.
   */
  postSend(wrs: readonly SendWr[]): void;
  /** ibv_post_recv of a list; throws like postSend. */
  postRecv(wrs: readonly RecvWr[]): void;
  /** Async events for this QP (fatal errors with a reason). */
  onEvent: ((e: AsyncEvent) => void) | null;
  /** ibv_destroy_qp: outstanding work is dropped. */
  destroy(): void;
}

/** An open device (ibv_context). */
export interface Device {
  readonly name: string;
  readonly attr: DeviceAttr;
  /** ibv_query_port (default port 1). */
  queryPort(portNum?: number): PortAttr;
  /** ibv_alloc_pd. */
  allocPd(): ProtectionDomain;
  /** ibv_create_cq with room for `depth` completions. */
  createCq(depth: number): CompletionQueue;
  /** Device-wide async events (port changes, device fatal). */
  onEvent: ((e: AsyncEvent) => void) | null;
  /** ibv_close_device: every PD, MR, CQ and QP of the device must be gone. */
  close(): void;
}

/** Options of the tcp provider's devices. */
export interface TcpDeviceOptions {
  /** Address the device listens on for its QPs' connections (default 0.0.0.0). */
  host?: string;
  /** TCP port (default 0: any). */
  port?: number;
}

/** A provider: lists and opens devices (tcp, or verbs through the native addon). */
export interface Provider {
  readonly name: ProviderName;
  /** The devices this provider can open. */
  listDevices(): DeviceInfo[];
  /** Opens a device by name, or the first one. */
  openDevice(name?: string, options?: TcpDeviceOptions): Promise<Device>;
  /**
   * RDMA CM (librdmacm) when the provider has it (verbs); throws
   * PROVIDER_UNAVAILABLE with the reason when it cannot be loaded.
   */
  readonly rdmaCm?: () => RdmaCm;
}

// ---------------------------------------------------------------------------
// RDMA CM: connection management between RDMA devices (rdma_cm(7)), the
// alternative to the TCP side channel. Only the verbs provider has it.

/** enum rdma_cm_event_type */
export const CmEventType = {
  ADDR_RESOLVED: 0,
  ADDR_ERROR: 1,
  ROUTE_RESOLVED: 2,
  ROUTE_ERROR: 3,
  CONNECT_REQUEST: 4,
  CONNECT_RESPONSE: 5,
  CONNECT_ERROR: 6,
  UNREACHABLE: 7,
  REJECTED: 8,
  ESTABLISHED: 9,
  DISCONNECTED: 10,
  DEVICE_REMOVAL: 11,
  MULTICAST_JOIN: 12,
  MULTICAST_ERROR: 13,
  ADDR_CHANGE: 14,
  TIMEWAIT_EXIT: 15,
} as const;

/** struct rdma_conn_param as an event carries it. */
export interface CmConnParam {
  qpNum: number;
  responderResources: number;
  initiatorDepth: number;
  retryCount: number;
  rnrRetryCount: number;
  srq: number;
}

/** What an id is bound or resolved to. */
export interface CmInfo {
  /** The RDMA device the id is bound/resolved to (null before that). */
  deviceName: string | null;
  deviceGuid: string | null;
  portNum: number;
  localAddr: string;
  localPort: number;
  peerAddr: string;
  peerPort: number;
}

/** rdma_init_qp_attr's answer: the path and the peer's parameters for a QP transition. */
export interface CmQpAttr {
  mask: number;
  portNum: number;
  qpAccessFlags: number;
  pkeyIndex: number;
  /** bytes (0: not given) */
  pathMtu: number;
  destQpNum: number;
  rqPsn: number;
  sqPsn: number;
  maxDestRdAtomic: number;
  maxRdAtomic: number;
  minRnrTimer: number;
  timeout: number;
  retryCnt: number;
  rnrRetry: number;
  isGlobal: number;
  dlid: number;
  sl: number;
  /** ipv6 text form */
  dgid: string;
  sgidIndex: number;
  hopLimit: number;
  trafficClass: number;
}

/** An RDMA CM event (rdma_cm_event). */
export interface CmEvent {
  type: number;
  /** "CONNECT_REQUEST", … */
  name: string;
  /** 0, a negative errno, or (REJECTED) the IB CM reject reason. */
  status: number;
  privateData: Uint8Array | null;
  conn: CmConnParam | null;
  /** CONNECT_REQUEST: the new id of the incoming connection. */
  child: CmId | null;
}

/** Read/atomic depths and retries carried by connect and accept. */
export interface CmConnectParams {
  responderResources: number;
  initiatorDepth: number;
  retryCount: number;
  rnrRetryCount: number;
}

/**
 * One rdma_cm_id, user-managed QP model: the CM never creates a QP; the
 * caller creates its own on the device {@link CmId.info} names, passes its
 * number to connect/accept and drives INIT → RTR → RTS with
 * {@link CmId.initQpAttr}. Events go to `onEvent` when set, else queue for
 * {@link CmId.next}.
 */
export interface CmId {
  /** Receives every event when set (else they queue for next()). */
  onEvent: ((e: CmEvent) => void) | null;
  readonly isDestroyed: boolean;
  /** The next event, or TIMEOUT / ABORTED when the deadline passes or the signal aborts first. */
  next(what: string, timeoutMs: number, signal?: AbortSignal): Promise<CmEvent>;
  /** rdma_bind_addr (host null: any address). */
  bind(host: string | null, port: number): void;
  /** rdma_listen. */
  listen(backlog?: number): void;
  /** rdma_resolve_addr: ADDR_RESOLVED or ADDR_ERROR follows. */
  resolveAddr(src: string | null, dst: string, port: number, timeoutMs: number): void;
  /** rdma_resolve_route: ROUTE_RESOLVED or ROUTE_ERROR follows. */
  resolveRoute(timeoutMs: number): void;
  /** rdma_connect with the caller's QP number and private data. */
  connect(qpNum: number, privateData: Uint8Array, p: CmConnectParams): void;
  /** rdma_accept with the caller's QP number and private data. */
  accept(qpNum: number, privateData: Uint8Array, p: CmConnectParams): void;
  /** rdma_establish: the client confirms a connection whose QP it moved to RTS itself. */
  establish(): void;
  /** rdma_reject, with optional private data. */
  reject(privateData: Uint8Array | null): void;
  /** Sends a DREQ (both sides then see DISCONNECTED); never throws. */
  disconnect(): void;
  /** The device, port and addresses the id is bound to. */
  info(): CmInfo;
  /** rdma_init_qp_attr for INIT (1), RTR (2) or RTS (3). */
  initQpAttr(state: 1 | 2 | 3): CmQpAttr;
  /** rdma_destroy_id; idempotent. Queued children are destroyed too. */
  destroy(): void;
  /** The name of errno `n` (e.g. "ECONNREFUSED"). */
  errnoName(n: number): string;
}

/** The librdmacm binding: creates ids. */
export interface RdmaCm {
  /** rdma_create_id (TCP port space). */
  createId(): CmId;
  /** The IB CM reject reason for a REJECTED event's status, in words. */
  rejectReason(status: number): string;
}
