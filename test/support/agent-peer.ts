/**
 * A raw agent-protocol peer for hostile tests: it does the side-channel
 * handshake itself (JSON lines on a raw socket) with a QP of its own made on
 * the transport seam, then posts whatever bytes it is told as SENDs on that
 * QP — well-formed control messages (docs/wire-format.md, src/agent/codec.ts)
 * or anything else. It plays fair only where told to: it answers PINGs,
 * re-posts its receives and reports them as credits, and never sends more
 * SENDs than the server has receives for (so a case is never an RNR storm
 * unless it asks for one).
 *
 * Works on both providers (the side channel, not RDMA CM).
 */
import net from "node:net";
import { LineReader, PROTOCOL_VERSION, helloBytes, parseHello, peerEndpoint, sendLine } from "../../src/api/handshake.js";
import { authMac, nonce } from "../../src/api/auth.js";
import { HDR, MsgType, decodeMsg, encodeMsg, newMsg, type Msg } from "../../src/agent/codec.js";
import { initialReceives } from "../../src/agent/credits.js";
import {
  Access,
  CompletionBuffer,
  SendFlags,
  WcOpcode,
  WcStatus,
  WrOpcode,
  wcStatusName,
  type AsyncEvent,
  type CompletionQueue,
  type Device,
  type MemoryRegion,
  type ProtectionDomain,
  type QueuePair,
  type SendWr,
} from "../../src/transport/types.js";
import { GID_INDEX, PROVIDER } from "./seam.js";
import { Waiter } from "./fuzz.js";

/** Our receive buffers: the server only ever sends us control messages (at most 40 bytes). */
const RECV_BUF = 64;
/** Slots for outgoing messages (a SEND's bytes stay put until it completes). */
const SEND_SLOTS = 256;
export const SEND_SLOT_BYTES = 16 * 1024;
/** Tokens of our own PINGs (probes): fuzzed PINGs stay below. */
export const PROBE_TOKEN_BASE = 0xf0000000;

export interface RawPeerOptions {
  /** Receive buffers we post and announce (the server's credits towards us). */
  recvDepth?: number;
  /** Bytes of our memory the server may READ (the target of RNDV announcements). */
  rndvBytes?: number;
  /** Bytes of our memory we may grant the server (its requestRemoteMr). */
  grantBytes?: number;
  /** Authenticate (setAuth on the server) with this key as this identity. */
  auth?: { key: string | Uint8Array; identity: string };
  /**
   * Runs once our QP is connected and before the "ready" line: what it sends
   * on the QP reaches the server before the server's connection has started
   * (wait for its completion with `whenSent`).
   */
  beforeReady?: (p: RawAgentPeer) => Promise<void>;
  /** Given the side-channel socket after the "ready" line instead of half-closing it (the test owns it then). */
  afterReady?: (sock: net.Socket) => void;
}

export interface ServerHello {
  recvDepth: number;
  eagerMax: number;
  maxMessageSize: number;
}

/** A message the server sent us, decoded. */
export type Received = Msg;

export class RawAgentPeer {
  readonly w = new Waiter();
  readonly pd: ProtectionDomain;
  readonly cq: CompletionQueue;
  readonly qp: QueuePair;
  /** Ring of send slots. */
  readonly sendMr: MemoryRegion;
  readonly recvMr: MemoryRegion;
  /** Readable by the server (REMOTE_READ): where honest RNDV announcements point. */
  readonly rndvMr: MemoryRegion;
  /** Writable by the server (REMOTE_WRITE | REMOTE_READ): what honest MR_GRANTs of ours point into. */
  readonly grantMr: MemoryRegion;
  server: ServerHello = { recvDepth: 0, eagerMax: 0, maxMessageSize: 0 };

  /** SENDs the server can take (its receives we have not consumed, as it reported). */
  credits = 0;
  /** Receives we re-posted and did not report yet. */
  toReturn = 0;
  private readonly recvDepth: number;
  private freeSlots: number[] = [];
  /** Messages waiting for a credit or a send slot, in order. */
  private queue: { bytes: Uint8Array | null; imm?: number; honest: boolean; opcode: number }[] = [];
  private outstanding = 0;
  private readonly buf = new CompletionBuffer(64);
  private readonly msg = newMsg();
  private nextProbe = PROBE_TOKEN_BASE;

  /** Set once our QP failed (a completion error or an async event): nothing more goes out. */
  dead: string | null = null;
  readonly events: AsyncEvent[] = [];
  /** What the server told us, by kind. */
  readonly pongs = new Set<number>();
  readonly grants = new Map<number, Msg>();
  readonly denies = new Map<number, number>();
  readonly rndvDone = new Map<number, number>();
  /** The server's MR_REQUESTs, in arrival order (the test answers them). */
  readonly requests: Msg[] = [];
  /** Every message the server sent, counted by type. */
  readonly receivedByType = new Map<number, number>();
  sent = 0;
  private closed = false;

  private constructor(
    readonly dev: Device,
    opts: RawPeerOptions,
  ) {
    this.recvDepth = opts.recvDepth ?? 64;
    this.pd = dev.allocPd();
    this.cq = dev.createCq(SEND_SLOTS + this.recvDepth + 16);
    try {
      this.qp = this.pd.createQp({ sendCq: this.cq, recvCq: this.cq, maxSendWr: SEND_SLOTS, maxRecvWr: this.recvDepth, maxSendSge: 1, maxRecvSge: 1, maxInlineData: 0 });
    } catch (e) {
      this.cq.destroy();
      this.pd.dealloc();
      throw e;
    }
    this.sendMr = this.pd.registerMr(SEND_SLOTS * SEND_SLOT_BYTES, Access.LOCAL_WRITE);
    this.recvMr = this.pd.registerMr(this.recvDepth * RECV_BUF, Access.LOCAL_WRITE);
    this.rndvMr = this.pd.registerMr(opts.rndvBytes ?? 64 * 1024, Access.LOCAL_WRITE | Access.REMOTE_READ);
    const v = new Uint8Array(this.rndvMr.buffer, this.rndvMr.offset, this.rndvMr.length);
    for (let i = 0; i < v.length; i++) v[i] = (i * 7 + 3) & 0xff;
    this.grantMr = this.pd.registerMr(opts.grantBytes ?? 64 * 1024, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ);
    for (let i = SEND_SLOTS - 1; i >= 0; i--) this.freeSlots.push(i);
    this.qp.onEvent = (e) => {
      this.events.push(e);
      this.die(`async event ${e.type}: ${e.reason}`);
    };
    this.cq.onNotify = () => this.drain(true);
  }

  /**
   * Connects to an RdmaListener on `port` through the side channel. `hello`
   * may replace fields of our hello (the test's lies); by default it is honest.
   */
  static async connect(dev: Device, port: number, opts: RawPeerOptions = {}, timeoutMs = 30_000): Promise<RawAgentPeer> {
    const p = new RawAgentPeer(dev, opts);
    // a test that takes the socket after "ready" decides when it ends (the server's FIN does not end it)
    const sock = net.connect({ host: "127.0.0.1", port, noDelay: true, allowHalfOpen: opts.afterReady !== undefined });
    sock.on("error", () => {});
    const timer = setTimeout(() => sock.destroy(new Error("timeout")), timeoutMs);
    try {
      await new Promise<void>((resolve, reject) => {
        sock.once("connect", resolve);
        sock.once("error", reject);
      });
      const reader = new LineReader(sock);
      // Receives first: the server may send as soon as its QP is connected.
      const wrs = [];
      for (let i = 0; i < p.recvDepth; i++) wrs.push({ wrId: recvId(i), sgList: [{ addr: p.recvMr.addr + i * RECV_BUF, length: RECV_BUF, lkey: p.recvMr.lkey }] });
      p.qp.postRecv(wrs);
      const mine: Record<string, unknown> = { asyncRdma: PROTOCOL_VERSION, provider: PROVIDER, endpoint: p.qp.localEndpoint({ gidIndex: GID_INDEX }), recvDepth: p.recvDepth, eagerMax: 0 };
      const a = opts.auth;
      const nc = nonce(16);
      if (a) mine.auth = { identity: a.identity, nonce: nc.toString("base64") };
      sendLine(sock, mine);
      if (a) {
        // the client's side of the challenge (src/api/sidechannel.ts), without checking the server's proof
        const ch = (await reader.nextJson()).challenge as { nonce?: string } | undefined;
        if (!ch?.nonce) throw new Error("the server sent no challenge");
        const key = typeof a.key === "string" ? Buffer.from(a.key, "utf8") : a.key;
        sendLine(sock, { proof: authMac(key, "side-channel client proof", a.identity, nc, Buffer.from(ch.nonce, "base64"), helloBytes(parseHello(mine, PROVIDER))).toString("base64") });
      }
      const reply = parseHello(await reader.nextJson(), PROVIDER);
      p.server = { recvDepth: reply.recvDepth, eagerMax: reply.eagerMax, maxMessageSize: reply.maxMessageSize ?? 0 };
      // Agent protocol v4: the server posted min(recvDepth, 8) receives before connecting (agent/credits.ts).
      p.credits = initialReceives(reply.recvDepth);
      p.qp.connect(peerEndpoint(reply.endpoint, sock), { gidIndex: GID_INDEX, timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 });
      p.cq.requestNotify();
      if (opts.beforeReady) await opts.beforeReady(p);
      sendLine(sock, { ready: true });
      if (opts.afterReady) opts.afterReady(sock);
      else sock.end();
      p.drain(false);
      // An agent's first message states its limits (protocol v3): the server hands the connection out once it has them.
      p.send({ type: MsgType.LIMITS, a: 0xffffffff, b: 0xffffffff, addr: 2 ** 40, rkey: 0xffffffff });
      return p;
    } catch (e) {
      sock.destroy();
      p.close();
      throw e;
    } finally {
      clearTimeout(timer);
    }
  }

  // ------------------------------------------------------------- sending

  /**
   * Queues `bytes` as one SEND (at most SEND_SLOT_BYTES). `honest`: the bytes
   * are a control header whose credits field (offset 4) we fill with the
   * receives we owe the report of, as a real agent does.
   */
  sendRaw(bytes: Uint8Array, honest = false): void {
    if (bytes.length > SEND_SLOT_BYTES) throw new Error(`message of ${bytes.length} bytes exceeds a send slot`);
    this.queue.push({ bytes, honest: honest && bytes.length >= 8, opcode: WrOpcode.SEND });
    this.flush();
  }

  /** Encodes and queues a well-formed control message (credits filled in honestly unless given). */
  send(m: Partial<Msg> & { type: number }, payload?: Uint8Array): void {
    const full: Msg = { flags: 0, credits: 0, imm: 0, token: 0, a: 0, b: 0, addr: 0, rkey: 0, id: 0, ...m };
    const out = new Uint8Array(HDR + 16 + (payload?.length ?? 0));
    const n = encodeMsg(out, full);
    if (payload) out.set(payload, n);
    this.sendRaw(out.subarray(0, n + (payload?.length ?? 0)), m.credits === undefined);
  }

  /** A zero-length RDMA WRITE with immediate: consumes one of the server's receives. */
  writeImm(imm: number): void {
    this.queue.push({ bytes: null, imm, honest: false, opcode: WrOpcode.RDMA_WRITE_WITH_IMM });
    this.flush();
  }

  /** Resolves once everything sent so far has completed (reached the server's receive queue), or our QP died. */
  async whenSent(ms = 30_000): Promise<void> {
    await this.w.until(() => (this.outstanding === 0 && this.queue.length === 0) || this.dead !== null, `our SENDs to complete (outstanding ${this.outstanding}, queued ${this.queue.length})`, ms);
  }

  /** Queued messages not yet posted (waiting for credits). */
  get queued(): number {
    return this.queue.length;
  }

  /** A CREDIT message is owed: it goes before anything queued, on the credit kept for it. */
  private creditOwed = false;

  private flush(): void {
    if (this.dead || this.closed) return;
    const wrs: SendWr[] = [];
    // As the agent does: the last credit is kept for CREDIT messages, which jump the queue, so
    // neither side can end up waiting for the other's credits with its own report stuck behind data.
    for (;;) {
      if (this.freeSlots.length === 0) break;
      let q: (typeof this.queue)[number];
      if (this.creditOwed && this.credits >= 1) {
        this.creditOwed = false;
        const m = new Uint8Array(HDR);
        encodeMsg(m, { type: MsgType.CREDIT, flags: 0, credits: 0, imm: 0, token: 0, a: 0, b: 0, addr: 0, rkey: 0, id: 0 });
        q = { bytes: m, honest: true, opcode: WrOpcode.SEND };
      } else if (this.queue.length > 0 && this.credits >= 2) q = this.queue.shift()!;
      else break;
      const slot = this.freeSlots.pop()!;
      const addr = this.sendMr.addr + slot * SEND_SLOT_BYTES;
      let len = 0;
      if (q.bytes) {
        const view = new Uint8Array(this.sendMr.buffer, this.sendMr.offset + slot * SEND_SLOT_BYTES, SEND_SLOT_BYTES);
        view.set(q.bytes);
        len = q.bytes.length;
        if (q.honest) {
          new DataView(view.buffer, view.byteOffset + 4, 4).setUint32(0, this.toReturn);
          this.toReturn = 0;
        }
      }
      this.credits--;
      this.outstanding++;
      this.sent++;
      const wr: SendWr = { wrId: slot, opcode: q.opcode as SendWr["opcode"], flags: SendFlags.SIGNALED, sgList: len > 0 ? [{ addr, length: len, lkey: this.sendMr.lkey }] : [] };
      if (q.opcode === WrOpcode.RDMA_WRITE_WITH_IMM) {
        wr.imm = q.imm ?? 0;
        wr.remoteAddr = 0;
        wr.rkey = 0;
      }
      wrs.push(wr);
    }
    if (wrs.length === 0) return;
    try {
      this.qp.postSend(wrs);
    } catch (e) {
      this.die(`postSend failed: ${(e as Error).message}`);
    }
  }

  // ----------------------------------------------------------- receiving

  private drain(rearm: boolean): void {
    if (this.closed) return;
    let n: number;
    while ((n = this.cq.poll(this.buf)) > 0) {
      for (let i = 0; i < n; i++) this.onCompletion(i);
    }
    if (rearm && !this.closed) {
      this.cq.requestNotify();
      while ((n = this.cq.poll(this.buf)) > 0) for (let i = 0; i < n; i++) this.onCompletion(i);
    }
    // The server starts with 8 credits (agent protocol v4) and keeps some in reserve: return them
    // once two are owed, as an agent returns them to a peer running low (agent/credits.ts).
    if (this.toReturn >= 2 && !this.dead) this.creditOwed = true;
    this.flush();
    this.w.poke();
  }

  private onCompletion(i: number): void {
    const b = this.buf;
    const id = b.wrId[i]!;
    const status = b.status[i]!;
    if (status !== WcStatus.SUCCESS) {
      if (id < RECV_BASE) {
        this.outstanding--;
        this.freeSlots.push(id);
      }
      this.die(`completion ${wcStatusName(status)} (wr ${id})`);
      return;
    }
    if (id < RECV_BASE) {
      this.outstanding--;
      this.freeSlots.push(id);
      return;
    }
    const slot = id - RECV_BASE;
    if (b.opcode[i] === WcOpcode.RECV) {
      const view = new Uint8Array(this.recvMr.buffer, this.recvMr.offset + slot * RECV_BUF, RECV_BUF);
      const err = decodeMsg(view, b.byteLen[i]!, this.msg);
      if (err !== null) this.die(`the server sent a malformed message: ${err}`);
      else this.onMessage(this.msg);
    }
    if (this.dead) return;
    try {
      this.qp.postRecv([{ wrId: id, sgList: [{ addr: this.recvMr.addr + slot * RECV_BUF, length: RECV_BUF, lkey: this.recvMr.lkey }] }]);
      this.toReturn++;
    } catch (e) {
      this.die(`postRecv failed: ${(e as Error).message}`);
    }
  }

  private onMessage(m: Msg): void {
    this.receivedByType.set(m.type, (this.receivedByType.get(m.type) ?? 0) + 1);
    this.credits += m.credits;
    switch (m.type) {
      case MsgType.PING:
        this.send({ type: MsgType.PONG, token: m.token });
        break;
      case MsgType.PONG:
        this.pongs.add(m.token);
        break;
      case MsgType.MR_GRANT:
        this.grants.set(m.token, { ...m });
        break;
      case MsgType.MR_DENY:
        this.denies.set(m.token, m.a);
        break;
      case MsgType.RNDV_DONE:
        this.rndvDone.set(m.token, m.a);
        break;
      case MsgType.MR_REQUEST:
        this.requests.push({ ...m });
        break;
      default:
        break;
    }
  }

  private die(reason: string): void {
    if (this.dead) return;
    this.dead = reason;
    this.queue.length = 0;
    this.w.poke();
  }

  // -------------------------------------------------------------- probes

  /**
   * A PING of our own after everything queued: resolves true once its PONG
   * is back (the server processed everything before it, in order), false
   * once `failed()` (the server's side failed; our QP failing first is not
   * enough: the server must notice too). Rejects after `ms`.
   */
  async probe(failed: () => boolean, ms: number): Promise<boolean> {
    const token = this.nextProbe;
    this.nextProbe = this.nextProbe + 1 >= 0xffffffff ? PROBE_TOKEN_BASE : this.nextProbe + 1;
    this.send({ type: MsgType.PING, token });
    await this.w.until(
      () => this.pongs.has(token) || failed(),
      `the PONG of probe ${token.toString(16)} or the server's failure (sent ${this.sent}, queued ${this.queue.length}, credits ${this.credits}, our QP: ${this.dead ?? "up"})`,
      ms,
    );
    this.pongs.delete(token);
    return !failed();
  }

  /** Waits for the server's answer to MR_REQUEST `token` (grant or deny), or a failure. */
  async answerTo(token: number, failed: () => boolean, ms: number): Promise<"granted" | "denied" | "failed"> {
    await this.w.until(() => this.grants.has(token) || this.denies.has(token) || failed() || this.dead !== null, `an answer to MR_REQUEST ${token}`, ms);
    if (this.grants.has(token)) return "granted";
    if (this.denies.has(token)) return "denied";
    return "failed";
  }

  /** Destroys the QP and everything of ours (the device stays: the test owns it). */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.dead ??= "closed";
    this.cq.onNotify = null;
    this.qp.onEvent = null;
    for (const f of [() => this.qp.destroy(), () => this.cq.destroy(), () => this.sendMr.deregister(), () => this.recvMr.deregister(), () => this.rndvMr.deregister(), () => this.grantMr.deregister(), () => this.pd.dealloc()]) {
      try {
        f();
      } catch {
        /* already gone */
      }
    }
    this.w.poke();
  }
}

const RECV_BASE = 1 << 20;
function recvId(i: number): number {
  return RECV_BASE + i;
}
