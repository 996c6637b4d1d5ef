/**
 * One-sided operations of one connection: RDMA WRITE (with immediate),
 * READ and the atomics, checked and queued.
 *
 * Invariants:
 * - a RemoteMr is used only on the connection it came from (`lease.owner`,
 *   recorded by the memory protocol when the region arrived) and only with
 *   the rights its owner gave, within its lease: checkRemote is the one
 *   check, made before anything is queued;
 * - a transfer is posted as work requests of at most CHUNK_BYTES (one
 *   operation, settled when the last completes); a WRITE_WITH_IMM carries its
 *   immediate on the last, which RC orders after the others;
 * - the memory of an operation is pinned (`inflight`) from here until it
 *   settles (ops.ts).
 */
import { RdmaError } from "../errors.js";
import { SendFlags, WrOpcode, type SendWr } from "../transport/types.js";
import { LocalMemory, type LocalMr, type RemoteLease, type RemoteMr } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import { abortError } from "./queue.js";
import { newOp, type Op, type OpTable } from "./ops.js";
import type { Pending } from "./send-lanes.js";

/**
 * One-sided transfers are posted as work requests of at most this many bytes
 * (one operation, one promise): completions keep coming during a long
 * transfer, so progress is visible to the peer timeout.
 */
export const CHUNK_BYTES = 8 << 20;

/** What one-sided operations need from their connection. */
export interface OneSidedHost {
  /** Throws when the connection is closing or failed. */
  checkOpen(what: string): void;
  /** Queues a work request in its lane (send-lanes.ts). */
  enqueue(p: Pending): void;
}

export class OneSided {
  constructor(
    private readonly host: OneSidedHost,
    private readonly ops: OpTable,
    private readonly pool: MrPool,
    /** The connection, as the memory protocol records it in `lease.owner`. */
    private readonly owner: object,
  ) {}

  /**
   * Posts a one-sided transfer as work requests of at most CHUNK_BYTES each
   * (one op, settled when the last completes; a WRITE_WITH_IMM carries its
   * immediate on the last one, which RC orders after the others).
   */
  transfer(op: Op, opcode: (typeof WrOpcode)[keyof typeof WrOpcode], lmr: LocalMr, remoteAddr: number, rkey: number, imm: number | undefined, credit: number, internal = false, lease?: RemoteLease): void {
    const len = lmr.length;
    const n = Math.max(1, Math.ceil(len / CHUNK_BYTES));
    op.parts = n;
    const sge = len > 0 ? lmr.sge() : null;
    for (let i = 0; i < n; i++) {
      const off = i * CHUNK_BYTES;
      const last = i === n - 1;
      const part = Math.min(CHUNK_BYTES, len - off);
      const wr: SendWr = {
        wrId: 0,
        opcode: last || opcode !== WrOpcode.RDMA_WRITE_WITH_IMM ? opcode : WrOpcode.RDMA_WRITE,
        flags: SendFlags.SIGNALED,
        sgList: sge ? [{ addr: sge.addr + off, length: part, lkey: sge.lkey }] : [],
        remoteAddr: remoteAddr + off,
        rkey,
      };
      if (last && imm !== undefined) wr.imm = imm;
      this.host.enqueue({ wr, op, credit: last ? credit : 0, hdr: null, internal, lease });
    }
  }

  /**
   * The one check of who may use a RemoteMr: the connection it came from
   * (the memory protocol records it in `lease.owner` when the region
   * arrives). Its rkey is valid only there (the peer registered it in that
   * connection's protection domain), so any other connection refuses it here,
   * before anything is posted, instead of dying of a remote access error.
   */
  checkRemote(rmr: RemoteMr, what: string): void {
    if (rmr.lease.owner !== null && rmr.lease.owner !== this.owner) {
      throw new RdmaError("INVALID_ARGUMENT", `${what}: this RemoteMr was granted, lent or shared to another connection: its rkey is valid only there (the peer registered it in that connection's protection domain)`);
    }
    rmr.lease.check(what);
    // The rights the owner gave (its registration enforces them too): refused before posting.
    const need = what === "read" ? null : what === "write" || what === "writeWithImm" ? "write" : what === "fetchAndAdd" || what === "compareAndSwap" ? "atomic" : null;
    if ((need === "write" && rmr.access === "read") || (need === "atomic" && rmr.access !== "atomic")) {
      throw new RdmaError("REMOTE_ACCESS", `${what}: the owner gave ${rmr.access} access to this region (${rmr.access === "read" ? "read only" : "read and write, no atomics"})`);
    }
  }

  /** One-sided WRITE (optionally with immediate, which consumes a peer receive and so a credit). */
  write(lmr: LocalMr, rmr: RemoteMr, imm: number | undefined, signal?: AbortSignal): Promise<void> {
    const what = imm === undefined ? "write" : "writeWithImm";
    this.host.checkOpen(what);
    lmr.mem.check(what);
    this.checkRemote(rmr, what);
    if (signal?.aborted) throw abortError(signal);
    if (lmr.length > rmr.length) throw new RdmaError("OUT_OF_RANGE", `write of ${lmr.length} bytes into a ${rmr.length}-byte remote region`);
    const op = newOp("write");
    lmr.mem.inflight++;
    op.mem = lmr.mem;
    const p = this.ops.track<void>(op, signal);
    this.transfer(op, imm === undefined ? WrOpcode.RDMA_WRITE : WrOpcode.RDMA_WRITE_WITH_IMM, lmr, rmr.addr, rmr.rkey, imm, imm === undefined ? 0 : 2, false, rmr.lease);
    return p;
  }

  read(lmr: LocalMr, rmr: RemoteMr, signal?: AbortSignal): Promise<void> {
    this.host.checkOpen("read");
    lmr.mem.check("read");
    this.checkRemote(rmr, "read");
    if (signal?.aborted) throw abortError(signal);
    if (lmr.length > rmr.length) throw new RdmaError("OUT_OF_RANGE", `read of ${lmr.length} bytes from a ${rmr.length}-byte remote region`);
    const op = newOp("read");
    lmr.mem.inflight++;
    op.mem = lmr.mem;
    const p = this.ops.track<void>(op, signal);
    this.transfer(op, WrOpcode.RDMA_READ, lmr, rmr.addr, rmr.rkey, undefined, 0, false, rmr.lease);
    return p;
  }

  atomic(rmr: RemoteMr, opcode: typeof WrOpcode.ATOMIC_CMP_AND_SWP | typeof WrOpcode.ATOMIC_FETCH_AND_ADD, compareAdd: bigint, swap: bigint, signal?: AbortSignal): Promise<bigint> {
    const what = opcode === WrOpcode.ATOMIC_CMP_AND_SWP ? "compareAndSwap" : "fetchAndAdd";
    this.host.checkOpen(what);
    this.checkRemote(rmr, what);
    if (signal?.aborted) throw abortError(signal);
    if (rmr.length < 8) throw new RdmaError("OUT_OF_RANGE", `${what} needs 8 bytes of remote memory, the region has ${rmr.length}`);
    // Checked here: on the wire a misaligned atomic is a fatal error for the whole connection.
    if (rmr.addr % 8 !== 0) throw new RdmaError("INVALID_ARGUMENT", `${what} needs an 8-byte aligned remote address (0x${rmr.addr.toString(16)})`);
    const op = newOp("atomic");
    const res = new LocalMemory(this.pool, this.pool.alloc(8));
    op.result = res;
    const p = this.ops.track<bigint>(op, signal);
    const a = res.alloc;
    this.host.enqueue({ wr: { wrId: 0, opcode, flags: SendFlags.SIGNALED, sgList: [{ addr: a.addr, length: 8, lkey: a.mr.lkey }], remoteAddr: rmr.addr, rkey: rmr.rkey, compareAdd, swap }, op, credit: 0, hdr: null, lease: rmr.lease });
    return p;
  }
}
