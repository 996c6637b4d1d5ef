/**
 * What one connection is made of, and how its parts see each other: the
 * wiring that used to fill the connection's constructor.
 *
 * Invariant: each part sees the others only through the narrow host it is
 * given here, closures over the other parts or the connection's own host
 * methods (`PartsHost`: the send lanes' and the memory protocol's host, the
 * control-message sender, completion dispatch); no part imports another
 * part's class for its behaviour, nor connection.ts. Parts are built in
 * dependency order and no host closure runs during construction, so a
 * closure may name a part built after its own.
 */
import { WrOpcode, type CompletionBuffer, type CompletionQueue, type QueuePair } from "../transport/types.js";
import type { MrPool } from "../memory/pool.js";
import { MsgType } from "./codec.js";
import { Credits } from "./credits.js";
import { Bounce } from "./bounce.js";
import { Inbox } from "./inbox.js";
import { OpTable, newOp, type Op } from "./ops.js";
import { HeaderPool, SendLanes, type LanesHost } from "./send-lanes.js";
import { RecvRing } from "./recv-ring.js";
import { Rendezvous } from "./rendezvous.js";
import { OneSided } from "./one-sided.js";
import { Liveness } from "./liveness.js";
import { Lifecycle } from "./lifecycle.js";
import { Arrivals } from "./arrivals.js";
import { MemoryProtocol, type CtrlMsg, type MemoryHost } from "./memory-protocol.js";
import { Poller } from "./poller.js";
import type { Traffic } from "./stats.js";
import type { ConnectionOptions, PeerParams } from "./options.js";

/** What the parts need from their connection itself (it is also the owner `lease.owner` records). */
export interface PartsHost extends LanesHost, MemoryHost {
  /** Encodes a control message into a recycled header and queues its SEND. */
  sendCtrl(m: CtrlMsg, op?: Op | null, credit?: number, ordered?: boolean): void;
  /** One work completion (poller.ts calls it for each). */
  onCompletion(b: CompletionBuffer, i: number): void;
  /** The completion queue was drained. */
  afterDrain(): void;
}

/** One connection's parts (each file's opening comment says what it owns). */
export interface Parts {
  ops: OpTable;
  cr: Credits;
  lanes: SendLanes;
  headers: HeaderPool;
  recvs: RecvRing;
  poller: Poller;
  inbox: Inbox;
  rndv: Rendezvous;
  oneSided: OneSided;
  bounce: Bounce;
  memory: MemoryProtocol;
  live: Liveness;
  life: Lifecycle;
  arrivals: Arrivals;
}

/** Builds a connection's parts over its QP and CQ and wires each to its host. */
export function makeParts(host: PartsHost, qp: QueuePair, cq: CompletionQueue, pool: MrPool, opts: ConnectionOptions, peer: PeerParams, traffic: Traffic, onClosed: () => void): Parts {
  const cr = new Credits(peer.recvDepth, opts.recvDepth);
  const ops = new OpTable((op, err) => host.dropQueued(op, lanes.remove(op), err));
  const lanes = new SendLanes(host, cr, opts.sendDepth, traffic);
  const headers: HeaderPool = new HeaderPool(pool, opts.sendDepth, () => life.closed);
  const oneSided = new OneSided({ checkOpen: (what) => host.checkOpen(what), enqueue: (p) => lanes.enqueue(p) }, ops, pool, host);
  const recvs: RecvRing = new RecvRing(
    {
      ended: () => life.closed || life.failure !== null,
      draining: () => poller.draining,
      reposted: (n) => {
        cr.reposted(n);
        lanes.maybeSendCredits();
      },
      fail: (err) => life.fail(err),
    },
    ops,
    qp,
    pool,
    opts.recvDepth,
    opts.eagerMax,
  );
  const memory = new MemoryProtocol(host, {
    quotaBytes: opts.quotaBytes,
    maxRegions: opts.maxRegions,
    defaultLeaseMs: opts.defaultLeaseMs,
    maxLeaseMs: opts.maxLeaseMs,
    leaseGraceMs: opts.leaseGraceMs,
    maxRegionSize: Math.min(pool.pd.device.attr.maxMrSize, 2 ** 32 - 1),
  });
  const bounce = new Bounce(pool);
  const inbox = new Inbox({ repostRecv: () => recvs.repost(), failed: () => life.failure }, opts.recvDepth);
  const rndv = new Rendezvous(
    {
      isDown: () => life.down,
      failed: () => life.failure,
      takeHdr: () => headers.take(),
      enqueue: (p) => lanes.enqueue(p),
      withdraw: (op) => lanes.remove(op, true),
      dropQueued: (op, parts, err) => host.dropQueued(op, parts, err),
      watchAbort: (signal, fn) => ops.aborts.add(signal, fn),
      sendCtrl: (m) => host.sendCtrl(m),
      read: (op, dst, addr, rkey) => oneSided.transfer(op, WrOpcode.RDMA_READ, dst, addr, rkey, undefined, 0, true),
      awaitAnswer: () => (live.awaitingAnswer = true),
      protocolError: (reason) => life.protocolError(reason),
      delivered: (len) => {
        traffic.messagesReceived++;
        traffic.bytesReceived += len;
        traffic.rendezvousReceived++;
      },
    },
    pool,
    bounce,
    inbox,
    opts.rendezvousTimeoutMs,
  );
  const live = new Liveness(
    {
      isDown: () => life.failure !== null,
      outstanding: () => lanes.outstanding,
      ping: () => host.sendCtrl({ type: MsgType.PING, token: 0 }),
      expire: (err) => life.fail(err),
    },
    opts.keepaliveMs,
    opts.peerTimeoutMs,
  );
  const poller = new Poller(
    cq,
    opts.polling,
    opts.spinUs,
    (b, i) => host.onCompletion(b, i),
    () => host.afterDrain(),
    undefined,
    // Waiting for something: a send not yet acknowledged, work queued for credits, or a large
    // send whose RNDV_DONE is due (its RNDV message may be acknowledged long before).
    () => lanes.outstanding > 0 || lanes.queued > 0 || rndv.outstanding > 0,
  );
  const life: Lifecycle = new Lifecycle({
    qp,
    cq,
    ops,
    lanes,
    headers,
    recvs,
    poller,
    inbox,
    rndv,
    memory,
    live,
    bounce,
    dropQueued: (op, parts, err) => host.dropQueued(op, parts, err),
    sendClose: (ordered) => {
      const op = newOp("msg");
      const sent = ops.track<void>(op, undefined);
      host.sendCtrl({ type: MsgType.CLOSE }, op, 1, ordered);
      return sent;
    },
    onClosed,
  });
  const arrivals = new Arrivals({ cr, recvs, inbox, rndv, memory, lanes, live, poller, life, traffic, owner: host, opts, sendCtrl: (m) => host.sendCtrl(m) });
  return { ops, cr, lanes, headers, recvs, poller, inbox, rndv, oneSided, bounce, memory, live, life, arrivals };
}
