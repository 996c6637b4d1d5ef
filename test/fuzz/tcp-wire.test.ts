/**
 * tcp provider wire fuzz (issue 9, "Tests"): fast-check-generated and
 * mutated frames (src/transport/tcp/codec.ts, docs/wire-format.md) on a tcp
 * device's port.
 *
 * - Without a HELLO: random bytes and random or mutated first frames from
 *   raw sockets. The device closes every stream that is not a valid HELLO
 *   for one of its QPs from its peer (or holds it until it closes, when the
 *   header is not complete), nothing stays pending, and a legitimate QP pair
 *   on the device keeps moving data.
 * - After a valid HELLO, as the peer of a real "victim" QP: streams of
 *   request frames, well-formed and mutated (types, flags, PSNs, keys,
 *   addresses, lengths, payloads that lie about their size, piggybacked
 *   ACKs). A model written from docs/wire-format.md (not from the codec)
 *   predicts each stream's outcome: the QP stays up and has done exactly what
 *   the valid frames said (memory, receives, READ and atomic responses), or
 *   goes to ERR with a typed async event (with the NAK the spec names, when
 *   it names one); where a frame lies about its payload the outcome is open,
 *   but still an async event once we close. Memory the peer may not write
 *   never changes.
 * - As the responder to a victim's requests: fuzzed responses (ACK, NAK,
 *   READ_RESP, ATOMIC_RESP, garbage). Correct responses complete every work
 *   request; anything else still completes each exactly once, in order, and
 *   READ/atomic data lands only in its own buffer.
 *
 * Device, QP and key tables return to the baseline after every batch; no
 * unhandled rejection. Wire level of the tcp provider: skipped on verbs.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import fc from "fast-check";
import {
  Access,
  CompletionBuffer,
  QpState,
  SendFlags,
  WcOpcode,
  WcStatus,
  WrOpcode,
  wcStatusName,
  type AsyncEvent,
  type MemoryRegion,
  type ProtectionDomain,
} from "../../src/transport/types.js";
import { tcpProvider, type TcpDevice } from "../../src/transport/tcp/index.js";
import { FrameType, HEADER_LEN, decodeHeader, encodeHeader, newHeader, type FrameHeader } from "../../src/transport/tcp/codec.js";
import { PROVIDER } from "../support/api.js";
import { ALL_REMOTE, makeSide, sge, waitCompletions, type Side } from "../support/seam.js";
import { Waiter, deadline, fcParams, hex, runs, settledRssMiB, tables, watchUnhandled } from "../support/fuzz.js";

const HOST = "127.0.0.1";
const STEP_MS = 20_000;
const PSN_MASK = 0xffffff;
const FAKE_QPN = 0xc0ffee;
const FAKE_PSN = 0x123456;
const MR_LEN = 4096;
const RECV_LEN = 256;
const RECVS = 256;
const U32 = 0xffffffff;

function withDeadline<T>(p: Promise<T>, what: string): Promise<T> {
  return deadline(p, STEP_MS, what);
}

function bytesOf(m: MemoryRegion): Uint8Array {
  return new Uint8Array(m.buffer, m.offset, m.length);
}

/** A header from explicit fields, copied out of the codec's arena. */
function header(f: { type: number; flags?: number; psn?: number; payloadLen?: number; rkey?: number; raddr?: number; imm?: number; aux?: number; op1?: bigint; op2?: bigint }): Uint8Array {
  return Uint8Array.from(encodeHeader(f.type as FrameType, f.flags ?? 0, f.psn ?? 0, f.payloadLen ?? 0, f.rkey ?? 0, f.raddr ?? 0, f.imm ?? 0, f.aux ?? 0, f.op1 ?? 0n, f.op2 ?? 0n));
}

/** Parses the frames a well-behaved QP sends (a parse error is a failure of the device, recorded). */
class Frames {
  private buf: Buffer = Buffer.alloc(0);
  readonly list: { h: FrameHeader; payload: Buffer }[] = [];
  ended = false;
  error: string | null = null;
  constructor(
    readonly sock: net.Socket,
    w: Waiter,
    /** The one stream carries both directions: which frame types this view keeps. */
    keep: (type: number) => boolean = () => true,
  ) {
    sock.on("data", (c: Buffer) => {
      this.buf = this.buf.length ? Buffer.concat([this.buf, c]) : c;
      while (this.error === null && this.buf.length >= HEADER_LEN) {
        const h = newHeader();
        const e = decodeHeader(this.buf, 0, h);
        if (e !== null) {
          this.error = e;
          break;
        }
        if (this.buf.length < HEADER_LEN + h.payloadLen) break;
        if (keep(h.type)) this.list.push({ h, payload: Buffer.from(this.buf.subarray(HEADER_LEN, HEADER_LEN + h.payloadLen)) });
        this.buf = this.buf.subarray(HEADER_LEN + h.payloadLen);
      }
      w.poke();
    });
    const end = (): void => {
      this.ended = true;
      w.poke();
    };
    sock.on("end", end);
    sock.on("close", end);
    sock.on("error", () => {});
  }
}

function connectRaw(port: number, w: Waiter): Promise<net.Socket> {
  return withDeadline(
    new Promise<net.Socket>((resolve, reject) => {
      const s = net.connect({ host: HOST, port, noDelay: true });
      s.once("connect", () => resolve(s));
      s.once("error", reject);
      s.on("close", () => w.poke());
    }),
    `a connection to ${HOST}:${port}`,
  );
}

// ------------------------------------------------------------- the model (docs/wire-format.md)

interface Fields {
  type: number;
  flags: number;
  psn: number;
  payloadLen: number;
  rkey: number;
  raddr: number;
  imm: number;
  aux: number;
  op1: bigint;
  op2: bigint;
}

/** Reads a header by the table of docs/wire-format.md; a string names why it is malformed. */
function parse(b: Uint8Array): Fields | string {
  const dv = new DataView(b.buffer, b.byteOffset, HEADER_LEN);
  if (b[0] !== 0xd7) return "magic";
  if (b[1] !== 2) return "version";
  const f: Fields = {
    type: b[2]!,
    flags: b[3]!,
    psn: dv.getUint32(4),
    payloadLen: dv.getUint32(8),
    rkey: dv.getUint32(12),
    raddr: dv.getUint32(16) * 2 ** 32 + dv.getUint32(20),
    imm: dv.getUint32(24),
    aux: dv.getUint32(28),
    op1: dv.getBigUint64(32),
    op2: dv.getBigUint64(40),
  };
  if (f.type < 1 || f.type > 8) return `type ${f.type}`;
  if (f.flags & ~7) return "flags";
  if (f.flags & 4 && ![FrameType.SEND, FrameType.WRITE, FrameType.READ_REQ].includes(f.type as 2)) return "ACK flag on a type that cannot carry it";
  if (f.flags & 4 && f.op2 >= 1n << 24n) return "piggybacked ACK PSN beyond 24 bits";
  if (f.payloadLen > 2 ** 31) return "payload length";
  if (dv.getUint32(16) >= 0x200000) return "address beyond 2^53";
  if ([FrameType.HELLO, FrameType.READ_REQ, FrameType.ATOMIC, FrameType.ACK, FrameType.ATOMIC_RESP].includes(f.type as 1) && f.payloadLen !== 0) return "payload on a type without one";
  if (f.type === FrameType.READ_REQ && f.aux > 2 ** 31) return "read length";
  if (f.type === FrameType.ATOMIC && f.aux > 1) return "atomic op";
  if (f.type === FrameType.ACK && f.aux > 4) return "syndrome";
  return f;
}

const psnBefore = (a: number, b: number): boolean => {
  const d = (b - a) & PSN_MASK;
  return d !== 0 && d < 0x800000;
};

interface Region {
  addr: number;
  rkey: number;
  length: number;
  access: number;
}

/** What the victim offers and holds, as the model sees it. */
interface Victim {
  /** The victim's initial PSN (its requester: nothing sent, so only PSNs before it may be acknowledged). */
  psn: number;
  regions: Region[];
  /** Shadow of the target MR (REMOTE_WRITE | READ | ATOMIC). */
  shadow: Uint8Array;
  targetAddr: number;
}

type Outcome =
  | { k: "up"; recvs: { len: number; bytes: Uint8Array; imm: number | null; opcode: number }[]; responses: { type: number; psn: number; payload?: Uint8Array; op1?: bigint }[]; ePsn: number }
  | { k: "err"; nak: { psn: number; syndrome: number } | null; why: string }
  | { k: "open"; why: string };

/**
 * Feeds frames (header + the payload actually sent) through the rules and
 * returns the outcome; the shadow takes every write the rules allow.
 */
function model(v: Victim, frames: { hdr: Uint8Array; payload: Uint8Array }[]): Outcome {
  let ePsn = FAKE_PSN;
  const recvs: { len: number; bytes: Uint8Array; imm: number | null; opcode: number }[] = [];
  const responses: { type: number; psn: number; payload?: Uint8Array; op1?: bigint }[] = [];
  const find = (rkey: number, addr: number, len: number, need: number): Region | null => {
    const r = v.regions.find((x) => x.rkey === rkey);
    if (!r || !(r.access & need) || addr < r.addr || addr + len > r.addr + r.length) return null;
    return r;
  };
  for (const fr of frames) {
    const f = parse(fr.hdr);
    if (typeof f === "string") return { k: "err", nak: null, why: `malformed header: ${f}` };
    if (f.flags & 4 && !psnBefore(Number(f.op2), v.psn)) return { k: "err", nak: null, why: "piggybacked ACK for a PSN never sent" };
    // One stream (wire version 2): responses and ACKs go to the victim's requester, which sent nothing.
    if (f.type === FrameType.ACK || f.type === FrameType.READ_RESP || f.type === FrameType.ATOMIC_RESP) {
      // A duplicate ACK for a PSN before its first request acknowledges nothing: legal, ignored.
      if (f.type === FrameType.ACK && f.aux === 0 && psnBefore(f.psn, v.psn)) continue;
      return { k: "err", nak: null, why: `frame type ${f.type} for a request the victim never sent` };
    }
    if (f.psn !== ePsn) return { k: "err", nak: null, why: `PSN ${f.psn} out of sequence` };
    const lie = f.payloadLen !== fr.payload.length;
    const nak = (syndrome: number, why: string): Outcome => ({ k: "err", nak: { psn: f.psn, syndrome }, why });
    // A length that lies about the payload sent: what follows is read as payload or as the next
    // header; the outcome is open (the checks the header alone fails come first).
    const open: Outcome = { k: "open", why: "a payload length that lies" };
    switch (f.type) {
      case FrameType.SEND:
        if (f.payloadLen > RECV_LEN) return nak(2, "message longer than the receive");
        if (lie) return open;
        recvs.push({ len: f.payloadLen, bytes: fr.payload, imm: f.flags & 1 ? f.imm : null, opcode: WcOpcode.RECV });
        break;
      case FrameType.WRITE: {
        if (f.payloadLen > 0 && !find(f.rkey, f.raddr, f.payloadLen, Access.REMOTE_WRITE)) return nak(3, "WRITE outside what the key allows");
        if (lie) return open;
        if (f.payloadLen > 0) v.shadow.set(fr.payload, f.raddr - v.targetAddr);
        if (f.flags & 1) recvs.push({ len: f.payloadLen, bytes: new Uint8Array(0), imm: f.imm, opcode: WcOpcode.RECV_RDMA_WITH_IMM });
        break;
      }
      case FrameType.READ_REQ: {
        const r = f.aux === 0 ? null : find(f.rkey, f.raddr, f.aux, Access.REMOTE_READ);
        if (f.aux > 0 && !r) return nak(3, "READ outside what the key allows");
        if (lie) return open;
        // the read-only region never changes: its snapshot is its content
        const src = r === null ? new Uint8Array(0) : r.addr === v.targetAddr ? v.shadow : readOnlySnapshot;
        responses.push({ type: FrameType.READ_RESP, psn: f.psn, payload: r === null ? src : Uint8Array.from(src.subarray(f.raddr - r.addr, f.raddr - r.addr + f.aux)) });
        break;
      }
      case FrameType.ATOMIC: {
        if (f.raddr % 8 !== 0) return nak(2, "misaligned atomic");
        if (!find(f.rkey, f.raddr, 8, Access.REMOTE_ATOMIC)) return nak(3, "atomic outside what the key allows");
        if (lie) return open;
        const dv = new DataView(v.shadow.buffer, v.shadow.byteOffset + (f.raddr - v.targetAddr), 8);
        const orig = dv.getBigUint64(0, true);
        if (f.aux === 0) {
          if (orig === f.op1) dv.setBigUint64(0, f.op2, true);
        } else dv.setBigUint64(0, BigInt.asUintN(64, orig + f.op1), true);
        responses.push({ type: FrameType.ATOMIC_RESP, psn: f.psn, op1: orig });
        break;
      }
      default:
        return { k: "err", nak: null, why: `frame type ${f.type} for the responder` };
    }
    ePsn = (ePsn + 1) & PSN_MASK;
  }
  return { k: "up", recvs, responses, ePsn };
}

/** Content of every victim's read-only region (filled the same way each time). */
const readOnlySnapshot = new Uint8Array(MR_LEN).map((_, i) => (i * 13 + 5) & 0xff);

// ------------------------------------------------------------------ the frames

type Target = "target" | "readOnly" | "otherPd" | "randomKey";
type Intent =
  | { k: "send"; len: number; fill: number; imm: number | null }
  | { k: "write"; tgt: Target; off: number; len: number; fill: number; imm: number | null }
  | { k: "read"; tgt: Target; off: number; len: number }
  | { k: "atomic"; tgt: Target; off: number; cas: boolean; op1: bigint; op2: bigint }
  | { k: "other"; type: number; aux: number; payloadLen: number }
  | { k: "raw"; bytes: Uint8Array };

interface Shape {
  intent: Intent;
  psn: { k: "next" } | { k: "any"; v: number };
  ack: { k: "none" } | { k: "legal"; back: number } | { k: "any"; v: bigint };
  /** Byte edits of the header. */
  edits: { at: number; v: number }[];
  /** Payload bytes sent minus the length the header claims (0: honest). */
  lie: number;
}

const u32 = fc.integer({ min: 0, max: U32 });
const u64 = fc.bigInt({ min: 0n, max: (1n << 64n) - 1n });
const tgt = fc.constantFrom<Target>("target", "target", "target", "readOnly", "otherPd", "randomKey");
const intent: fc.Arbitrary<Intent> = fc.oneof(
  { weight: 4, arbitrary: fc.record({ k: fc.constant("send" as const), len: fc.oneof(fc.integer({ min: 0, max: RECV_LEN }), fc.integer({ min: 0, max: 2000 })), fill: fc.integer({ min: 0, max: 255 }), imm: fc.option(u32, { nil: null }) }) },
  {
    weight: 6,
    arbitrary: fc.record({ k: fc.constant("write" as const), tgt, off: fc.oneof(fc.integer({ min: 0, max: MR_LEN }), fc.integer({ min: -100, max: 2 * MR_LEN })), len: fc.oneof(fc.integer({ min: 0, max: 512 }), fc.integer({ min: 0, max: MR_LEN + 64 })), fill: fc.integer({ min: 0, max: 255 }), imm: fc.option(u32, { nil: null, freq: 4 }) }),
  },
  { weight: 3, arbitrary: fc.record({ k: fc.constant("read" as const), tgt, off: fc.integer({ min: -64, max: MR_LEN + 64 }), len: fc.oneof(fc.integer({ min: 0, max: 512 }), fc.integer({ min: 0, max: MR_LEN + 64 })) }) },
  { weight: 3, arbitrary: fc.record({ k: fc.constant("atomic" as const), tgt, off: fc.oneof(fc.integer({ min: 0, max: MR_LEN / 8 - 1 }).map((x) => x * 8), fc.integer({ min: -16, max: MR_LEN + 16 })), cas: fc.boolean(), op1: u64, op2: u64 }) },
  { weight: 1, arbitrary: fc.record({ k: fc.constant("other" as const), type: fc.constantFrom(FrameType.HELLO, FrameType.ACK, FrameType.READ_RESP, FrameType.ATOMIC_RESP, 0, 9, 200), aux: fc.integer({ min: 0, max: 5 }), payloadLen: fc.constantFrom(0, 0, 8) }) },
  { weight: 1, arbitrary: fc.uint8Array({ minLength: HEADER_LEN, maxLength: HEADER_LEN }).map((bytes) => ({ k: "raw" as const, bytes })) },
);
const shape: fc.Arbitrary<Shape> = fc.record({
  intent,
  psn: fc.oneof({ weight: 30, arbitrary: fc.constant({ k: "next" as const }) }, { weight: 1, arbitrary: fc.oneof(u32, fc.integer({ min: FAKE_PSN - 2, max: FAKE_PSN + 40 })).map((v) => ({ k: "any" as const, v })) }),
  ack: fc.oneof(
    { weight: 20, arbitrary: fc.constant({ k: "none" as const }) },
    { weight: 2, arbitrary: fc.integer({ min: 1, max: 0x900000 }).map((back) => ({ k: "legal" as const, back })) },
    { weight: 1, arbitrary: u64.map((v) => ({ k: "any" as const, v: v >> BigInt(Number(v & 63n)) })) },
  ),
  edits: fc.oneof({ weight: 8, arbitrary: fc.constant<{ at: number; v: number }[]>([]) }, { weight: 1, arbitrary: fc.array(fc.record({ at: fc.integer({ min: 0, max: HEADER_LEN - 1 }), v: fc.integer({ min: 0, max: 255 }) }), { minLength: 1, maxLength: 3 }) }),
  lie: fc.oneof({ weight: 40, arbitrary: fc.constant(0) }, { weight: 1, arbitrary: fc.integer({ min: -64, max: 64 }) }),
});

/** Frames the rules accept: in sequence, inside the target region, honest lengths, ACKs for PSNs before the victim's. */
const validShape: fc.Arbitrary<Shape> = fc.record({
  intent: fc.oneof(
    fc.record({ k: fc.constant("send" as const), len: fc.integer({ min: 0, max: RECV_LEN }), fill: fc.integer({ min: 0, max: 255 }), imm: fc.option(u32, { nil: null }) }),
    fc.integer({ min: 0, max: MR_LEN }).chain((len) =>
      fc.record({ k: fc.constant("write" as const), tgt: fc.constant<Target>("target"), off: fc.integer({ min: 0, max: MR_LEN - len }), len: fc.constant(len), fill: fc.integer({ min: 0, max: 255 }), imm: fc.option(u32, { nil: null, freq: 4 }) }),
    ),
    fc.integer({ min: 0, max: MR_LEN }).chain((len) => fc.record({ k: fc.constant("read" as const), tgt: fc.constantFrom<Target>("target", "readOnly"), off: fc.integer({ min: 0, max: MR_LEN - len }), len: fc.constant(len) })),
    fc.record({ k: fc.constant("atomic" as const), tgt: fc.constant<Target>("target"), off: fc.integer({ min: 0, max: MR_LEN / 8 - 1 }).map((x) => x * 8), cas: fc.boolean(), op1: u64, op2: u64 }),
  ),
  psn: fc.constant({ k: "next" as const }),
  ack: fc.oneof(fc.constant<Shape["ack"]>({ k: "none" }), fc.integer({ min: 1, max: 0x7fffff }).map((back): Shape["ack"] => ({ k: "legal", back }))),
  edits: fc.constant<{ at: number; v: number }[]>([]),
  lie: fc.constant(0),
});

function showShape(s: Shape): string {
  const i = s.intent;
  const what = i.k === "raw" ? `raw ${hex(i.bytes)}` : JSON.stringify(i, (_k, x: unknown) => (typeof x === "bigint" ? `${x}n` : x));
  return `${what}${s.psn.k === "any" ? ` psn=${s.psn.v}` : ""}${s.ack.k !== "none" ? ` ack=${JSON.stringify(s.ack, (_k, x: unknown) => (typeof x === "bigint" ? `${x}n` : x))}` : ""}${s.edits.length ? ` edits=${JSON.stringify(s.edits)}` : ""}${s.lie ? ` lie=${s.lie}` : ""}`;
}

interface Keys {
  target: MemoryRegion;
  readOnly: MemoryRegion;
  otherPd: MemoryRegion;
}

/** The bytes of one frame as the shape says, against the victim's regions; `psn` is the next expected one. */
function build(s: Shape, k: Keys, victimPsn: number, psn: number): { hdr: Uint8Array; payload: Uint8Array } {
  const i = s.intent;
  const region = (t: Target): { addr: number; rkey: number } =>
    t === "randomKey" ? { addr: k.target.addr, rkey: (k.target.rkey ^ 0x00a5a5a5) >>> 0 } : t === "target" ? { addr: k.target.addr, rkey: k.target.rkey } : t === "readOnly" ? { addr: k.readOnly.addr, rkey: k.readOnly.rkey } : { addr: k.otherPd.addr, rkey: k.otherPd.rkey };
  let hdr: Uint8Array;
  let payload = new Uint8Array(0);
  const p = s.psn.k === "next" ? psn : s.psn.v;
  const ackFlag = s.ack.k === "none" ? 0 : 4;
  const op2 = s.ack.k === "legal" ? BigInt((victimPsn - s.ack.back) & PSN_MASK) : s.ack.k === "any" ? s.ack.v : 0n;
  switch (i.k) {
    case "send":
      payload = new Uint8Array(i.len).fill(i.fill);
      hdr = header({ type: FrameType.SEND, flags: (i.imm === null ? 0 : 1) | ackFlag, psn: p, payloadLen: i.len, imm: i.imm ?? 0, op2 });
      break;
    case "write": {
      const r = region(i.tgt);
      payload = new Uint8Array(i.len).map((_, j) => (i.fill + j) & 0xff);
      hdr = header({ type: FrameType.WRITE, flags: (i.imm === null ? 0 : 1) | ackFlag, psn: p, payloadLen: i.len, rkey: r.rkey, raddr: Math.max(0, r.addr + i.off), imm: i.imm ?? 0, op2 });
      break;
    }
    case "read": {
      const r = region(i.tgt);
      hdr = header({ type: FrameType.READ_REQ, flags: ackFlag, psn: p, rkey: r.rkey, raddr: Math.max(0, r.addr + i.off), aux: i.len, op2 });
      break;
    }
    case "atomic": {
      const r = region(i.tgt);
      // the ACK flag is malformed on an atomic (operand2 is the swap value): only edits put it there
      hdr = header({ type: FrameType.ATOMIC, psn: p, rkey: r.rkey, raddr: Math.max(0, r.addr + i.off), aux: i.cas ? 0 : 1, op1: i.op1, op2: i.op2 });
      break;
    }
    case "other":
      payload = new Uint8Array(i.payloadLen);
      hdr = header({ type: i.type === 0 || i.type > 8 ? FrameType.SEND : i.type, flags: 0, psn: p, payloadLen: i.payloadLen, aux: i.aux });
      if (i.type === 0 || i.type > 8) hdr[2] = i.type;
      break;
    case "raw":
      hdr = Uint8Array.from(i.bytes);
      break;
  }
  for (const e of s.edits) hdr[e.at] = e.v;
  if (s.lie > 0) {
    const more = new Uint8Array(payload.length + s.lie).fill(0x77);
    more.set(payload);
    payload = more;
  } else if (s.lie < 0) payload = payload.subarray(0, Math.max(0, payload.length + s.lie));
  return { hdr, payload };
}

// ------------------------------------------------------------------ the test

describe(`tcp wire fuzz [${PROVIDER}]`, { skip: PROVIDER !== "tcp" && "SKIPPED on verbs: the tcp provider's wire format (no tcp frames reach a verbs device)", timeout: 600_000 }, () => {
  let dev: TcpDevice;
  let port: number;
  /** A legitimate pair on the same device: it must keep working throughout. */
  let a: Side;
  let b: Side;
  const pairEvents: AsyncEvent[] = [];
  let otherPd: ProtectionDomain;
  let otherMr: MemoryRegion;
  let base: ReturnType<typeof tables>;
  /** Where victims dial their "peer": us. */
  let fake: net.Server;
  const accepted: net.Socket[] = [];
  const w = new Waiter();
  const watch = watchUnhandled();
  let frames = 0;
  let legitRounds = 0;

  before(async () => {
    dev = (await tcpProvider.openDevice("tcp-fuzz", { host: HOST })) as TcpDevice;
    port = dev.port;
    a = makeSide(dev);
    b = makeSide(dev);
    a.qp.onEvent = b.qp.onEvent = (e) => pairEvents.push(e);
    const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
    a.qp.connect(b.qp.localEndpoint(), attr);
    b.qp.connect(a.qp.localEndpoint(), attr);
    otherPd = dev.allocPd();
    otherMr = otherPd.registerMr(MR_LEN, ALL_REMOTE);
    bytesOf(otherMr).fill(0x3c);
    fake = net.createServer({ noDelay: true }, (s) => {
      accepted.push(s);
      w.poke();
    });
    fake.on("error", () => {});
    await new Promise<void>((r) => fake.listen(0, HOST, r));
    await legit();
    base = tables(dev);
  });

  after(() => {
    for (const s of accepted) s.destroy();
    fake?.close();
    dev?.close();
    watch.stop();
  });

  /** The legitimate pair moves data (SEND, WRITE, READ back) and saw no event. */
  async function legit(): Promise<void> {
    const round = ++legitRounds;
    const src = a.pd.registerMr(256, ALL_REMOTE);
    const dst = b.pd.registerMr(256, ALL_REMOTE);
    try {
      bytesOf(src).forEach((_, i, v) => (v[i] = (round + i) & 0xff));
      b.qp.postRecv([{ wrId: round, sgList: [sge(dst, 0, 64)] }]);
      a.qp.postSend([
        { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 64)] },
        { wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(src, 64, 192)], remoteAddr: dst.addr + 64, rkey: dst.rkey },
        { wrId: 3, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 256)], remoteAddr: dst.addr, rkey: dst.rkey },
      ]);
      const sc = await waitCompletions(a, 3, STEP_MS);
      assert.deepEqual(sc.map((c) => wcStatusName(c.status)), ["SUCCESS", "SUCCESS", "SUCCESS"], "the legitimate pair moves data");
      const [rc] = await waitCompletions(b, 1, STEP_MS);
      assert.equal(rc!.status, WcStatus.SUCCESS);
      assert.deepEqual(pairEvents, [], "no async event on the legitimate pair");
      assert.equal(a.qp.state, QpState.RTS);
    } finally {
      src.deregister();
      dst.deregister();
    }
  }

  async function backToBase(): Promise<void> {
    const now = (): string => JSON.stringify({ t: tables(dev), pending: dev.pendingHello.size });
    const want = JSON.stringify({ t: base, pending: 0 });
    const end = performance.now() + STEP_MS;
    while (now() !== want) {
      if (performance.now() > end) assert.fail(`device tables not back to the baseline: ${now()} vs ${want}`);
      await new Promise((r) => setImmediate(r));
    }
  }

  it("first frames without a HELLO: the device refuses every stream that is not a HELLO for one of its QPs, holds nothing, and keeps serving", async () => {
    const numRuns = runs(50, 1);
    let n = 0;
    const first = fc.oneof(
      fc.uint8Array({ minLength: 0, maxLength: 3000 }),
      fc.uint8Array({ minLength: 1, maxLength: HEADER_LEN - 1 }),
      fc.tuple(shape, fc.nat()).map(([s, q]) => {
        const f = build(s, { target: otherMr, readOnly: otherMr, otherPd: otherMr }, 0, q & PSN_MASK);
        return Buffer.concat([f.hdr, f.payload]);
      }),
      // HELLOs naming no QP, or a real one (the pair's) from a stranger
      fc.tuple(fc.oneof(u32, fc.constant(-1)), u32, u64, fc.array(fc.record({ at: fc.integer({ min: 0, max: HEADER_LEN - 1 }), v: fc.integer({ min: 0, max: 255 }) }), { maxLength: 2 }), fc.uint8Array({ maxLength: 200 })).map(([qpn, psn, src, edits, more]) => {
        const h = header({ type: FrameType.HELLO, psn, aux: qpn === -1 ? a.qp.qpNum : qpn, op1: src });
        for (const e of edits) h[e.at] = e.v;
        return Buffer.concat([h, more]);
      }),
    );
    await fc.assert(
      fc.asyncProperty(fc.array(fc.tuple(first, fc.boolean()), { minLength: 20, maxLength: 100 }), async (batch) => {
        const socks = await Promise.all(
          batch.map(async ([bytes, split]) => {
            const s = await connectRaw(port, w);
            let closed = false;
            s.on("error", () => {});
            s.on("close", () => {
              closed = true;
              w.poke();
            });
            if (split && bytes.length > 1) {
              s.write(bytes.subarray(0, bytes.length >> 1));
              await new Promise((r) => setImmediate(r));
              s.write(bytes.subarray(bytes.length >> 1));
            } else s.write(bytes);
            return { s, bytes, closed: () => closed };
          }),
        );
        n += batch.length;
        // A complete first header that is not a HELLO naming a connected QP of this device from its peer: closed by the device.
        // (Our HELLOs never carry a pair QP's real peer credentials; a bare HELLO for the pair from a stranger is refused too.)
        const mustClose = socks.filter((x) => x.bytes.length >= HEADER_LEN);
        await w.until(() => mustClose.every((x) => x.closed()), "the device to close every stream whose first frame is not an acceptable HELLO", STEP_MS).catch((e: Error) => {
          const open = mustClose.filter((x) => !x.closed()).map((x) => hex(x.bytes));
          throw new Error(`${e.message}; still open: ${open.slice(0, 5).join(", ")}`);
        });
        // The rest (not a whole header yet) waits for more until the HELLO deadline: we close them.
        for (const x of socks) x.s.destroy();
        await backToBase();
        watch.check();
        await legit();
      }),
      fcParams(0x7c9, numRuns),
    );
    console.log(`# ${n} first frames without a HELLO`);
  });

  /**
   * A victim QP whose peer we are: it dialed us (its QP number is lower: wire version 2, one stream per
   * QP); inS shows the requests it sends on that stream, outS its responses, and our requests go on it too.
   */
  async function victim(recvs = RECVS): Promise<{
    side: Side;
    keys: Keys;
    recvMr: MemoryRegion;
    events: AsyncEvent[];
    psn: number;
    inS: Frames;
    outS: Frames;
    close(): void;
  }> {
    const pd = dev.allocPd();
    const cq = dev.createCq(2 * RECVS + 64);
    const side: Side = { dev, pd, cq, qp: pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: 16, maxRecvWr: RECVS, maxSendSge: 1, maxRecvSge: 1, maxInlineData: 0 }), buf: new CompletionBuffer(64) };
    const events: AsyncEvent[] = [];
    side.qp.onEvent = (e) => {
      events.push(e);
      w.poke();
    };
    const target = side.pd.registerMr(MR_LEN, ALL_REMOTE);
    const readOnly = side.pd.registerMr(MR_LEN, Access.LOCAL_WRITE | Access.REMOTE_READ);
    const recvMr = side.pd.registerMr(RECVS * RECV_LEN, Access.LOCAL_WRITE);
    bytesOf(target).fill(0);
    bytesOf(readOnly).set(readOnlySnapshot);
    if (recvs > 0) side.qp.postRecv(Array.from({ length: recvs }, (_, i) => ({ wrId: 1000 + i, sgList: [sge(recvMr, i * RECV_LEN, RECV_LEN)] })));
    accepted.length = 0;
    side.qp.connect({ provider: "tcp", qpNum: FAKE_QPN, psn: FAKE_PSN, lid: 0, gid: HOST, port: (fake.address() as net.AddressInfo).port, mtu: 4096 }, { timeout: 0, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 });
    await w.until(() => accepted.length > 0, "the victim to dial us", STEP_MS);
    const out = accepted.shift()!;
    const responseTypes: readonly number[] = [FrameType.ACK, FrameType.READ_RESP, FrameType.ATOMIC_RESP];
    const inS = new Frames(out, w, (t) => !responseTypes.includes(t));
    const outS = new Frames(out, w, (t) => responseTypes.includes(t));
    await w.until(() => inS.list.length > 0 || inS.error !== null, "the victim's HELLO", STEP_MS);
    const hello = inS.list.shift()!;
    assert.equal(hello.h.type, FrameType.HELLO);
    return {
      side,
      keys: { target, readOnly, otherPd: otherMr },
      recvMr,
      events,
      psn: hello.h.psn,
      inS,
      outS,
      close() {
        inS.sock.destroy();
        out.destroy();
        for (const f of [() => side.qp.destroy(), () => side.cq.destroy(), () => target.deregister(), () => readOnly.deregister(), () => recvMr.deregister(), () => side.pd.dealloc()]) {
          try {
            f();
          } catch {
            /* gone */
          }
        }
      },
    };
  }

  it("request streams after a valid HELLO: the QP does exactly what the valid frames say, or fails with a typed async event (and the NAK the spec names); nothing it may not write changes", async () => {
    const numRuns = runs(2000, 1);
    const seen = new Map<string, number>();
    let rss0 = 0;
    let cases = 0;
    // Valid streams (the QP must do exactly what they say), valid streams ending in anything, and anything.
    const stream = fc
      .oneof(
        fc.array(validShape, { minLength: 1, maxLength: 60, size: "medium" }),
        fc.tuple(fc.array(validShape, { maxLength: 30, size: "medium" }), shape).map(([vs, s]) => [...vs, s]),
        fc.array(shape, { minLength: 1, maxLength: 8 }),
      )
      .map((shapes) => Object.assign(shapes, { [fc.toStringMethod]: () => `stream:\n  ${shapes.map(showShape).join("\n  ")}` }));
    await fc.assert(
      fc.asyncProperty(stream, async (shapes) => {
        // RSS baseline once warm (the first cases grow the heap, JIT and allocator; not a leak)
        if (++cases === Math.floor(Math.min(1000, numRuns / 2))) rss0 = await settledRssMiB();
        const v = await victim();
        try {
          // At most 8 READ/atomic requests per stream: well under maxDestRdAtomic (16), whatever the timing.
          let rd = 0;
          const kept = shapes.filter((s) => !(s.intent.k === "read" || s.intent.k === "atomic") || ++rd <= 8);
          const mv: Victim = {
            psn: v.psn,
            regions: [
              { addr: v.keys.target.addr, rkey: v.keys.target.rkey, length: MR_LEN, access: ALL_REMOTE },
              { addr: v.keys.readOnly.addr, rkey: v.keys.readOnly.rkey, length: MR_LEN, access: Access.REMOTE_READ },
            ],
            shadow: new Uint8Array(MR_LEN),
            targetAddr: v.keys.target.addr,
          };
          // Frames are built one by one against the PSN the model expects next (so "next" stays in sequence).
          const built: { hdr: Uint8Array; payload: Uint8Array }[] = [];
          let next = FAKE_PSN;
          for (const s of kept) {
            const f = build(s, v.keys, v.psn, next);
            built.push(f);
            const pf = parse(f.hdr);
            if (typeof pf !== "string" && pf.psn === next) next = (next + 1) & PSN_MASK;
          }
          const out = model(mv, built);
          const probePsn = out.k === "up" ? out.ePsn : -1;
          const wire = Buffer.concat(built.flatMap((f) => [f.hdr, f.payload]));
          v.outS.sock.write(wire);
          frames += built.length;
          if (out.k === "up") v.outS.sock.write(header({ type: FrameType.WRITE, psn: probePsn }));
          const what = `model: ${JSON.stringify(out, (_k, x: unknown) => (typeof x === "bigint" ? `${x}n` : x instanceof Uint8Array ? hex(x, 8) : x))}`;
          if (out.k === "up") {
            await w.until(() => v.outS.list.some((x) => x.h.type === FrameType.ACK && x.h.psn === probePsn) || v.events.length > 0 || v.outS.error !== null, "the ACK of the probe or an event", STEP_MS);
            assert.equal(v.outS.error, null, `the victim sent a malformed frame: ${v.outS.error}`);
            assert.deepEqual(v.events, [], `${what}: no event expected`);
            assert.equal(v.side.qp.state, QpState.RTS);
            // Responses: every READ_RESP/ATOMIC_RESP in order with the right bytes; ACKs only with syndrome 0.
            const resp = v.outS.list.filter((x) => x.h.type !== FrameType.ACK);
            for (const x of v.outS.list) if (x.h.type === FrameType.ACK) assert.equal(x.h.aux, 0, `${what}: a NAK (syndrome ${x.h.aux}) for PSN ${x.h.psn}`);
            assert.equal(resp.length, out.responses.length, `${what}: responses`);
            for (const [i, r] of out.responses.entries()) {
              const got = resp[i]!;
              assert.equal(got.h.type, r.type);
              assert.equal(got.h.psn, r.psn);
              if (r.payload) assert.deepEqual(new Uint8Array(got.payload), r.payload, `${what}: READ_RESP ${r.psn} carries the region's bytes`);
              if (r.op1 !== undefined) assert.equal(got.h.op1, r.op1, `${what}: ATOMIC_RESP ${r.psn} carries the original value`);
            }
            // Receives: exactly the SENDs and WRITE-with-immediates, in order, with their bytes.
            if (out.recvs.length > 0) {
              const wcs = await waitCompletions(v.side, out.recvs.length, STEP_MS);
              for (const [i, r] of out.recvs.entries()) {
                const wc = wcs[i]!;
                assert.equal(wcStatusName(wc.status), "SUCCESS", what);
                assert.equal(wc.opcode, r.opcode, what);
                assert.equal(wc.byteLen, r.len, what);
                if (r.imm !== null) assert.equal(wc.imm, r.imm, what);
                if (r.opcode === WcOpcode.RECV) assert.deepEqual(bytesOf(v.recvMr).subarray((wc.wrId - 1000) * RECV_LEN, (wc.wrId - 1000) * RECV_LEN + r.len), r.bytes, what);
              }
            }
            assert.deepEqual(bytesOf(v.keys.target), mv.shadow, `${what}: the target region holds exactly what the valid WRITEs and atomics put there`);
            seen.set("up", (seen.get("up") ?? 0) + 1);
          } else {
            if (out.k === "open") {
              // The stream lied about a payload length: whatever the QP made of it, our closing ends it, with an event.
              v.outS.sock.end();
              v.inS.sock.end();
            }
            await w.until(() => v.events.length > 0, `${what}: an async event`, STEP_MS);
            const e = v.events[0]!;
            assert.ok(["QP_FATAL", "QP_REQ_ERR", "QP_ACCESS_ERR"].includes(e.type), `event ${e.type}`);
            assert.ok(e.reason.length > 0 && e.qpNum === v.side.qp.qpNum, "the event names a reason and the QP");
            assert.equal(v.side.qp.state, QpState.ERR);
            if (out.k === "err") {
              // Its NAK, if the spec names one, is the last thing the QP wrote before closing.
              await w.until(() => v.outS.ended, "the victim to close its streams", STEP_MS);
              const naks = v.outS.list.filter((x) => x.h.type === FrameType.ACK && x.h.aux !== 0);
              if (out.nak) assert.deepEqual(naks.map((x) => [x.h.psn, x.h.aux]), [[out.nak.psn, out.nak.syndrome]], `${what}: the NAK`);
              else assert.deepEqual(naks, [], `${what}: no NAK for a malformed or out-of-sequence frame`);
              assert.deepEqual(bytesOf(v.keys.target), mv.shadow, `${what}: the target region holds exactly what the valid frames before the bad one put there`);
            }
            seen.set(`${out.k}: ${e.type}`, (seen.get(`${out.k}: ${e.type}`) ?? 0) + 1);
          }
          assert.deepEqual(bytesOf(v.keys.readOnly), readOnlySnapshot, "the read-only region never changes");
          assert.ok(bytesOf(otherMr).every((x) => x === 0x3c), "another PD's region never changes");
        } finally {
          v.close();
        }
        watch.check();
        if (cases % 100 === 0) {
          await backToBase();
          await legit();
        }
      }),
      fcParams(0xf4a3e, numRuns),
    );
    await backToBase();
    await legit();
    const rss = await settledRssMiB();
    console.log(`# ${frames} request frames in ${numRuns} streams: ${JSON.stringify(Object.fromEntries(seen))}; RSS ${rss0.toFixed(0)} → ${rss.toFixed(0)} MiB`);
    assert.ok(rss - rss0 < 100, `RSS grew by ${(rss - rss0).toFixed(0)} MiB`);
  });

  it("responses to a victim's requests: correct ones complete every work request; fuzzed ones complete each exactly once, in order, and land data only in its own buffer", async () => {
    const numRuns = runs(400, 1);
    const seen = new Map<string, number>();
    const edit = fc.oneof(
      fc.record({ k: fc.constant("drop" as const), i: fc.nat() }),
      fc.record({ k: fc.constant("dup" as const), i: fc.nat() }),
      fc.record({ k: fc.constant("swap" as const), i: fc.nat() }),
      fc.record({ k: fc.constant("byte" as const), i: fc.nat(), at: fc.integer({ min: 0, max: HEADER_LEN - 1 }), v: fc.integer({ min: 0, max: 255 }) }),
      fc.record({ k: fc.constant("len" as const), i: fc.nat(), d: fc.integer({ min: -128, max: 128 }) }),
      fc.record({ k: fc.constant("garbage" as const), i: fc.nat(), bytes: fc.uint8Array({ minLength: 1, maxLength: 100 }) }),
    );
    await fc.assert(
      fc.asyncProperty(fc.oneof({ weight: 1, arbitrary: fc.constant([]) }, { weight: 6, arbitrary: fc.array(edit, { minLength: 1, maxLength: 4 }) }), u64, async (edits, orig) => {
        const v = await victim(0);
        try {
          const local = v.side.pd.registerMr(1024, Access.LOCAL_WRITE);
          const lv = bytesOf(local);
          lv.fill(0x11);
          v.side.qp.postSend([
            { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 64)] },
            { wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(local, 64, 64)], remoteAddr: 0x1000, rkey: 0x1234 },
            { wrId: 3, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(local, 256, 128)], remoteAddr: 0x2000, rkey: 0x1234 },
            { wrId: 4, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(local, 512, 8)], remoteAddr: 0x3000, rkey: 0x1234, compareAdd: 1n },
          ]);
          await w.until(() => v.inS.list.length >= 4 || v.inS.error !== null, "the victim's four requests", STEP_MS);
          const q = v.inS.list.map((x) => x.h.psn);
          const readData = new Uint8Array(128).map((_, i) => (i * 3 + 1) & 0xff);
          // The correct answers: one cumulative ACK for the SEND and WRITE, the READ's data, the atomic's original value.
          let resp: Uint8Array[] = [
            header({ type: FrameType.ACK, psn: q[1]!, aux: 0 }),
            Buffer.concat([header({ type: FrameType.READ_RESP, psn: q[2]!, payloadLen: 128 }), readData]),
            header({ type: FrameType.ATOMIC_RESP, psn: q[3]!, op1: orig }),
          ];
          for (const e of edits) {
            const i = e.i % (resp.length || 1);
            if (resp.length === 0 && e.k !== "garbage") continue;
            if (e.k === "drop") resp.splice(i, 1);
            else if (e.k === "dup") resp.splice(i, 0, resp[i]!);
            else if (e.k === "swap" && resp.length > 1) [resp[i], resp[(i + 1) % resp.length]] = [resp[(i + 1) % resp.length]!, resp[i]!];
            else if (e.k === "byte") resp[i] = Uint8Array.from(resp[i]!, (x, j) => (j === e.at ? e.v : x));
            else if (e.k === "len") resp[i] = resp[i]!.subarray(0, Math.max(0, resp[i]!.length + Math.min(0, e.d)));
            else if (e.k === "garbage") resp.splice(i, 0, e.bytes);
          }
          resp = resp.filter((x) => x.length > 0);
          v.inS.sock.write(Buffer.concat(resp));
          const correct = edits.length === 0;
          frames += resp.length;
          if (!correct) {
            // Whatever the QP made of them: our closing ends it, and every WR must complete.
            v.inS.sock.end();
            v.outS.sock.end();
          }
          const wcs = await waitCompletions(v.side, 4, STEP_MS);
          assert.deepEqual(wcs.map((c) => c.wrId), [1, 2, 3, 4], "each work request completes exactly once, in order");
          if (correct) {
            assert.deepEqual(wcs.map((c) => wcStatusName(c.status)), ["SUCCESS", "SUCCESS", "SUCCESS", "SUCCESS"]);
            assert.deepEqual(lv.subarray(256, 384), readData);
            assert.equal(new DataView(local.buffer, local.offset + 512, 8).getBigUint64(0, true), orig);
          }
          // Nothing lands outside the READ's and the atomic's buffers.
          for (let i = 0; i < lv.length; i++) if (!((i >= 256 && i < 384) || (i >= 512 && i < 520))) assert.equal(lv[i], 0x11, `byte ${i} of the local region`);
          // Anything that went wrong is an error status plus an async event.
          if (wcs.some((c) => c.status !== WcStatus.SUCCESS)) {
            await w.until(() => v.events.length > 0, "the async event of the failed QP", STEP_MS);
            assert.ok(["QP_FATAL", "QP_REQ_ERR", "QP_ACCESS_ERR"].includes(v.events[0]!.type));
          }
          const k = wcs.map((c) => wcStatusName(c.status)).join(",");
          seen.set(k, (seen.get(k) ?? 0) + 1);
          local.deregister();
        } finally {
          v.close();
        }
        watch.check();
      }),
      fcParams(0x5e5, numRuns),
    );
    await backToBase();
    await legit();
    console.log(`# ${numRuns} response streams: ${JSON.stringify(Object.fromEntries(seen))}`);
  });
});
