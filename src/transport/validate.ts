/**
 * The checks every provider makes, the same way, before it posts a work
 * request, registers memory or creates a QP. Anything these functions refuse
 * never reaches a device or the wire: the caller gets INVALID_ARGUMENT naming
 * the field (and, for work requests, the index of the first bad WR, so the
 * WRs before it stay posted as with verbs' bad_wr).
 *
 * Pure: no provider state, no I/O; imports only the seam's types and the
 * errors. What needs a provider's own tables (is this lkey a live MR of this
 * PD? is this window one of ours?) stays in the provider.
 *
 * The rules (docs/architecture.md, "Checks before posting"):
 *
 * - wrId: a finite number (its bits come back unchanged in the completion).
 * - opcode: one of WrOpcode; flags: only SendFlags bits.
 * - keys (lkey, rkey, invalidateRkey, bindRkey) and immediate data: 32-bit
 *   unsigned integers. A negative number is refused, not reinterpreted.
 * - addresses (SGE addr, remoteAddr, bind addr and length): non-negative safe integers.
 * - an SGE's length, and a send's total length: at most 2^31 (RC's maximum message).
 * - scatter/gather lists: at most the QP's maxSendSge / maxRecvSge entries.
 * - WRITE, WRITE_WITH_IMM, READ and atomics name remoteAddr and rkey.
 * - atomics: exactly one 8-byte SGE, bigint operands, remoteAddr 8-byte aligned.
 * - INLINE sends and writes: at most the QP's maxInlineData bytes.
 * - LOCAL_INV names invalidateRkey; BIND_MW names mw, bindRkey and bind { mr, addr, length, access }.
 * - registration: access flags within ibv_access_flags, and remote write or
 *   remote atomic only together with local write (verbs: EINVAL).
 */
import { RdmaError, checkInt } from "../errors.js";
import { Access, SendFlags, WrOpcode, type DeviceAttr, type QpInitAttr, type RecvWr, type SendWr, type Sge } from "./types.js";

/** RC's largest message, bytes (IBA: 2^31). Also the most one SGE may name. */
export const MAX_MESSAGE_SIZE = 0x80000000;
export const MAX_U32 = 0xffffffff;

const ALL_SEND_FLAGS = SendFlags.FENCE | SendFlags.SIGNALED | SendFlags.SOLICITED | SendFlags.INLINE;
const ALL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC | Access.MW_BIND;

function bad(where: string, what: string, errno?: string): RdmaError {
  return new RdmaError("INVALID_ARGUMENT", `${where}: ${what}`, errno === undefined ? {} : { errnoName: errno });
}

function isU32(v: unknown): v is number {
  return typeof v === "number" && Number.isInteger(v) && v >= 0 && v <= MAX_U32;
}

function isAddress(v: unknown): v is number {
  return typeof v === "number" && Number.isSafeInteger(v) && v >= 0;
}

/** `v` as a key or immediate: an integer in [0, 2^32). */
export function checkU32(where: string, name: string, v: unknown): number {
  if (!isU32(v)) throw bad(where, `${name} must be a 32-bit unsigned integer, got ${String(v)}`);
  return v;
}

/** `v` as an address or a length in the address space: a non-negative safe integer. */
export function checkAddress(where: string, name: string, v: unknown): number {
  if (!isAddress(v)) throw bad(where, `${name} must be a non-negative integer, got ${String(v)}`);
  return v;
}

/** "work request #i" for the first indices of a list, made once: validation runs per posted WR, a string per post is heap per message. */
const SEND_WHERE: string[] = [];
const RECV_WHERE: string[] = [];
function whereOf(cache: string[], prefix: string, i: number): string {
  if (i >= 64) return `${prefix}${i}`;
  return (cache[i] ??= `${prefix}${i}`);
}

function checkWrId(where: string, wr: unknown): void {
  if (wr === null || typeof wr !== "object") throw bad(where, "not a work request object");
  const id = (wr as { wrId?: unknown }).wrId;
  if (typeof id !== "number" || !Number.isFinite(id)) throw bad(where, `wrId must be a finite number, got ${String(id)}`);
}

/** One SGE: addr a non-negative safe integer, length in [0, 2^31], lkey a u32. */
export function validateSge(where: string, s: unknown): void {
  if (s === null || typeof s !== "object") throw bad(where, "bad scatter/gather element (not an object)");
  const { addr, length, lkey } = s as Partial<Sge>;
  if (!isAddress(addr)) throw bad(where, `bad scatter/gather element: addr must be a non-negative integer, got ${String(addr)}`);
  if (typeof length !== "number" || !Number.isInteger(length) || length < 0 || length > MAX_MESSAGE_SIZE) {
    throw bad(where, `bad scatter/gather element: length must be an integer in [0, 2^31], got ${String(length)}`);
  }
  if (!isU32(lkey)) throw bad(where, `bad scatter/gather element: lkey must be a 32-bit unsigned integer, got ${String(lkey)}`);
}

/** A scatter/gather list of at most `maxSge` valid entries; returns the bytes it names. */
export function validateSgList(where: string, list: unknown, maxSge: number): number {
  if (list === undefined) return 0;
  if (!Array.isArray(list) || list.length > maxSge) throw bad(where, `sgList must be an array of at most ${maxSge} entries (the QP's caps)`);
  let total = 0;
  for (const s of list as unknown[]) {
    validateSge(where, s);
    total += (s as Sge).length;
  }
  return total;
}

/** The QP caps a work request is checked against. */
export interface WrCaps {
  readonly maxSendSge: number;
  readonly maxRecvSge: number;
  readonly maxInlineData: number;
}

function isRemote(op: number): boolean {
  return op === WrOpcode.RDMA_WRITE || op === WrOpcode.RDMA_WRITE_WITH_IMM || op === WrOpcode.RDMA_READ || isAtomic(op);
}

function isAtomic(op: number): boolean {
  return op === WrOpcode.ATOMIC_CMP_AND_SWP || op === WrOpcode.ATOMIC_FETCH_AND_ADD;
}

/** Opcodes whose INLINE flag means "copy the gathered bytes at post time". */
export function carriesInline(op: number): boolean {
  return op === WrOpcode.SEND || op === WrOpcode.SEND_WITH_IMM || op === WrOpcode.RDMA_WRITE || op === WrOpcode.RDMA_WRITE_WITH_IMM;
}

/**
 * Send work request #i, checked against the QP's caps. Returns the message
 * length (the sum of its SGEs). Does not check that the SGEs name registered
 * memory, nor that a BIND_MW's window and MR belong to the provider: that
 * needs the provider's tables.
 */
export function validateSendWr(wr: SendWr, i: number, caps: WrCaps): number {
  const where = whereOf(SEND_WHERE, "work request #", i);
  checkWrId(where, wr);
  const op: unknown = wr.opcode;
  if (typeof op !== "number" || !Number.isInteger(op) || op < WrOpcode.RDMA_WRITE || op > WrOpcode.BIND_MW) throw bad(where, `unknown opcode ${String(op)}`);
  const flags: unknown = wr.flags ?? 0;
  if (typeof flags !== "number" || !Number.isInteger(flags) || flags < 0 || flags & ~ALL_SEND_FLAGS) throw bad(where, `unknown send flags ${String(flags)}`);
  if (wr.imm !== undefined) checkU32(where, "imm", wr.imm);
  if (wr.rkey !== undefined) checkU32(where, "rkey", wr.rkey);
  const len = validateSgList(where, wr.sgList, caps.maxSendSge);
  if (len > MAX_MESSAGE_SIZE) throw bad(where, `message of ${len} bytes exceeds 2^31`);
  if (isRemote(op)) {
    if (wr.remoteAddr === undefined || wr.rkey === undefined) throw bad(where, "this opcode needs remoteAddr and rkey");
    checkAddress(where, "remoteAddr", wr.remoteAddr);
  }
  if (isAtomic(op)) {
    if (wr.sgList?.length !== 1 || len !== 8) throw bad(where, "an atomic needs one 8-byte scatter/gather element");
    if (typeof (wr.compareAdd ?? 0n) !== "bigint" || typeof (wr.swap ?? 0n) !== "bigint") throw bad(where, "atomic operands must be bigint");
    // IBA: an atomic's target is 8-byte aligned; rxe refuses a misaligned one at post (EINVAL), and so does every provider here.
    if (wr.remoteAddr! % 8 !== 0) throw bad(where, `atomic target 0x${wr.remoteAddr!.toString(16)} is not 8-byte aligned`);
  }
  if (op === WrOpcode.LOCAL_INV) checkU32(where, "invalidateRkey (LOCAL_INV)", wr.invalidateRkey);
  if (op === WrOpcode.BIND_MW) {
    const b: unknown = wr.bind;
    if (wr.mw === null || typeof wr.mw !== "object" || b === null || typeof b !== "object" || (b as { mr?: unknown }).mr === null || typeof (b as { mr?: unknown }).mr !== "object") {
      throw bad(where, "BIND_MW needs a memory window, bindRkey and bind { mr, addr, length, access }");
    }
    checkU32(where, "bindRkey", wr.bindRkey);
    checkAddress(where, "bind.addr", wr.bind!.addr);
    checkAddress(where, "bind.length", wr.bind!.length);
    const acc: unknown = wr.bind!.access;
    if (typeof acc !== "number" || !Number.isInteger(acc) || acc < 0 || acc & ~ALL_ACCESS) throw bad(where, `bind.access must be Access bits, got ${String(acc)}`);
  }
  if (flags & SendFlags.INLINE && carriesInline(op) && len > caps.maxInlineData) {
    throw bad(where, `${len} inline bytes exceed maxInlineData ${caps.maxInlineData}`, "EINVAL");
  }
  return len;
}

/** Receive work request #i, checked against the QP's caps. Returns the bytes its SGEs name. */
export function validateRecvWr(wr: RecvWr, i: number, caps: WrCaps): number {
  const where = whereOf(RECV_WHERE, "receive work request #", i);
  checkWrId(where, wr);
  return validateSgList(where, wr.sgList, caps.maxRecvSge);
}

/** Access flags of an MR: ibv_access_flags bits; remote write or atomic needs local write (verbs: EINVAL). */
export function validateMrAccess(access: unknown): number {
  checkInt("access", access, 0, ALL_ACCESS);
  const a = access as number;
  if (a & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) && !(a & Access.LOCAL_WRITE)) {
    throw new RdmaError("INVALID_ARGUMENT", "remote write or atomic access requires LOCAL_WRITE (verbs refuses it with EINVAL)", { errnoName: "EINVAL" });
  }
  return a;
}

/**
 * What registerMr registers: `length` fresh bytes (memory a number), or the
 * range [offset, offset+length) of the caller's ArrayBuffer or
 * SharedArrayBuffer (length defaults to the rest of it). Refuses any other
 * object, a resizable or growable buffer (its memory may move or grow past
 * the registration), and ranges outside the buffer or
 * above `maxMrSize`. A detached buffer has no bytes and fails the length
 * check; providers say "detached" first.
 */
export function validateMrRange(memory: unknown, offset: unknown, length: unknown, maxMrSize: number): { offset: number; length: number } {
  const max = Math.min(maxMrSize, Number.MAX_SAFE_INTEGER);
  if (typeof memory === "number") return { offset: 0, length: checkInt("length", memory, 1, max) };
  if (memory instanceof SharedArrayBuffer) {
    if ((memory as SharedArrayBuffer & { growable?: boolean }).growable) throw new RdmaError("INVALID_ARGUMENT", "cannot register a growable SharedArrayBuffer: it can grow past the registration");
  } else if (!(memory instanceof ArrayBuffer)) throw new RdmaError("INVALID_ARGUMENT", "registerMr takes a length, an ArrayBuffer or a SharedArrayBuffer");
  else if ((memory as ArrayBuffer & { resizable?: boolean }).resizable) throw new RdmaError("INVALID_ARGUMENT", "cannot register a resizable ArrayBuffer: its memory may move");
  const off = checkInt("offset", offset, 0, memory.byteLength);
  const len = checkInt("length", length ?? memory.byteLength - off, 1, Math.min(memory.byteLength - off, max));
  return { offset: off, length: len };
}

/** The caps of ibv_create_qp, checked against the device's limits (defaults: one SGE each way, no inline data). */
export function validateQpCaps(init: QpInitAttr, attr: DeviceAttr): { maxSendWr: number; maxRecvWr: number; maxSendSge: number; maxRecvSge: number; maxInlineData: number } {
  return {
    maxSendWr: checkInt("maxSendWr", init.maxSendWr, 1, attr.maxQpWr),
    maxRecvWr: checkInt("maxRecvWr", init.maxRecvWr, 1, attr.maxQpWr),
    maxSendSge: checkInt("maxSendSge", init.maxSendSge ?? 1, 1, attr.maxSge),
    maxRecvSge: checkInt("maxRecvSge", init.maxRecvSge ?? 1, 1, attr.maxSge),
    maxInlineData: checkInt("maxInlineData", init.maxInlineData ?? 0, 0, attr.maxInline),
  };
}

/** qp_access_flags of ibv_create_qp/INIT: which remote operations the peer may target (default all). */
export function validateQpAccess(access: unknown): number {
  return checkInt("access", access ?? (Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC), 0, ALL_ACCESS);
}
