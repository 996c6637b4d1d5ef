/**
 * The whole surface of the native addon (native/verbs.c), typed in one place,
 * and its loader. Nothing else imports the .node file.
 *
 * Handles are opaque napi externals; each keeps its native object (and,
 * through native reference counts, everything that object depends on) alive
 * until it is garbage collected, so JS may drop them in any order.
 *
 * Errors thrown by the addon are plain Errors with an `errno` property (an
 * errno name such as "EINVAL", or "DESTROYED" for a released object); the
 * provider turns them into RdmaError (see errors.ts in this folder).
 */
import { createRequire } from "node:module";
import { existsSync, readdirSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

declare const handleBrand: unique symbol;
/** An opaque native object of kind K. */
export type Handle<K extends string> = { readonly [handleBrand]: K };
export type ContextHandle = Handle<"context">;
export type PdHandle = Handle<"pd">;
export type CqHandle = Handle<"cq">;
export type QpHandle = Handle<"qp">;
export type MrHandle = Handle<"mr">;
export type MwHandle = Handle<"mw">;

export interface NativeDeviceInfo {
  name: string;
  /** "xxxx:xxxx:xxxx:xxxx" */
  guid: string;
  nodeType: number;
  transportType: number;
}

/** ibv_device_attr (numbers as the C fields), plus the measured max inline size. */
export interface NativeDeviceAttr {
  fwVer: string;
  nodeGuid: string;
  vendorId: number;
  vendorPartId: number;
  maxMrSize: number;
  maxQp: number;
  maxQpWr: number;
  maxSge: number;
  maxCq: number;
  maxCqe: number;
  maxMr: number;
  maxPd: number;
  maxQpRdAtom: number;
  maxQpInitRdAtom: number;
  /** enum ibv_atomic_cap: 0 NONE, 1 HCA, 2 GLOB */
  atomicCap: number;
  maxMw: number;
  /** enum ibv_device_cap_flags bits */
  deviceCapFlags: number;
  physPortCnt: number;
  /** Largest max_inline_data a QP could be created with. */
  maxInline: number;
}

export interface NativePortAttr {
  /** enum ibv_port_state */
  state: number;
  /** bytes */
  activeMtu: number;
  maxMtu: number;
  /** 0 unspecified, 1 InfiniBand, 2 Ethernet */
  linkLayer: number;
  lid: number;
  gidTblLen: number;
  gids: { index: number; gid: string; type?: string }[];
}

/** Shared-buffer layout constants, as compiled into the addon (checked against codec.ts at load). */
export interface NativeLayout {
  ctrlBytes: number;
  sendWrBytes: number;
  recvWrBytes: number;
  sgeBytes: number;
}

export interface NativeAddon {
  readonly layout: NativeLayout;
  /** ibv_get_device_list ([] when the kernel has no RDMA support). */
  listDevices(): NativeDeviceInfo[];
  /** ibv_open_device of `name` (null: the first device); async events go to `onAsync`. */
  open(name: string | null, onAsync: (type: number, qpNum: number, portNum: number, text: string) => void): ContextHandle;
  /** Releases everything opened on the context (windows, QPs, MRs, CQs, PDs), then the context. */
  close(ctx: ContextHandle): void;
  queryDevice(ctx: ContextHandle): NativeDeviceAttr;
  queryPort(ctx: ContextHandle, port: number): NativePortAttr;
  queryGid(ctx: ContextHandle, port: number, index: number): string;
  allocPd(ctx: ContextHandle): PdHandle;
  deallocPd(pd: PdHandle): void;
  /** Page-aligned zeroed memory, registered: [handle, external ArrayBuffer, addr, lkey, rkey]. */
  regMr(pd: PdHandle, length: number, access: number): [MrHandle, ArrayBuffer, number, number, number];
  /**
   * The caller's memory (kept alive by the MR until it is deregistered; when
   * it is this addon's own memory, e.g. a range of another MR's buffer, the
   * memory itself is held, so detaching that buffer frees nothing under the
   * registration): [handle, addr, lkey, rkey].
   */
  /** `buffer`: an ArrayBuffer, or a Uint8Array over a SharedArrayBuffer (its memory; the registration holds it). */
  regMrUser(pd: PdHandle, buffer: ArrayBuffer | Uint8Array, offset: number, length: number, access: number): [MrHandle, number, number, number];
  /** ibv_dereg_mr; provider-allocated memory's ArrayBuffer and all its alias buffers are detached. */
  deregMr(mr: MrHandle): void;
  /**
   * A new external ArrayBuffer over bytes [offset, offset+length) of a
   * provider-allocated MR's memory, holding a reference on that memory (freed
   * with the last reference), detachable on its own, detached by deregMr.
   */
  aliasMr(mr: MrHandle, offset: number, length: number): ArrayBuffer;
  /** napi_detach_arraybuffer of an external ArrayBuffer (structuredClone cannot detach those). */
  detachBuffer(ab: ArrayBuffer): void;
  /** [handle, initial rkey] */
  allocMw(pd: PdHandle, type: 1 | 2): [MwHandle, number];
  deallocMw(mw: MwHandle): void;
  /** [handle, actual cqe]; `onNotify` runs once per reqNotifyCq when a completion arrives. */
  createCq(ctx: ContextHandle, depth: number, onNotify: () => void): [CqHandle, number];
  destroyCq(cq: CqHandle): void;
  reqNotifyCq(cq: CqHandle): void;
  /** Whether the CQ, while armed, keeps the event loop alive (the provider sets it while onNotify is set). */
  keepAliveCq(cq: CqHandle, on: boolean): void;
  /** ibv_poll_cq straight into the arrays; returns the count. */
  pollCq(
    cq: CqHandle,
    max: number,
    wrId: Float64Array,
    status: Uint8Array,
    opcode: Uint8Array,
    flags: Uint8Array,
    byteLen: Uint32Array,
    imm: Uint32Array,
    qpNum: Uint32Array,
    vendorErr: Uint32Array,
  ): number;
  /** ibv_create_qp (RC) + INIT: [handle, qpNum, maxSendWr, maxRecvWr, maxSendSge, maxRecvSge, maxInline]. */
  createQp(
    pd: PdHandle,
    sendCq: CqHandle,
    recvCq: CqHandle,
    maxSendWr: number,
    maxRecvWr: number,
    maxSendSge: number,
    maxRecvSge: number,
    maxInline: number,
    sqSigAll: number,
    portNum: number,
    access: number,
  ): [QpHandle, number, number, number, number, number, number];
  /** INIT -> RTR -> RTS with GID addressing. */
  connectQp(
    qp: QpHandle,
    portNum: number,
    gidIndex: number,
    mtu: number,
    destQpn: number,
    rqPsn: number,
    sqPsn: number,
    dlid: number,
    dgid: string,
    timeout: number,
    retryCnt: number,
    rnrRetry: number,
    minRnrTimer: number,
    maxRdAtomic: number,
    maxDestRdAtomic: number,
  ): void;
  setQpError(qp: QpHandle): void;
  /** enum ibv_qp_state, -1 once destroyed. */
  queryQpState(qp: QpHandle): number;
  destroyQp(qp: QpHandle): void;
  /**
   * One ibv_post_send of the `count` WRs encoded in `buf` (codec.ts). Returns
   * 0, an errno (> 0) or a POST_* code (< 0); on failure the u32 at buf[0]
   * is the index of the first WR not posted. `objs` holds the MW/MR handles
   * BIND_MW records refer to by index.
   */
  postSend(qp: QpHandle, buf: ArrayBuffer, count: number, objs: readonly (MwHandle | MrHandle)[] | undefined): number;
  postRecv(qp: QpHandle, buf: ArrayBuffer, count: number): number;
  errnoName(errno: number): string;
  /**
   * For tests of lifetimes: native objects not yet freed (by kind),
   * provider-allocated memory blocks not yet freed, and handles not yet
   * collected, in this environment.
   */
  debugLive(): NativeLiveCounts;
  /** For tests: references held on the provider memory block that holds [addr, addr+length) (0: none, or freed). */
  debugMemRefs(addr: number, length: number): number;
}

export interface NativeLiveCounts {
  device: number;
  pd: number;
  cq: number;
  qp: number;
  mr: number;
  mw: number;
  /** provider-allocated memory blocks (regMr) */
  memory: number;
  /** native handles (JS externals) not yet collected */
  handles: number;
}

/** postSend/postRecv results other than an errno. */
export const POST_DESTROYED = -1;
export const POST_BAD_BUFFER = -2;
export const POST_BAD_RECORD = -3;

export const ADDON_FILE = "async_rdma_verbs.node";

/** The package root (dist/src/transport/verbs -> 4 up; src/transport/verbs under a TS loader -> 3 up), or null. */
function packageRoot(): string | null {
  const here = dirname(fileURLToPath(import.meta.url));
  for (const up of ["../../../..", "../../.."]) {
    const root = join(here, up);
    if (existsSync(join(root, "package.json"))) return root;
  }
  return null;
}

/**
 * How to rebuild the addon, as the reader of a hint can run it: inside a
 * consumer's node_modules, `npm rebuild async-rdma` (the install script:
 * prebuild or compile); in a checkout of the project, `npm run build:native`.
 */
export function rebuildCommand(): string {
  const root = packageRoot();
  return root !== null && basename(dirname(root)) === "node_modules" ? "npm rebuild async-rdma" : "npm run build:native";
}

/**
 * The prebuild directory and file suffix for this machine: prebuilds/linux-x64
 * and ".glibc.node" (scripts/prebuild.mjs names them so); null where no
 * prebuild can fit (not linux, or musl: its dynamic loader is in /lib). Not
 * process.report: a report walks every open handle (and may resolve their
 * addresses), and the provider loads in a process that has sockets open.
 */
export function prebuildTag(): { dir: string; suffix: string } | null {
  if (process.platform !== "linux") return null;
  let musl = false;
  try {
    musl = readdirSync("/lib").some((n) => n.startsWith("ld-musl-"));
  } catch {
    /* no /lib: assume glibc; a prebuild that does not fit fails to load and says so */
  }
  return musl ? null : { dir: `${process.platform}-${process.arch}`, suffix: ".glibc.node" };
}

/**
 * Where `file` (async_rdma_verbs.node or async_rdma_cm.node) is looked for, in
 * order: the package's build/Release (compiled here: a source build wins, as
 * with node-gyp-build), then its prebuilds/<platform>-<arch>/ (shipped in the
 * package).
 */
function candidatesFor(file: string): string[] {
  const root = packageRoot();
  if (root === null) return [];
  const out = [join(root, "build", "Release", file)];
  const tag = prebuildTag();
  if (tag) out.push(join(root, "prebuilds", tag.dir, file.replace(/\.node$/, tag.suffix)));
  return out;
}

/** Where the addon is looked for: $ASYNC_RDMA_NATIVE, then build/Release, then the prebuild. */
export function addonCandidates(): string[] {
  return [...(process.env.ASYNC_RDMA_NATIVE ? [process.env.ASYNC_RDMA_NATIVE] : []), ...candidatesFor(ADDON_FILE)];
}

/**
 * Why an addon that exists failed to load, and the fix. A missing shared
 * library (no rdma-core on this machine) is fixed by installing it, not by
 * rebuilding; anything else (a prebuild for a newer glibc, a stale build) by
 * rebuilding from source.
 */
export function explainLoadFailure(what: string, path: string, message: string): string {
  const first = message.split("\n")[0] ?? "";
  const lib = /(lib(?:ibverbs|rdmacm|nl-[\w-]+)[^:\s]*): cannot open shared object/.exec(first);
  if (lib) {
    const pkg = lib[1]!.startsWith("librdmacm") ? "librdmacm1 rdma-core" : "libibverbs1 ibverbs-providers rdma-core";
    return `${lib[1]} is missing, so ${what} cannot load (${first}). Fix: apt-get install -y ${pkg}; the tcp provider works without it`;
  }
  return `${what} ${path} failed to load: ${first}. Fix: rebuild it from source with \`${rebuildCommand()}\` (needs libibverbs-dev librdmacm-dev and a C toolchain)`;
}

export type LoadResult = { ok: true; addon: NativeAddon; path: string } | { ok: false; reason: string };

/** Loads the first candidate that exists and loads; the first failure explains why none did. */
function loadFirst<T>(what: string, tried: string[], notBuilt: string): { ok: true; addon: T; path: string } | { ok: false; reason: string } {
  const req = createRequire(import.meta.url);
  let failure: string | null = null;
  for (const path of tried) {
    if (!existsSync(path)) continue;
    try {
      return { ok: true, addon: req(path) as T, path };
    } catch (e) {
      failure ??= explainLoadFailure(what, path, (e as Error).message);
    }
  }
  return { ok: false, reason: failure ?? notBuilt };
}

let cached: LoadResult | null = null;

export function loadAddon(): LoadResult {
  if (cached) return cached;
  const tried = addonCandidates();
  cached = loadFirst<NativeAddon>(
    "the native addon",
    tried,
    `the native addon is not built, and no prebuild fits this machine (looked for ${tried.join(", ") || ADDON_FILE}). ` +
      `Fix: install the rdma-core headers and a toolchain (apt-get install -y libibverbs-dev librdmacm-dev ibverbs-providers rdma-core build-essential python3), then \`${rebuildCommand()}\``,
  );
  return cached;
}

// ------------------------------------------------------------------ RDMA CM
// The librdmacm addon (native/cm.c -> build/Release/async_rdma_cm.node), built
// next to the verbs addon when the librdmacm headers exist. Typed here; cm.ts
// wraps it.

export type CmIdHandle = Handle<"cm_id">;

/** rdma_conn_param as delivered with CONNECT_REQUEST / CONNECT_RESPONSE / ESTABLISHED. */
export interface NativeCmConnParam {
  qpNum: number;
  responderResources: number;
  initiatorDepth: number;
  retryCount: number;
  rnrRetryCount: number;
  srq: number;
}

/** What rdma_init_qp_attr gives for one state (fields outside `mask` are 0). */
export interface NativeCmQpAttr {
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

export interface NativeCmInfo {
  /** The RDMA device the id is bound/resolved to (null before that). */
  deviceName: string | null;
  deviceGuid: string | null;
  portNum: number;
  localAddr: string;
  localPort: number;
  peerAddr: string;
  peerPort: number;
}

export type NativeCmEventHandler = (
  token: number,
  type: number,
  status: number,
  privateData: ArrayBuffer | null,
  conn: NativeCmConnParam | null,
  child: [CmIdHandle, number] | null,
) => void;

export interface NativeCmAddon {
  /** The one handler of the environment's event channel; events carry the id's token. */
  init(onEvent: NativeCmEventHandler): void;
  /** rdma_create_id(RDMA_PS_TCP) on the environment's channel: [handle, token]. */
  createId(): [CmIdHandle, number];
  bindAddr(id: CmIdHandle, host: string | null, port: number): void;
  listen(id: CmIdHandle, backlog: number): void;
  resolveAddr(id: CmIdHandle, srcHost: string | null, dstHost: string, dstPort: number, timeoutMs: number): void;
  resolveRoute(id: CmIdHandle, timeoutMs: number): void;
  /** Private data ≤ 56 bytes. */
  connect(id: CmIdHandle, qpNum: number, privateData: Uint8Array | null, responderResources: number, initiatorDepth: number, retryCount: number, rnrRetryCount: number): void;
  /** Private data ≤ 196 bytes. */
  accept(id: CmIdHandle, qpNum: number, privateData: Uint8Array | null, responderResources: number, initiatorDepth: number, retryCount: number, rnrRetryCount: number): void;
  /** rdma_establish: the active side, QP in RTS, after CONNECT_RESPONSE. */
  establish(id: CmIdHandle): void;
  /** Private data ≤ 148 bytes. */
  reject(id: CmIdHandle, privateData: Uint8Array | null): void;
  /** 0 or an errno (not thrown: disconnecting an unconnected id is harmless). */
  disconnect(id: CmIdHandle): number;
  /** Idempotent. */
  destroyId(id: CmIdHandle): void;
  info(id: CmIdHandle): NativeCmInfo;
  /** rdma_init_qp_attr for INIT (1), RTR (2) or RTS (3). */
  initQpAttr(id: CmIdHandle, state: 1 | 2 | 3): NativeCmQpAttr;
  /** Whether the event channel keeps the event loop alive. */
  keepAlive(on: boolean): void;
  eventName(type: number): string;
  errnoName(errno: number): string;
}

export const CM_ADDON_FILE = "async_rdma_cm.node";

let cmCached: { ok: true; addon: NativeCmAddon } | { ok: false; reason: string } | null = null;

/** Loads the RDMA CM addon from where the verbs addon is ($ASYNC_RDMA_NATIVE_CM overrides). */
export function loadCmAddon(): { ok: true; addon: NativeCmAddon } | { ok: false; reason: string } {
  if (cmCached) return cmCached;
  const override = process.env.ASYNC_RDMA_NATIVE_CM;
  const tried = [...(override ? [override] : []), ...(process.env.ASYNC_RDMA_NATIVE ? [join(dirname(process.env.ASYNC_RDMA_NATIVE), CM_ADDON_FILE)] : []), ...candidatesFor(CM_ADDON_FILE)];
  const r = loadFirst<NativeCmAddon>(
    "the RDMA CM addon",
    tried,
    `the RDMA CM addon is not built, and no prebuild fits this machine (looked for ${tried.join(", ") || CM_ADDON_FILE}). Fix: apt-get install -y librdmacm-dev, then \`${rebuildCommand()}\``,
  );
  cmCached = r.ok ? { ok: true, addon: r.addon } : r;
  return cmCached;
}
