/**
 * What arrives: each successful receive completion, decoded and handed to
 * the part that owns it (inbox, rendezvous, memory protocol, liveness,
 * lifecycle).
 *
 * Invariants:
 * - a receive consumes one of the peer's credits; the credits a message
 *   returns are checked (credits.ts) before it is acted on, and a breach, a
 *   malformed header or a DATA message whose length is not what it carries
 *   is a protocol error that delivers nothing;
 * - a receive buffer has exactly one owner after dispatch: the user (a DATA
 *   message's bytes, through the inbox, which reposts a buffer unless too
 *   much is held unread), the receive ring (recycled: immediates, RNDV and
 *   control messages), or nobody (freed: anything malformed, and anything
 *   after the peer's CLOSE, which is not delivered);
 * - every control message goes to exactly one handler; a kind nobody
 *   handles is a protocol error.
 */
import { LocalMr, type LocalMemory } from "../memory/mr.js";
import { WcOpcode } from "../transport/types.js";
import { HDR, MsgType, bytesOf, dataImm, dataLength, decodeMsg, fromWire, newMsg, type CtrlMessage, type Msg } from "./codec.js";
import type { Credits } from "./credits.js";
import type { Inbox } from "./inbox.js";
import type { Lifecycle } from "./lifecycle.js";
import type { Liveness } from "./liveness.js";
import type { CtrlMsg, MemoryProtocol } from "./memory-protocol.js";
import type { Poller } from "./poller.js";
import type { RecvRing } from "./recv-ring.js";
import type { Rendezvous } from "./rendezvous.js";
import type { SendLanes } from "./send-lanes.js";
import type { Traffic } from "./stats.js";
import type { ConnectionOptions } from "./options.js";

/** What arrivals need from their connection: the parts they hand messages to. */
export interface ArrivalsHost {
  readonly cr: Pick<Credits, "consumed" | "returned" | "echoed" | "growth">;
  readonly recvs: Pick<RecvRing, "put" | "repost" | "grow">;
  readonly inbox: Pick<Inbox, "pushMessage" | "pushImm">;
  readonly rndv: Pick<Rendezvous, "onAnnounce" | "onDone" | "onCancel">;
  readonly memory: Pick<MemoryProtocol, "onMessage">;
  readonly lanes: Pick<SendLanes, "waiting" | "flush">;
  readonly live: Pick<Liveness, "arrived">;
  readonly poller: Pick<Poller, "touch" | "drainTime">;
  readonly life: Pick<Lifecycle, "peerClosed" | "protocolFailed" | "onPeerClose" | "protocolError">;
  readonly traffic: Traffic;
  /** The connection, as the memory protocol records it in `lease.owner`. */
  readonly owner: object;
  /** This side's settings (its maxMessageSize: the largest message it accepts). */
  readonly opts: Pick<ConnectionOptions, "maxMessageSize">;
  sendCtrl(m: CtrlMsg): void;
}

export class Arrivals {
  private readonly cr: ArrivalsHost["cr"];
  private readonly recvs: ArrivalsHost["recvs"];
  private readonly inbox: ArrivalsHost["inbox"];
  private readonly rndv: ArrivalsHost["rndv"];
  private readonly lanes: ArrivalsHost["lanes"];
  private readonly live: ArrivalsHost["live"];
  private readonly poller: ArrivalsHost["poller"];
  private readonly life: ArrivalsHost["life"];
  private readonly traffic: Traffic;
  /** The decoded header, reused for every message. */
  private readonly msg: Msg = newMsg();

  constructor(private readonly host: ArrivalsHost) {
    ({ cr: this.cr, recvs: this.recvs, inbox: this.inbox, rndv: this.rndv, lanes: this.lanes, live: this.live, poller: this.poller, life: this.life, traffic: this.traffic } = host);
  }

  /** A receive completed successfully into `mem` (its `byteLen` bytes; `imm` for a WRITE with immediate). */
  onReceive(mem: LocalMemory, opcode: number, byteLen: number, imm: number): void {
    this.cr.consumed();
    const grow = this.cr.growth(opcode === WcOpcode.RECV_RDMA_WITH_IMM);
    if (grow > 0) this.recvs.grow(grow);
    this.live.arrived(this.poller.drainTime);
    this.poller.touch();
    // After the peer's CLOSE, or after it broke the protocol (what follows a violation is not delivered: no gap the user cannot see).
    if (this.life.peerClosed || this.life.protocolFailed) {
      mem.release();
      return;
    }
    if (opcode === WcOpcode.RECV_RDMA_WITH_IMM) {
      this.recvs.put(mem);
      // An unread immediate holds a credit like an unread message.
      this.inbox.pushImm(imm);
      return;
    }
    const a = mem.alloc;
    const m = this.msg;
    const err = byteLen > a.length ? `a receive completed with ${byteLen} bytes into a ${a.length}-byte buffer` : decodeMsg(bytesOf(a.buffer), byteLen, m, a.bufOffset);
    if (err !== null) {
      mem.release();
      this.life.protocolError(err);
      return;
    }
    const breach = this.cr.returned(m.credits);
    if (breach !== null) {
      mem.release();
      this.life.protocolError(breach);
      return;
    }
    if (m.credits > 0 && this.lanes.waiting) this.lanes.flush();
    switch (m.type) {
      case MsgType.DATA: {
        const len = dataLength(m);
        if (byteLen - HDR !== len) {
          mem.release();
          return this.life.protocolError(`DATA message claims ${len} bytes but carries ${byteLen - HDR}`);
        }
        // An honest peer refuses such a send itself (it knows this side's limit).
        if (len > this.host.opts.maxMessageSize) {
          mem.release();
          return this.life.protocolError(`message of ${len} bytes exceeds this side's maxMessageSize (${this.host.opts.maxMessageSize})`);
        }
        const lmr = new LocalMr(mem, HDR, len);
        this.traffic.messagesReceived++;
        this.traffic.bytesReceived += len;
        // The buffer now belongs to the user; a new one is posted unless too much is held unread.
        this.inbox.pushMessage(lmr, dataImm(m));
        return;
      }
      case MsgType.RNDV: {
        this.recvs.put(mem);
        const r = fromWire(m);
        if (r.type !== MsgType.RNDV) return;
        const max = this.host.opts.maxMessageSize;
        if (r.length > max) return this.life.protocolError(`rendezvous message of ${r.length} bytes exceeds this side's maxMessageSize (${max})`);
        if (r.length === 0) return this.life.protocolError("rendezvous message of 0 bytes");
        return this.rndv.onAnnounce(r);
      }
      default:
        this.recvs.put(mem);
        if (m.type === MsgType.CREDIT) this.cr.echoed();
        this.recvs.repost();
        return this.onControl(fromWire(m));
    }
  }

  private onControl(m: CtrlMessage): void {
    switch (m.type) {
      case MsgType.CREDIT:
        return;
      case MsgType.PING:
        return this.host.sendCtrl({ type: MsgType.PONG, token: m.token });
      case MsgType.PONG:
        return;
      case MsgType.RNDV_DONE:
        return this.rndv.onDone(m.token, m.status);
      case MsgType.RNDV_CANCEL:
        return this.rndv.onCancel(m.token);
      case MsgType.CLOSE:
        return this.life.onPeerClose();
      default:
        if (this.host.memory.onMessage(m, this.host.owner)) return;
        return this.life.protocolError(`unexpected control message ${m.type}`);
    }
  }
}
