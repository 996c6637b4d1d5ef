/**
 * The send lanes: what waits to be posted, in which order, and how it is
 * posted. Four lanes, drained in this order at each flush:
 *
 * - `credit`: CREDIT messages. They may use the last credit, and never wait
 *   behind messages that are themselves waiting for credits.
 * - `internal`: the agent's own one-sided work (the READ of a rendezvous
 *   message it receives). It needs no credit and has no order with the
 *   user's operations; behind them it could deadlock, since the peer returns
 *   credits only as this side's messages are read, which may wait for it.
 * - `ctrl`: control messages (memory protocol, PING/PONG, RNDV_DONE).
 * - `data`: the user's operations in their order (messages, one-sided work,
 *   and control messages that must not overtake them).
 *
 * Invariants: one `postSend` list per flush, and one flush per microtask
 * checkpoint: it runs from `process.nextTick`, which Node runs once the
 * microtask queue is empty, so the sends that promise continuations make one
 * after another (a receive loop echoing each message it takes) go in one
 * list — one write on the tcp provider, one doorbell on verbs — instead of
 * one each (a queued microtask would run between two continuations);
 * nothing is posted without the credits credits.ts allows nor beyond the
 * send queue's depth; each posted list signals its last work
 * request and at least every SIGNAL_EVERY-th (selective signalling), and a
 * signalled completion completes every unsignalled request posted before it
 * (`unsignaledBefore`). A one-sided operation whose remote region was
 * revoked while it waited is dropped locally, never posted.
 */
import { RdmaError } from "../errors.js";
import { SendFlags, WrOpcode, type Sge, type SendWr } from "../transport/types.js";
import { LocalMemory, type RemoteLease } from "../memory/mr.js";
import type { MrPool } from "../memory/pool.js";
import { NEED, type Credits, type QueuedWork } from "./credits.js";
import { bytesOf, put32 } from "./codec.js";
import { newOp, type Op } from "./ops.js";
import type { Traffic } from "./stats.js";

/**
 * Size of a control-message buffer: codec.ts messages fit in it, and so does
 * a small message sent from a plain buffer (its header and bytes, copied:
 * Connection.sendCopy).
 */
export const CTRL_BUF = 256;
/** At least one signaled WR per this many, so the send queue drains under selective signaling. */
export const SIGNAL_EVERY = 32;

export interface Pending {
  wr: SendWr;
  op: Op;
  /** 0: no credit (one-sided), 1: control, 2: data message, 3: credit message */
  credit: number;
  /** The agent's own one-sided work: the `internal` lane (see above). */
  internal?: boolean;
  /**
   * A control message that must not overtake the user's operations queued
   * before it (the acknowledgement of a revocation): it goes in the data
   * lane, in order, with a control message's credit need.
   */
  ordered?: boolean;
  /**
   * The remote region a one-sided operation targets: if its owner revoked it
   * while the operation still waited in the queue, the operation is dropped
   * locally (REMOTE_ACCESS) instead of reaching memory that may be gone.
   */
  lease?: RemoteLease | undefined;
  /** Runs when the work request is taken for posting (a rendezvous copies into bounce memory then). */
  onPost?: () => void;
  /** control buffer whose header gets the piggybacked credit count */
  hdr: LocalMemory | null;
  /**
   * A record of the lanes' own free list ({@link SendLanes.record}): taken
   * back, with its work request and scatter/gather elements, as soon as the
   * list it was posted in returns from postSend (the provider copies what it
   * keeps then).
   */
  pooled?: SendRecord;
}

/** A two-sided SEND's record, reused: its work request and its header (and payload) elements. */
export interface SendRecord extends Pending {
  wr: SendWr & { sgList: Sge[] };
  /** The header's element, alone (a control message, an empty DATA message)… */
  one: Sge[];
  /** …or followed by the payload's. */
  two: Sge[];
}

/** One flush's lists: `n` work requests to post, `nr` of them from records to take back after. */
interface FlushLists {
  wrs: SendWr[];
  n: number;
  recs: SendRecord[];
  nr: number;
}

function newLists(): FlushLists {
  return { wrs: [], n: 0, recs: [], nr: 0 };
}

/** Placeholder operation of a free record (so it holds on to nothing). */
const NO_OP = newOp("msg");

/** Credits the head of the data lane needs: a data message, an ordered control message, or one-sided work (none). */
export function dataNeed(p: Pending): number {
  return p.credit === 2 ? NEED.data : p.credit === 1 ? NEED.ctrl : 0;
}

/** What the lanes need from the connection. */
export interface LanesHost {
  /** Set once the connection failed: nothing more is posted (but a closing one still sends its CLOSE). */
  readonly failure: RdmaError | null;
  /** A wrId for `op` (ops.ts). */
  slot(op: Op): number;
  /** An operation none of whose work requests was posted: its resources freed, its promise rejected. */
  dropQueued(op: Op, parts: Pending[], err: unknown): void;
  /** Posts one list (already counted in `outstanding`); `wasIdle`: nothing was outstanding before it. The list and its work requests are lent for the call only (reused after it): copy what is kept. */
  post(batch: SendWr[], wasIdle: boolean): void;
  /** Queues a CREDIT message (the credit rule asked for one). */
  sendCredits(): void;
}

/** Control-message buffers are recycled: no allocation, registration or detach per message. */
export class HeaderPool {
  private readonly free: LocalMemory[] = [];
  constructor(
    private readonly pool: MrPool,
    /** Kept at most (the send depth). */
    private readonly max: number,
    private readonly ended: () => boolean,
  ) {}

  take(): LocalMemory {
    return this.free.pop() ?? new LocalMemory(this.pool, this.pool.alloc(CTRL_BUF));
  }

  put(h: LocalMemory): void {
    if (this.ended() || this.free.length >= this.max) h.release();
    else this.free.push(h);
  }

  release(): void {
    for (const h of this.free.splice(0)) h.release();
  }
}

const LANE_CREDIT = 0;
const LANE_INTERNAL = 1;
const LANE_CTRL = 2;
const LANE_DATA = 3;

export class SendLanes {
  /** Work requests posted and not completed. */
  outstanding = 0;
  /** Slot ids of posted send WRs, in post order (completions arrive in this order). */
  private fifo: number[] = new Array<number>(64).fill(0);
  /** The fifo is a ring (nothing allocated per post): `fifoLen` ids from `fifoHead`, modulo its length (a power of two). */
  private fifoHead = 0;
  private fifoLen = 0;
  private sinceSignal = 0;
  private creditQ: Pending[] = [];
  private rdQ: Pending[] = [];
  private ctrlQ: Pending[] = [];
  private dataQ: Pending[] = [];
  private flushScheduled = false;

  constructor(
    private readonly host: LanesHost,
    private readonly cr: Credits,
    private readonly sendDepth: number,
    /** Counts credit stalls of the data lane (stats.ts). */
    private readonly traffic: Traffic,
  ) {}

  /** Something waits in a lane. */
  get waiting(): boolean {
    return this.creditQ.length > 0 || this.rdQ.length > 0 || this.ctrlQ.length > 0 || this.dataQ.length > 0;
  }

  /** Work requests waiting in the lanes. */
  get queued(): number {
    return this.creditQ.length + this.rdQ.length + this.ctrlQ.length + this.dataQ.length;
  }

  /** Queues a work request in its lane; the flush runs once the current microtask checkpoint ends (see above). */
  enqueue(p: Pending): void {
    // A failed connection posts nothing more: work queued after fail() (a PONG or RNDV_DONE for a
    // message handled while the failure drains the CQ) is dropped like the work fail() found queued.
    // Queued, it would be flushed after the teardown freed its buffers.
    if (this.host.failure) return this.host.dropQueued(p.op, [p], this.host.failure);
    if (p.internal) this.rdQ.push(p);
    else if (p.credit === 3) this.creditQ.push(p);
    else if (p.credit === 1 && !p.ordered) this.ctrlQ.push(p);
    else this.dataQ.push(p);
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      process.nextTick(this.flushTask);
    }
  }

  /** Posts everything that has credits and send-queue room, as one work-request list. */
  flush(): void {
    this.flushScheduled = false;
    const failure = this.host.failure;
    if (failure && failure.code !== "CONNECTION_CLOSED") return;
    // The lists are reused from flush to flush (the provider copies what it keeps when posted),
    // filled by index and never emptied (an emptied array drops its storage): nothing is
    // allocated per flush. A flush re-entered from inside one (the post's synchronous poll
    // completes work and flushes again) makes its own.
    const L = this.flushing ? newLists() : this.lists;
    const was = this.flushing;
    this.flushing = true;
    try {
      L.n = 0;
      L.nr = 0;
      let room = this.sendDepth - this.outstanding;
      room = this.take(this.creditQ, LANE_CREDIT, L, room);
      room = this.take(this.rdQ, LANE_INTERNAL, L, room);
      room = this.take(this.ctrlQ, LANE_CTRL, L, room);
      this.take(this.dataQ, LANE_DATA, L, room);
      if (this.ctrlQ.length || this.dataQ.length) this.maybeSendCredits();
      const n = L.n;
      if (n === 0) return;
      const batch = L.wrs;
      // Exactly this flush's work requests (shortening an array keeps its storage).
      if (batch.length !== n) batch.length = n;
      // Signal the last WR of the list and every SIGNAL_EVERY-th: fewer completions to poll, and
      // the send queue still drains (an unsignaled WR's slot is freed by the next signaled one).
      for (let i = 0; i < n; i++) {
        const wr = batch[i]!;
        if (++this.sinceSignal >= SIGNAL_EVERY || i === n - 1) {
          wr.flags = (wr.flags ?? 0) | SendFlags.SIGNALED;
          this.sinceSignal = 0;
        } else wr.flags = (wr.flags ?? 0) & ~SendFlags.SIGNALED;
      }
      const wasIdle = this.outstanding === 0;
      this.outstanding += n;
      const nr = L.nr;
      try {
        this.host.post(batch, wasIdle);
      } finally {
        // Posted (or refused: the connection failed): the records are free again.
        for (let i = 0; i < nr; i++) this.giveBack(L.recs[i]!);
      }
    } finally {
      this.flushing = was;
    }
  }

  /** A flush is running (a nested one makes its own lists). */
  private flushing = false;
  private readonly lists: FlushLists = newLists();
  /** Free SEND records (at most the send depth). */
  private readonly records: SendRecord[] = [];
  private readonly flushTask = (): void => this.flush();

  /**
   * A SEND record for the caller to fill (op, credit, hdr, the elements'
   * fields, `wr.sgList` = `one` or `two`, `wr.flags`) and enqueue. It comes
   * back to the free list once posted; a record dropped unposted is left to
   * the garbage collector.
   */
  record(): SendRecord {
    const r = this.records.pop();
    if (r !== undefined) return r;
    const h: Sge = { addr: 0, length: 0, lkey: 0 };
    const d: Sge = { addr: 0, length: 0, lkey: 0 };
    const one = [h];
    const rec: SendRecord = { wr: { wrId: 0, opcode: WrOpcode.SEND, flags: 0, sgList: one }, op: NO_OP, credit: 0, hdr: null, ordered: false, one, two: [h, d] };
    rec.pooled = rec;
    return rec;
  }

  /**
   * Queues a two-sided SEND from a record of the free list: the header's
   * `hdrLen` bytes from the start of `hdr` (a recycled header buffer),
   * followed by `payloadLen` bytes at `payloadAddr` when `payloadLen` > 0.
   */
  enqueueSend(op: Op, hdr: LocalMemory, hdrLen: number, flags: number, credit: number, ordered: boolean, payloadAddr = 0, payloadLen = 0, payloadLkey = 0): void {
    const r = this.record();
    const a = hdr.alloc;
    const h = r.one[0]!;
    h.addr = a.addr;
    h.length = hdrLen;
    h.lkey = a.mr.lkey;
    if (payloadLen > 0) {
      const d = r.two[1]!;
      d.addr = payloadAddr;
      d.length = payloadLen;
      d.lkey = payloadLkey;
      r.wr.sgList = r.two;
    } else r.wr.sgList = r.one;
    r.wr.flags = flags;
    r.op = op;
    r.credit = credit;
    r.hdr = hdr;
    r.ordered = ordered;
    this.enqueue(r);
  }

  private giveBack(r: SendRecord): void {
    r.op = NO_OP;
    r.hdr = null;
    r.wr.wrId = 0;
    if (this.records.length < this.sendDepth) this.records.push(r);
  }

  /** Moves the head of `q` into `batch` while it has credits (the lane's need) and the send queue `room`; the room left. */
  private take(q: Pending[], lane: number, L: FlushLists, room: number): number {
    while (q.length > 0 && room > 0) {
      const p = q[0]!;
      if (p.lease?.revoked && !p.op.posted) {
        this.dropRevoked(q, p.op);
        continue;
      }
      const need = lane === LANE_CREDIT ? NEED.credit : lane === LANE_INTERNAL ? 0 : lane === LANE_CTRL ? NEED.ctrl : dataNeed(p);
      if (!this.cr.canSend(need)) {
        if (lane === LANE_DATA) this.traffic.stall();
        break;
      }
      if (lane === LANE_DATA) this.traffic.stalled = false;
      q.shift();
      p.op.posted = true;
      p.onPost?.();
      this.cr.spend(need);
      if (p.hdr !== null) {
        // piggyback the receive buffers we re-posted since the last report
        const a = p.hdr.alloc;
        put32(bytesOf(a.buffer), a.bufOffset + 4, this.cr.report());
      }
      const id = this.host.slot(p.op);
      p.wr.wrId = id;
      this.fifoPush(id);
      L.wrs[L.n++] = p.wr;
      if (p.pooled !== undefined) L.recs[L.nr++] = p.pooled;
      room--;
    }
    return room;
  }

  /**
   * A signalled completion arrived for `id`: the next earlier (unsignalled,
   * so silently completed) work request's slot id, or -1 once `id` is reached.
   */
  unsignaledBefore(id: number): number {
    if (this.fifoLen > 0) {
      const sid = this.fifo[this.fifoHead]!;
      this.fifoHead = (this.fifoHead + 1) & (this.fifo.length - 1);
      this.fifoLen--;
      if (sid !== id) return sid;
    }
    return -1;
  }

  private fifoPush(id: number): void {
    let f = this.fifo;
    if (this.fifoLen === f.length) {
      // Full (more posted than ever before): twice the room, the ids kept in order.
      const g = new Array<number>(f.length * 2).fill(0);
      for (let i = 0; i < this.fifoLen; i++) g[i] = f[(this.fifoHead + i) & (f.length - 1)]!;
      this.fifo = f = g;
      this.fifoHead = 0;
    }
    f[(this.fifoHead + this.fifoLen) & (f.length - 1)] = id;
    this.fifoLen++;
  }

  /** Removes every queued work request of `op` (only from the data lane when `dataOnly`). */
  remove(op: Op, dataOnly = false): Pending[] {
    const mine: Pending[] = [];
    for (const q of dataOnly ? [this.dataQ] : [this.creditQ, this.rdQ, this.ctrlQ, this.dataQ]) {
      for (let i = q.length - 1; i >= 0; i--) if (q[i]!.op === op) mine.push(...q.splice(i, 1));
    }
    // A stall ends when the data lane empties, by a post or by this removal (an abort): the next one counts.
    if (this.dataQ.length === 0) this.traffic.stalled = false;
    return mine;
  }

  /** Empties every lane (the connection failed). */
  takeAll(): Pending[] {
    this.traffic.stalled = false;
    return [...this.creditQ.splice(0), ...this.rdQ.splice(0), ...this.ctrlQ.splice(0), ...this.dataQ.splice(0)];
  }

  /** Sends a CREDIT message when the credit rule (credits.ts) says nothing queued will carry the credits soon. */
  maybeSendCredits(): void {
    const d = this.dataQ;
    const q = this.queuedWork;
    q.credit = this.creditQ.length > 0;
    q.ctrl = this.ctrlQ.length > 0;
    q.data = d.length > 0;
    q.dataHeadNeed = d.length > 0 ? dataNeed(d[0]!) : 0;
    if (this.cr.shouldSendCredits(q)) this.host.sendCredits();
  }

  /** maybeSendCredits's question, reused (read at once, never kept). */
  private readonly queuedWork: QueuedWork = { credit: false, ctrl: false, data: false, dataHeadNeed: 0 };

  /** Drops a queued one-sided operation (all its parts, at the head of `q`) whose remote region was revoked meanwhile. */
  private dropRevoked(q: Pending[], op: Op): void {
    let n = 0;
    while (n < q.length && q[n]!.op === op) n++;
    this.host.dropQueued(op, q.splice(0, n), new RdmaError("REMOTE_ACCESS", "the owner revoked this shared region while the operation waited to be posted; nothing reached it"));
  }
}
