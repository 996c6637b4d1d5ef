/**
 * Hostile peers against a real tcp device on 127.0.0.1.
 *
 * (a) Raw sockets that connect to the device port and misbehave (garbage, a
 *     HELLO for an unknown QP, silence...): the device and its QPs carry on.
 * (b) A raw-socket impostor that plays the PEER of a real QP: the QP dials a
 *     net.Server we own (its QP number is lower, so it dials: wire version 2,
 *     one stream per QP), and on that one stream we read its HELLO and
 *     requests and answer them, and send it our own requests (so we are its
 *     requester too). Every malformed or hostile frame moves the QP to ERR
 *     with a reason (or the right NAK / completion status), outstanding WRs
 *     complete with an error, registered memory outside the targeted range is
 *     never modified, and nothing crashes or hangs.
 *
 * Provider-specific (wire level): runs on the tcp provider only.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import v8 from "node:v8";
import vm from "node:vm";
import {
  Access,
  QpState,
  SendFlags,
  WcOpcode,
  WcStatus,
  WrOpcode,
  wcStatusName,
  type AsyncEvent,
  type Device,
  type MemoryRegion,
  type QueuePair,
  type WorkCompletion,
} from "../../src/transport/types.js";
import { tcpProvider, type TcpQueuePair } from "../../src/transport/tcp/index.js";
import { dialsFirst } from "../../src/transport/tcp/qp.js";
import { directStats } from "../../src/transport/tcp/read-path.js";
import {
  FrameFlags,
  FrameType,
  HEADER_LEN,
  Syndrome,
  decodeHeader,
  encodeHeader,
  newHeader,
  type FrameHeader,
} from "../../src/transport/tcp/codec.js";
import { ALL_REMOTE, DEADLINE_MS, bytes, makeSide, sge, waitCompletions, type Side } from "../support/seam.js";

const HOST = "127.0.0.1";
const FAKE_QPN = 0x00c0ffee & 0xffffff;
const FAKE_PSN = 0x00123456;
const PSN_MASK = 0xffffff;
const MR_LEN = 4096;

// ------------------------------------------------------------------ helpers

/** Everything that can make progress pokes the waiter; `until` re-checks its condition on each poke. */
class Waiter {
  private pokes = new Set<() => void>();
  poke(): void {
    for (const p of [...this.pokes]) p();
  }
  /** Resolves once `cond()` holds; rejects after `ms` with `what`. `pollMs` also re-checks on a timer (for memory contents). */
  until(cond: () => boolean, what: string, ms = DEADLINE_MS, pollMs = 0): Promise<void> {
    if (cond()) return Promise.resolve();
    return new Promise<void>((resolve, reject) => {
      let poll: NodeJS.Timeout | null = null;
      const check = (): void => {
        let ok = false;
        try {
          ok = cond();
        } catch (e) {
          done();
          reject(e);
          return;
        }
        if (ok) {
          done();
          resolve();
        }
      };
      const timer = setTimeout(() => {
        done();
        reject(new Error(`timed out after ${ms} ms waiting for ${what}`));
      }, ms);
      const done = (): void => {
        clearTimeout(timer);
        if (poll) clearInterval(poll);
        this.pokes.delete(check);
      };
      this.pokes.add(check);
      if (pollMs > 0) poll = setInterval(check, pollMs);
    });
  }
}

interface Frame {
  h: FrameHeader;
  payload: Buffer;
}

/** Frames a QP's requester sends (HELLO first), and what its responder sends. */
const REQUEST_TYPES: readonly number[] = [FrameType.HELLO, FrameType.SEND, FrameType.WRITE, FrameType.READ_REQ, FrameType.ATOMIC];
const isRequestFrame = (t: number): boolean => REQUEST_TYPES.includes(t);
const isResponseFrame = (t: number): boolean => !REQUEST_TYPES.includes(t);

/**
 * Parses the frames a real QP sends us (it is the well-behaved side, so a
 * parse error is a test failure), keeping those `keep` selects: the one
 * stream carries both directions, and each view sees one half of it.
 */
class FrameStream {
  private buf: Buffer = Buffer.alloc(0);
  /** Chunks not yet joined into `buf` (joined only once a whole frame is there: big payloads stay linear). */
  private parts: Buffer[] = [];
  private partsLen = 0;
  private need = HEADER_LEN;
  readonly frames: Frame[] = [];
  private read = 0;
  ended = false;
  closed = false;
  parseError: string | null = null;

  constructor(
    readonly sock: net.Socket,
    private readonly w: Waiter,
    private readonly keep: (type: number) => boolean = () => true,
  ) {
    sock.on("data", (c: Buffer) => {
      this.parts.push(c);
      this.partsLen += c.length;
      if (this.buf.length + this.partsLen < this.need) return;
      this.buf = Buffer.concat([this.buf, ...this.parts]);
      this.parts = [];
      this.partsLen = 0;
      this.parse();
      w.poke();
    });
    sock.on("end", () => {
      this.ended = true;
      w.poke();
    });
    sock.on("close", () => {
      this.closed = true;
      this.ended = true;
      w.poke();
    });
    sock.on("error", () => {});
  }

  private parse(): void {
    while (this.parseError === null && this.buf.length >= HEADER_LEN) {
      const h = newHeader();
      const err = decodeHeader(this.buf, 0, h);
      if (err !== null) {
        this.parseError = err;
        return;
      }
      if (this.buf.length < HEADER_LEN + h.payloadLen) {
        this.need = HEADER_LEN + h.payloadLen;
        return;
      }
      this.need = HEADER_LEN;
      if (this.keep(h.type)) this.frames.push({ h, payload: Buffer.from(this.buf.subarray(HEADER_LEN, HEADER_LEN + h.payloadLen)) });
      this.buf = this.buf.subarray(HEADER_LEN + h.payloadLen);
    }
  }

  /** The next unread frame. */
  async next(what: string, ms = DEADLINE_MS): Promise<Frame> {
    await this.w.until(() => this.read < this.frames.length || this.parseError !== null, what, ms);
    assert.equal(this.parseError, null, `the real QP sent a malformed frame: ${this.parseError}`);
    return this.frames[this.read++]!;
  }

  write(...parts: Uint8Array[]): void {
    for (const p of parts) this.sock.write(p);
  }
}

interface H {
  flags?: number;
  psn?: number;
  payloadLen?: number;
  rkey?: number;
  raddr?: number;
  imm?: number;
  aux?: number;
  op1?: bigint;
  op2?: bigint;
}

/** A header (copied out of the codec's arena). */
function hdr(type: number, h: H = {}): Buffer {
  return Buffer.from(
    encodeHeader(
      type as FrameType,
      h.flags ?? 0,
      h.psn ?? 0,
      h.payloadLen ?? 0,
      h.rkey ?? 0,
      h.raddr ?? 0,
      h.imm ?? 0,
      h.aux ?? 0,
      h.op1 ?? 0n,
      h.op2 ?? 0n,
    ),
  );
}

function withDeadline<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let t: NodeJS.Timeout;
  return Promise.race([
    p.finally(() => clearTimeout(t)),
    new Promise<T>((_, reject) => {
      t = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
    }),
  ]);
}

function connectRaw(port: number, w: Waiter): Promise<net.Socket> {
  return withDeadline(
    new Promise<net.Socket>((resolve, reject) => {
      const s = net.connect({ host: HOST, port, noDelay: true });
      s.once("connect", () => resolve(s));
      s.once("error", reject);
      s.on("close", () => w.poke());
    }),
    DEADLINE_MS,
    `connection to ${HOST}:${port}`,
  );
}

/** Deterministic filler so a misplaced byte shows. */
function fill(m: MemoryRegion, seed: number): void {
  const v = bytes(m);
  for (let i = 0; i < v.length; i++) v[i] = (seed + i * 7) & 0xff;
}

function snapshot(m: MemoryRegion): Uint8Array {
  return Uint8Array.from(bytes(m));
}

/** Asserts `m` equals `snap` everywhere except inside [from, to). */
function assertUnchanged(m: MemoryRegion, snap: Uint8Array, what: string, except: [number, number] = [0, 0]): void {
  const v = bytes(m);
  assert.equal(v.length, snap.length, `${what}: length changed`);
  for (let i = 0; i < v.length; i++) {
    if (i >= except[0] && i < except[1]) continue;
    if (v[i] !== snap[i]) assert.fail(`${what}: byte ${i} changed from ${snap[i]} to ${v[i]} (allowed range [${except[0]}, ${except[1]}))`);
  }
}

function statuses(wcs: WorkCompletion[]): string {
  return wcs.map((c) => `${c.wrId}:${wcStatusName(c.status)}`).join(" ");
}

async function openDevice(): Promise<Device> {
  return tcpProvider.openDevice("tcp-hostile", { host: HOST });
}

const cleanups: (() => void)[] = [];
after(() => {
  for (const c of cleanups.splice(0)) {
    try {
      c();
    } catch {
      /* best effort */
    }
  }
});

// ----------------------------------------------------------- the impostor

interface FakePeer {
  w: Waiter;
  dev: Device;
  side: Side;
  qp: QueuePair;
  events: AsyncEvent[];
  /** MRs whose bytes only the targeted range of a legitimate access may change. */
  target: MemoryRegion;
  neighbor: MemoryRegion;
  readOnly: MemoryRegion;
  /** The QP's local buffer (sources of its SENDs, landing zone of its READs). */
  local: MemoryRegion;
  recvBuf: MemoryRegion;
  snaps: Map<MemoryRegion, Uint8Array>;
  /** The QP's one stream (it dialed us), its requests as we read them; our responses go back on it. */
  inS: FrameStream;
  /** The same stream, the QP's responses as we read them; our requests go out on it. */
  outS: FrameStream;
  /** PSN of the QP's first request. */
  qPsn: number;
  /** PSN of our next request. */
  myPsn: number;
  close(): void;
}

async function openFakePeer(): Promise<FakePeer> {
  const w = new Waiter();
  const dev = await openDevice();
  const server = net.createServer({ noDelay: true });
  const sockets: net.Socket[] = [];
  let closed = false;
  const close = (): void => {
    if (closed) return;
    closed = true;
    for (const s of sockets) s.destroy();
    server.close();
    dev.close();
  };
  cleanups.push(close);
  await withDeadline(new Promise<void>((resolve) => server.listen(0, HOST, resolve)), DEADLINE_MS, "fake peer listening");
  const port = (server.address() as net.AddressInfo).port;
  const accepted = new Promise<net.Socket>((resolve) => server.once("connection", resolve));

  const side = makeSide(dev);
  const qp = side.qp;
  const events: AsyncEvent[] = [];
  qp.onEvent = (e) => {
    events.push(e);
    w.poke();
  };
  const target = side.pd.registerMr(MR_LEN, ALL_REMOTE);
  const neighbor = side.pd.registerMr(MR_LEN, ALL_REMOTE);
  const readOnly = side.pd.registerMr(MR_LEN, Access.LOCAL_WRITE | Access.REMOTE_READ);
  const local = side.pd.registerMr(MR_LEN, Access.LOCAL_WRITE);
  const recvBuf = side.pd.registerMr(MR_LEN, Access.LOCAL_WRITE);
  [target, neighbor, readOnly, local, recvBuf].forEach((m, i) => fill(m, 0x11 * (i + 1)));
  const snaps = new Map([target, neighbor, readOnly, local, recvBuf].map((m) => [m, snapshot(m)] as const));

  // The QP dials "its peer": us. Timeout 0 = no ACK timer: every outcome below comes from the hostile frame.
  qp.connect({ provider: "tcp", qpNum: FAKE_QPN, psn: FAKE_PSN, lid: 0, gid: HOST, port, mtu: 4096 }, { timeout: 0, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 });
  const reqIn = await withDeadline(accepted, DEADLINE_MS, "the QP dialing the fake peer");
  sockets.push(reqIn);
  const inS = new FrameStream(reqIn, w, isRequestFrame);
  // One stream per QP (wire version 2): we are its requester on the same stream.
  const out = reqIn;
  const outS = new FrameStream(out, w, isResponseFrame);
  const hello = await inS.next("the QP's HELLO");
  assert.equal(hello.h.type, FrameType.HELLO);
  assert.equal(hello.h.aux, FAKE_QPN, "HELLO names the destination QP in aux");
  assert.equal(Number(hello.h.op1), qp.qpNum, "HELLO names the source QP in operand1");
  assert.equal(hello.h.psn, qp.localEndpoint().psn, "HELLO carries the QP's initial PSN");

  // Zero-length WRITE as a ping (no rkey check for zero length, as in IB): the ACK proves the QP took our stream.
  out.write(hdr(FrameType.WRITE, { psn: FAKE_PSN }));
  const ack = await outS.next("ACK of the ping");
  assert.equal(ack.h.type, FrameType.ACK);
  assert.equal(ack.h.aux, Syndrome.ACK);
  assert.equal(ack.h.psn, FAKE_PSN);
  assert.equal(events.length, 0, `no events yet: ${JSON.stringify(events)}`);

  return {
    w,
    dev,
    side,
    qp,
    events,
    target,
    neighbor,
    readOnly,
    local,
    recvBuf,
    snaps,
    inS,
    outS,
    qPsn: hello.h.psn,
    myPsn: (FAKE_PSN + 1) & PSN_MASK,
    close,
  };
}

async function withFakePeer(fn: (p: FakePeer) => Promise<void>): Promise<void> {
  const p = await openFakePeer();
  try {
    await fn(p);
  } finally {
    p.close();
  }
}

/** Next request PSN of the impostor. */
function nextPsn(p: FakePeer): number {
  const x = p.myPsn;
  p.myPsn = (p.myPsn + 1) & PSN_MASK;
  return x;
}

/**
 * Makes the QP have work outstanding towards us: a signaled SEND (wrId 1) and
 * a signaled RDMA WRITE (wrId 2), both transmitted and never acknowledged,
 * and a posted receive (wrId 100).
 */
async function outstanding(p: FakePeer): Promise<void> {
  p.qp.postRecv([{ wrId: 100, sgList: [sge(p.recvBuf)] }]);
  p.qp.postSend([
    { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 100)] },
    { wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 200)], remoteAddr: 0x1000, rkey: 0x1234 },
  ]);
  const a = await p.inS.next("the QP's SEND");
  const b = await p.inS.next("the QP's WRITE");
  assert.equal(a.h.type, FrameType.SEND);
  assert.equal(a.h.psn, p.qPsn);
  assert.equal(b.h.type, FrameType.WRITE);
  assert.equal(b.h.psn, (p.qPsn + 1) & PSN_MASK);
}

async function fatal(p: FakePeer, reason: RegExp, types: string[] = ["QP_FATAL"], ms = DEADLINE_MS): Promise<AsyncEvent> {
  await p.w.until(() => p.events.length > 0, `an async event matching ${reason}`, ms);
  const e = p.events[0]!;
  assert.ok(types.includes(e.type), `event type ${e.type}, expected one of ${types.join("/")}: ${e.reason}`);
  assert.match(e.reason, reason);
  assert.equal(e.qpNum, p.qp.qpNum);
  assert.equal(p.qp.state, QpState.ERR, "the QP is in ERR");
  return e;
}

/** The send completions of wrIds 1 and 2 plus the flushed receive 100, whatever order the CQ holds them in. */
async function outstandingCompletions(p: FakePeer, first: number, second: number = WcStatus.WR_FLUSH_ERR): Promise<void> {
  const wcs = await waitCompletions(p.side, 3);
  const send = wcs.filter((c) => c.opcode !== WcOpcode.RECV);
  const recv = wcs.filter((c) => c.opcode === WcOpcode.RECV);
  assert.deepEqual(
    send.map((c) => [c.wrId, wcStatusName(c.status)]),
    [
      [1, wcStatusName(first)],
      [2, wcStatusName(second)],
    ],
    `send completions in order: ${statuses(wcs)}`,
  );
  assert.deepEqual(
    recv.map((c) => [c.wrId, wcStatusName(c.status)]),
    [[100, "WR_FLUSH_ERR"]],
    "the posted receive is flushed",
  );
}

/** No registered byte changed, except inside the allowed [from, to) range of each listed MR. */
function assertSentinels(p: FakePeer, allowed: [MemoryRegion, [number, number]][] = []): void {
  for (const [mr, snap] of p.snaps) {
    if (mr.deregistered) continue;
    const name = mr === p.target ? "target MR" : mr === p.neighbor ? "neighbor MR" : mr === p.readOnly ? "read-only MR" : mr === p.local ? "local MR" : mr === p.recvBuf ? "receive MR" : "other MR";
    assertUnchanged(mr, snap, name, allowed.find(([m]) => m === mr)?.[1] ?? [0, 0]);
  }
}

/** The QP closes both streams when it goes to ERR (the peer learns at once). */
async function streamsClosed(p: FakePeer): Promise<void> {
  await p.w.until(() => p.inS.ended && p.outS.ended, "the QP to close both streams");
}

/** Later work on an ERR QP is flushed at once. */
async function laterWorkFlushes(p: FakePeer): Promise<void> {
  p.qp.postSend([{ wrId: 3, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 8)] }]);
  p.qp.postRecv([{ wrId: 101, sgList: [sge(p.recvBuf)] }]);
  const wcs = await waitCompletions(p.side, 2);
  assert.deepEqual(wcs.map((c) => [c.wrId, wcStatusName(c.status)]).sort(), [
    [101, "WR_FLUSH_ERR"],
    [3, "WR_FLUSH_ERR"],
  ]);
}

// ------------------------------------------------------------------- tests

describe("hostile raw sockets on the device port", () => {
  it("garbage, HELLOs for unknown or wrong QPs, a non-HELLO first frame, half a header and silence leave the device and its QPs unaffected", async () => {
    const w = new Waiter();
    const dev = await openDevice();
    cleanups.push(() => dev.close());
    const port = (dev as unknown as { port: number }).port;
    try {
      // A connected pair on the same device.
      const a = makeSide(dev);
      const b = makeSide(dev);
      const events: AsyncEvent[] = [];
      a.qp.onEvent = b.qp.onEvent = (e) => events.push(e);
      const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
      a.qp.connect(b.qp.localEndpoint(), attr);
      b.qp.connect(a.qp.localEndpoint(), attr);
      await movesData(a, b, 1);

      const closedByDevice: { name: string; s: net.Socket }[] = [];
      const keptOpen: net.Socket[] = [];
      const attack = async (name: string, payload: Uint8Array | null, expectClose: boolean): Promise<void> => {
        const s = await connectRaw(port, w);
        s.on("error", () => {});
        if (payload) s.write(payload);
        if (expectClose) closedByDevice.push({ name, s });
        else keptOpen.push(s);
      };
      const garbage = Buffer.alloc(4096);
      for (let i = 0; i < garbage.length; i++) garbage[i] = (i * 131 + 17) & 0xff;
      await attack("garbage", garbage, true);
      await attack("1 MiB of zeros", Buffer.alloc(1 << 20), true);
      await attack("HELLO for an unknown QP", hdr(FrameType.HELLO, { aux: 0xfffffe, op1: 5n, psn: 1 }), true);
      await attack("HELLO with a bad version", ((h) => ((h[1] = 9), h))(hdr(FrameType.HELLO, { aux: a.qp.qpNum })), true);
      await attack("a SEND as the first frame", Buffer.concat([hdr(FrameType.SEND, { aux: a.qp.qpNum, payloadLen: 4 }), Buffer.from([1, 2, 3, 4])]), true);
      await attack("a WRITE claiming 1 GiB as the first frame", hdr(FrameType.WRITE, { payloadLen: 1 << 30, rkey: 1, raddr: 0 }), true);
      // Names a real, connected QP, but not as its peer: refused, and the QP keeps its stream.
      await attack("HELLO for A from a stranger", hdr(FrameType.HELLO, { aux: a.qp.qpNum, op1: 0x777n, psn: 5 }), true);
      await attack(
        "HELLO for A claiming to be B with the wrong PSN",
        hdr(FrameType.HELLO, { aux: a.qp.qpNum, op1: BigInt(b.qp.qpNum), psn: (b.qp.localEndpoint().psn + 1) & PSN_MASK }),
        true,
      );
      await attack("HELLO for A replaying B's credentials while B's stream is up", hdr(FrameType.HELLO, { aux: a.qp.qpNum, op1: BigInt(b.qp.qpNum), psn: b.qp.localEndpoint().psn }), true);
      await attack("HELLO, then garbage", Buffer.concat([hdr(FrameType.HELLO, { aux: 0x123 }), garbage]), true);
      // Fifty at once.
      await Promise.all(Array.from({ length: 50 }, () => attack("one of fifty garbage sockets", garbage.subarray(0, 100), true)));
      await attack("half a header", hdr(FrameType.HELLO, { aux: a.qp.qpNum }).subarray(0, 20), false);
      await attack("silence", null, false);

      await w.until(() => closedByDevice.every((c) => c.s.destroyed || c.s.closed), "the device to drop every bad connection").catch((e: Error) => {
        const open = closedByDevice.filter((c) => !c.s.closed).map((c) => c.name);
        throw new Error(`${e.message}; still open: ${[...new Set(open)].join(", ")}`);
      });

      // While the silent ones are still open, the pair moves data, and both QPs are untouched.
      await movesData(a, b, 2);
      assert.equal(a.qp.state, QpState.RTS);
      assert.equal(b.qp.state, QpState.RTS);
      assert.deepEqual(events, [], "no async events on the pair");
      // The device still accepts new QPs' connections.
      const c = makeSide(dev);
      const d = makeSide(dev);
      c.qp.connect(d.qp.localEndpoint(), attr);
      d.qp.connect(c.qp.localEndpoint(), attr);
      await movesData(c, d, 3);
      for (const s of keptOpen) s.destroy();
    } finally {
      dev.close();
    }
  });

  it(
    "a stranger's HELLO for a QP still in INIT does not evict the stream its real peer already opened",
    async () => {
      const w = new Waiter();
      const devA = await openDevice();
      const devB = await openDevice();
      cleanups.push(() => devA.close(), () => devB.close());
      try {
        const x = makeSide(devA);
        const y = makeSide(devB);
        // One stream per QP (wire version 2): A is the side that dials (dialsFirst), B waits for A's stream.
        const [a, b] = dialsFirst(endpointOf(x), endpointOf(y)) ? [x, y] : [y, x];
        const events: AsyncEvent[] = [];
        a.qp.onEvent = b.qp.onEvent = (e) => {
          events.push(e);
          w.poke();
        };
        const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
        // A connects first: its stream to B arrives while B is still in INIT and waits (parked) there.
        a.qp.connect(b.qp.localEndpoint(), attr);
        const bInternals = b.qp as unknown as { parked: { srcQp: number }[] };
        await w.until(() => bInternals.parked.some((x) => x.srcQp === a.qp.qpNum), "A's stream to be parked at B", DEADLINE_MS, 1);
        // The stranger names B (QP numbers are small and sequential: easy to guess).
        const s = await connectRaw(b.qp.localEndpoint().port, w);
        s.on("error", () => {});
        s.write(hdr(FrameType.HELLO, { aux: b.qp.qpNum, op1: 0x4242n, psn: 7 }));
        // Give the device the time to handle the stranger's HELLO while B is still in INIT: it either
        // drops it (closed), or holds it (nothing happens for a while), or (the bug) lets it evict A's stream.
        await w.until(() => s.closed || events.length > 0, "the device to handle the stranger's HELLO", 200, 1).catch(() => {});
        assert.deepEqual(events, [], "A's connection survived the stranger's HELLO");
        b.qp.connect(a.qp.localEndpoint(), attr);
        await movesData(a, b, 1);
        assert.deepEqual(events, []);
        s.destroy();
      } finally {
        devA.close();
        devB.close();
      }
    },
  );
});

/** A side's endpoint as dialsFirst compares it. */
function endpointOf(x: Side): { qpNum: number; port: number; psn: number; gid: string } {
  return x.qp.localEndpoint();
}

/** SEND, WRITE, READ and an atomic between two connected sides, checked byte for byte. */
async function movesData(a: Side, b: Side, round: number): Promise<void> {
  const src = a.pd.registerMr(256, ALL_REMOTE);
  const dst = b.pd.registerMr(256, ALL_REMOTE);
  const back = a.pd.registerMr(256, ALL_REMOTE);
  try {
    fill(src, round);
    b.qp.postRecv([{ wrId: 10 * round, sgList: [sge(dst, 0, 64)] }]);
    a.qp.postSend([
      { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 64)] },
      { wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(src, 64, 64)], remoteAddr: dst.addr + 64, rkey: dst.rkey },
      { wrId: 3, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(back, 0, 128)], remoteAddr: dst.addr, rkey: dst.rkey },
      { wrId: 4, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(back, 128, 8)], remoteAddr: dst.addr + 128, rkey: dst.rkey, compareAdd: 5n },
    ]);
    const sc = await waitCompletions(a, 4);
    assert.deepEqual(sc.map((c) => [c.wrId, wcStatusName(c.status)]), [
      [1, "SUCCESS"],
      [2, "SUCCESS"],
      [3, "SUCCESS"],
      [4, "SUCCESS"],
    ]);
    const [rc] = await waitCompletions(b, 1);
    assert.equal(rc!.status, WcStatus.SUCCESS);
    assert.deepEqual(bytes(back).subarray(0, 128), bytes(src).subarray(0, 128), "READ brings back what SEND and WRITE placed");
    assert.equal(new DataView(dst.buffer, dst.offset).getBigUint64(128, true), 5n);
  } finally {
    src.deregister();
    dst.deregister();
    back.deregister();
  }
}

describe("a hostile peer of a real QP (impostor on its one stream, both directions)", () => {
  it("control: the impostor speaks the protocol (ACK, READ_RESP, ATOMIC_RESP complete WRs; its WRITE and SEND land exactly)", () =>
    withFakePeer(async (p) => {
      p.qp.postSend([
        { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 100)] },
        { wrId: 2, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 1000, 256)], remoteAddr: 0x5000, rkey: 0x77 },
        { wrId: 3, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 2048, 8)], remoteAddr: 0x6000, rkey: 0x78, compareAdd: 1n },
      ]);
      const send = await p.inS.next("SEND");
      assert.equal(send.h.type, FrameType.SEND);
      assert.deepEqual(send.payload, Buffer.from(bytes(p.local).subarray(0, 100)));
      const read = await p.inS.next("READ_REQ");
      assert.equal(read.h.type, FrameType.READ_REQ);
      assert.equal(read.h.aux, 256);
      assert.equal(read.h.raddr, 0x5000);
      assert.equal(read.h.rkey, 0x77);
      const atomic = await p.inS.next("ATOMIC");
      assert.equal(atomic.h.type, FrameType.ATOMIC);
      assert.equal(atomic.h.aux, 1, "FADD");
      p.inS.write(hdr(FrameType.ACK, { psn: send.h.psn }));
      p.inS.write(hdr(FrameType.READ_RESP, { psn: read.h.psn, payloadLen: 256 }), Buffer.alloc(256, 0xc3));
      p.inS.write(hdr(FrameType.ATOMIC_RESP, { psn: atomic.h.psn, op1: 42n }));
      const wcs = await waitCompletions(p.side, 3);
      assert.equal(statuses(wcs), "1:SUCCESS 2:SUCCESS 3:SUCCESS");
      assert.ok(bytes(p.local).subarray(1000, 1256).every((x) => x === 0xc3));
      assert.equal(new DataView(p.local.buffer, p.local.offset).getBigUint64(2048, true), 42n);
      assertSentinels(p, [[p.local, [1000, 2056]]]);
      const localSnap = snapshot(p.local);
      p.snaps.set(p.local, localSnap);

      // Our WRITE lands exactly in range; our SEND lands in the posted receive.
      p.qp.postRecv([{ wrId: 100, sgList: [sge(p.recvBuf, 0, 64)] }]);
      const w = nextPsn(p);
      p.outS.write(hdr(FrameType.WRITE, { psn: w, payloadLen: 16, rkey: p.target.rkey, raddr: p.target.addr + 100 }), Buffer.alloc(16, 0xee));
      const s = nextPsn(p);
      p.outS.write(hdr(FrameType.SEND, { psn: s, payloadLen: 5, flags: FrameFlags.IMM, imm: 0x01020304 }), Buffer.from("hello"));
      const acks = [await p.outS.next("ACK")];
      if (acks[0]!.h.psn !== s) acks.push(await p.outS.next("ACK"));
      assert.equal(acks.at(-1)!.h.psn, s, "cumulative ACK of both requests");
      const [rc] = await waitCompletions(p.side, 1);
      assert.equal(rc!.status, WcStatus.SUCCESS);
      assert.equal(rc!.byteLen, 5);
      assert.equal(rc!.imm, 0x01020304);
      assert.equal(Buffer.from(bytes(p.recvBuf).subarray(0, 5)).toString(), "hello");
      assert.ok(bytes(p.target).subarray(100, 116).every((x) => x === 0xee));
      assertSentinels(p, [
        [p.target, [100, 116]],
        [p.recvBuf, [0, 5]],
      ]);
      assert.equal(p.qp.state, QpState.RTS);
      assert.deepEqual(p.events, []);
    }));

  it("a second HELLO impersonating the peer (right or wrong credentials) is refused; the QP keeps working", () =>
    withFakePeer(async (p) => {
      const port = (p.dev as unknown as { port: number }).port;
      for (const h of [
        { psn: FAKE_PSN, aux: p.qp.qpNum, op1: BigInt(FAKE_QPN) },
        { psn: FAKE_PSN + 1, aux: p.qp.qpNum, op1: BigInt(FAKE_QPN) },
        { psn: FAKE_PSN, aux: p.qp.qpNum, op1: BigInt(FAKE_QPN + 1) },
      ]) {
        const s = await connectRaw(port, p.w);
        s.on("error", () => {});
        s.write(hdr(FrameType.HELLO, h));
        s.write(hdr(FrameType.WRITE, { psn: h.psn, payloadLen: 8, rkey: p.target.rkey, raddr: p.target.addr }));
        s.write(Buffer.alloc(8, 0xbb));
        await p.w.until(() => s.closed, "the device to refuse the impostor's second stream");
      }
      const psn = nextPsn(p);
      p.outS.write(hdr(FrameType.WRITE, { psn, payloadLen: 8, rkey: p.target.rkey, raddr: p.target.addr + 8 }), Buffer.alloc(8, 0xcc));
      const ack = await p.outS.next("ACK on the real stream");
      assert.equal(ack.h.psn, psn);
      assert.equal(ack.h.aux, Syndrome.ACK);
      assertSentinels(p, [[p.target, [8, 16]]]);
      assert.equal(p.qp.state, QpState.RTS);
      assert.deepEqual(p.events, []);
    }));

  describe("malformed requests (to the QP's responder)", () => {
    it("truncated header, then close: QP_FATAL; the outstanding SEND fails RETRY_EXC_ERR, the rest flushes", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        p.outS.write(hdr(FrameType.WRITE, { psn: nextPsn(p), payloadLen: 8, rkey: p.target.rkey, raddr: p.target.addr }).subarray(0, 20));
        p.outS.sock.end();
        await outstandingCompletions(p, WcStatus.RETRY_EXC_ERR);
        assert.equal(p.qp.state, QpState.ERR);
        await streamsClosed(p);
        await laterWorkFlushes(p);
        assertSentinels(p);
      }));

    for (const how of ["end", "destroy"] as const) {
      it(
        `the peer closing the stream (${how}) with work outstanding raises QP_FATAL with the reason`,
        () =>
          withFakePeer(async (p) => {
            await outstanding(p);
            if (how === "end") p.inS.sock.end();
            else p.inS.sock.destroy();
            await outstandingCompletions(p, WcStatus.RETRY_EXC_ERR);
            // The event is queued before the completions are (microtask vs. notification): it is due by now.
            await fatal(p, /closed|reset|failed/, ["QP_FATAL"], 500);
          }),
      );
    }

    it("wrong wire version: QP_FATAL naming the version; outstanding work flushes", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        // Version 1 (the two-stream format) mid-stream, as a request.
        const h = hdr(FrameType.WRITE, { psn: nextPsn(p), payloadLen: 8, rkey: p.target.rkey, raddr: p.target.addr });
        h[1] = 1;
        p.outS.write(h, Buffer.alloc(8, 0xee));
        await fatal(p, /responder.*wire version 1 not supported \(this side speaks 2\)/);
        await outstandingCompletions(p, WcStatus.WR_FLUSH_ERR);
        await streamsClosed(p);
        assertSentinels(p);
      }));

    for (const [name, delta] of [
      ["ahead", 5],
      ["behind (a replay of the last request)", -1],
    ] as const) {
      it(`out-of-sequence PSN (${name}): QP_FATAL; its payload is not placed`, () =>
        withFakePeer(async (p) => {
          await outstanding(p);
          const psn = (p.myPsn + delta) & PSN_MASK;
          p.outS.write(hdr(FrameType.WRITE, { psn, payloadLen: 64, rkey: p.target.rkey, raddr: p.target.addr }), Buffer.alloc(64, 0xee));
          await fatal(p, /out of sequence/);
          await outstandingCompletions(p, WcStatus.WR_FLUSH_ERR);
          await streamsClosed(p);
          assertSentinels(p);
        }));
    }

    it("a WRITE whose payloadLen claims 1 GiB into a 4 KiB MR, then close: NAK remote access, nothing placed", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        const psn = nextPsn(p);
        p.outS.write(hdr(FrameType.WRITE, { psn, payloadLen: 1 << 30, rkey: p.target.rkey, raddr: p.target.addr }));
        p.outS.write(Buffer.alloc(64 * 1024, 0xee));
        const nak = await p.outS.next("NAK");
        assert.equal(nak.h.type, FrameType.ACK);
        assert.equal(nak.h.aux, Syndrome.NAK_REM_ACCESS);
        assert.equal(nak.h.psn, psn);
        p.outS.write(Buffer.alloc(64 * 1024, 0xee));
        p.outS.sock.end();
        await fatal(p, /remote access denied/, ["QP_FATAL", "QP_ACCESS_ERR"]);
        await outstandingCompletions(p, WcStatus.WR_FLUSH_ERR);
        await streamsClosed(p);
        assertSentinels(p);
      }));

    it("a SEND whose payloadLen claims 1 GiB into a 4 KiB receive: LOC_LEN_ERR at the receive, NAK invalid request", () =>
      withFakePeer(async (p) => {
        p.qp.postRecv([{ wrId: 100, sgList: [sge(p.recvBuf)] }]);
        const psn = nextPsn(p);
        p.outS.write(hdr(FrameType.SEND, { psn, payloadLen: 1 << 30 }), Buffer.alloc(64 * 1024, 0xee));
        const nak = await p.outS.next("NAK");
        assert.equal(nak.h.aux, Syndrome.NAK_INV_REQ);
        assert.equal(nak.h.psn, psn);
        const [rc] = await waitCompletions(p.side, 1);
        assert.equal(rc!.wrId, 100);
        assert.equal(wcStatusName(rc!.status), "LOC_LEN_ERR");
        await fatal(p, /does not fit/);
        p.outS.sock.end();
        await streamsClosed(p);
        assertSentinels(p);
      }));

    it("a WRITE that stops mid-payload (connection closed): QP_FATAL; nothing outside the targeted range changes", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        const psn = nextPsn(p);
        p.outS.write(hdr(FrameType.WRITE, { psn, payloadLen: 2048, rkey: p.target.rkey, raddr: p.target.addr + 1024 }), Buffer.alloc(1000, 0xee));
        p.outS.sock.end();
        await outstandingCompletions(p, WcStatus.RETRY_EXC_ERR);
        assert.equal(p.qp.state, QpState.ERR);
        // Only the bytes that arrived may have landed, and only inside [1024, 3072).
        assertSentinels(p, [[p.target, [1024, 2024]]]);
      }));

    // A valid header aimed outside every MR it may touch: NAK remote access, no byte modified anywhere.
    const outside: { name: string; make: (p: FakePeer) => { type: number; h: H; payload?: number }; syndrome?: number }[] = [
      { name: "WRITE with an unknown rkey", make: (p) => ({ type: FrameType.WRITE, h: { rkey: 0xdead0001, raddr: p.target.addr, payloadLen: 16 } }) },
      { name: "WRITE one byte before the MR", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.target.rkey, raddr: p.target.addr - 1, payloadLen: 16 } }) },
      { name: "WRITE straddling the MR's end", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.target.rkey, raddr: p.target.addr + MR_LEN - 8, payloadLen: 16 } }) },
      { name: "WRITE just past the MR's end", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.target.rkey, raddr: p.target.addr + MR_LEN, payloadLen: 1 } }) },
      { name: "WRITE one byte longer than the MR", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.target.rkey, raddr: p.target.addr, payloadLen: MR_LEN + 1 } }) },
      { name: "WRITE at address 2^53-16", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.target.rkey, raddr: 2 ** 53 - 16, payloadLen: 16 } }) },
      { name: "WRITE at address 0", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.target.rkey, raddr: 0, payloadLen: 16 } }) },
      { name: "WRITE to the target's address with the neighbor's rkey", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.neighbor.rkey, raddr: p.target.addr, payloadLen: 16 } }) },
      { name: "WRITE to an MR without REMOTE_WRITE", make: (p) => ({ type: FrameType.WRITE, h: { rkey: p.readOnly.rkey, raddr: p.readOnly.addr, payloadLen: 16 } }) },
      {
        name: "WRITE with the rkey of an MR in another PD",
        make: (p) => {
          const other = p.dev.allocPd().registerMr(MR_LEN, ALL_REMOTE);
          fill(other, 0x99);
          p.snaps.set(other, snapshot(other));
          return { type: FrameType.WRITE, h: { rkey: other.rkey, raddr: other.addr, payloadLen: 16 } };
        },
      },
      {
        name: "WRITE with the rkey of a deregistered MR",
        make: (p) => {
          const gone = p.side.pd.registerMr(MR_LEN, ALL_REMOTE);
          gone.deregister();
          return { type: FrameType.WRITE, h: { rkey: gone.rkey, raddr: gone.addr, payloadLen: 16 } };
        },
      },
      { name: "WRITE_WITH_IMM straddling the end", make: (p) => ({ type: FrameType.WRITE, h: { flags: FrameFlags.IMM, imm: 1, rkey: p.target.rkey, raddr: p.target.addr + MR_LEN - 1, payloadLen: 2 } }) },
      { name: "READ past the MR's end", make: (p) => ({ type: FrameType.READ_REQ, h: { rkey: p.target.rkey, raddr: p.target.addr + 1, aux: MR_LEN } }) },
      { name: "READ of 2^31 bytes", make: (p) => ({ type: FrameType.READ_REQ, h: { rkey: p.target.rkey, raddr: p.target.addr, aux: 2 ** 31 } }) },
      { name: "READ with an unknown rkey", make: (p) => ({ type: FrameType.READ_REQ, h: { rkey: 0xdead0002, raddr: p.target.addr, aux: 16 } }) },
      { name: "ATOMIC past the MR's end", make: (p) => ({ type: FrameType.ATOMIC, h: { rkey: p.target.rkey, raddr: p.target.addr + MR_LEN, aux: 1, op1: 1n } }) },
      { name: "ATOMIC on an MR without REMOTE_ATOMIC", make: (p) => ({ type: FrameType.ATOMIC, h: { rkey: p.readOnly.rkey, raddr: p.readOnly.addr, aux: 0, op1: 0n, op2: 7n } }) },
      {
        name: "ATOMIC at a misaligned address",
        make: (p) => ({ type: FrameType.ATOMIC, h: { rkey: p.target.rkey, raddr: p.target.addr + 4, aux: 1, op1: 1n } }),
        syndrome: Syndrome.NAK_INV_REQ,
      },
    ];
    for (const c of outside) {
      it(`${c.name}: NAK, QP to ERR, no registered byte modified`, () =>
        withFakePeer(async (p) => {
          await outstanding(p);
          const { type, h } = c.make(p);
          const psn = nextPsn(p);
          p.outS.write(hdr(type, { ...h, psn }));
          if (h.payloadLen) p.outS.write(Buffer.alloc(h.payloadLen, 0xee));
          const nak = await p.outS.next("NAK");
          assert.equal(nak.h.type, FrameType.ACK, "no data comes back, only a NAK");
          assert.equal(nak.h.payloadLen, 0);
          assert.equal(nak.h.aux, c.syndrome ?? Syndrome.NAK_REM_ACCESS);
          assert.equal(nak.h.psn, psn);
          await fatal(p, c.syndrome === Syndrome.NAK_INV_REQ ? /aligned/ : /remote access denied/, ["QP_FATAL", "QP_ACCESS_ERR"]);
          await outstandingCompletions(p, WcStatus.WR_FLUSH_ERR);
          await streamsClosed(p);
          // Whatever else arrived on the stream was not a response frame.
          assert.ok(p.outS.frames.slice(1).every((f) => f.h.type === FrameType.ACK && f.payload.length === 0));
          assertSentinels(p);
        }));
    }

    it(
      "deregistering the MR a peer is writing into, mid-frame: no crash, and no byte lands after deregister returns (caller-owned memory)",
      () =>
        withFakePeer(async (p) => {
          const ab = new ArrayBuffer(MR_LEN);
          const mine = p.side.pd.registerMr(ab, ALL_REMOTE);
          const v = new Uint8Array(ab);
          v.fill(0x55);
          const psn = nextPsn(p);
          p.outS.write(hdr(FrameType.WRITE, { psn, payloadLen: MR_LEN, rkey: mine.rkey, raddr: mine.addr }), Buffer.alloc(1000, 0xee));
          await p.w.until(() => v[999] === 0xee, "the first 1000 bytes to land", DEADLINE_MS, 1);
          mine.deregister();
          p.outS.write(Buffer.alloc(MR_LEN - 1000, 0xee));
          // The rest of the frame is either discarded or the QP goes to ERR (NAK remote access); wait for whichever comes.
          const psn2 = nextPsn(p);
          p.outS.write(hdr(FrameType.WRITE, { psn: psn2, payloadLen: 0 }));
          await p.w.until(() => p.outS.frames.length > 1 || p.events.length > 0, "a response or an event");
          assert.ok(
            v.subarray(1000).every((x) => x === 0x55),
            `bytes landed in deregistered memory: ${v.subarray(1000).filter((x) => x === 0xee).length} of ${MR_LEN - 1000}`,
          );
          assertSentinels(p);
        }),
    );

    it(
      "deregistering the MR a peer is writing into, after part of a large payload was read straight into it (direct reads): no byte lands after deregister returns",
      () =>
        withFakePeer(async (p) => {
          const LEN = 1 << 20;
          const FIRST = 600 * 1024;
          const ab = new ArrayBuffer(LEN);
          const mine = p.side.pd.registerMr(ab, ALL_REMOTE);
          const v = new Uint8Array(ab);
          v.fill(0x55);
          const psn = nextPsn(p);
          const reads = directStats.reads;
          p.outS.write(hdr(FrameType.WRITE, { psn, payloadLen: LEN, rkey: mine.rkey, raddr: mine.addr }), Buffer.alloc(FIRST, 0xee));
          await p.w.until(() => v[FIRST - 1] === 0xee, "the first part to land", DEADLINE_MS, 1);
          // The fake peer's bytes were all in the kernel before the first read: it filled the read buffer.
          assert.ok(directStats.reads > reads, `part of the payload was read straight into the MR: ${JSON.stringify(directStats)}`);
          mine.deregister();
          p.outS.write(Buffer.alloc(LEN - FIRST, 0xee));
          const psn2 = nextPsn(p);
          p.outS.write(hdr(FrameType.WRITE, { psn: psn2, payloadLen: 0 }));
          await p.w.until(() => p.outS.frames.length > 1 || p.events.length > 0, "a response or an event");
          assert.ok(v.subarray(0, FIRST).every((x) => x === 0xee), "the first part landed whole");
          assert.ok(
            v.subarray(FIRST).every((x) => x === 0x55),
            `bytes landed in deregistered memory: ${v.subarray(FIRST).filter((x) => x === 0xee).length} of ${LEN - FIRST}`,
          );
          assertSentinels(p);
        }),
    );

    it("a read that did not fill the read buffer is not followed by a direct read (nothing more is waiting)", () =>
      withFakePeer(async (p) => {
        const LEN = 1 << 20;
        const ab = new ArrayBuffer(LEN);
        const mine = p.side.pd.registerMr(ab, ALL_REMOTE);
        const v = new Uint8Array(ab);
        const attempts = directStats.attempts;
        p.outS.write(hdr(FrameType.WRITE, { psn: nextPsn(p), payloadLen: LEN, rkey: mine.rkey, raddr: mine.addr }), Buffer.alloc(1000, 0xee));
        await p.w.until(() => v[999] === 0xee, "the first 1000 bytes to land", DEADLINE_MS, 1);
        assert.equal(directStats.attempts, attempts, "no direct read was tried after a short read");
        assertSentinels(p);
      }));

    it(
      "deregistering the (provider-allocated) MR a peer is writing into, mid-frame, does not crash the process",
      () =>
        withFakePeer(async (p) => {
          const m = p.side.pd.registerMr(MR_LEN, ALL_REMOTE);
          const v = bytes(m);
          const psn = nextPsn(p);
          p.outS.write(hdr(FrameType.WRITE, { psn, payloadLen: MR_LEN, rkey: m.rkey, raddr: m.addr }), Buffer.alloc(1000, 0xee));
          await p.w.until(() => v[999] === 0xee, "the first 1000 bytes to land", DEADLINE_MS, 1);
          m.deregister();
          const uncaught: Error[] = [];
          const onUncaught = (e: Error): void => {
            uncaught.push(e);
            p.w.poke();
          };
          process.on("uncaughtException", onUncaught);
          try {
            p.outS.write(Buffer.alloc(MR_LEN - 1000, 0xee));
            const psn2 = nextPsn(p);
            p.outS.write(hdr(FrameType.WRITE, { psn: psn2, payloadLen: 0 }));
            await p.w.until(() => uncaught.length > 0 || p.outS.frames.length > 1 || p.events.length > 0, "a response, an event or a crash");
          } finally {
            process.off("uncaughtException", onUncaught);
          }
          assert.deepEqual(uncaught.map((e) => e.message), [], "the process would have crashed");
          assertSentinels(p);
        }),
    );
  });

  /**
   * The impostor READs `size` bytes of 0xab through `rkey`/`addr` and stops reading its stream, so
   * the response backs up in the responder's socket queue; `whileQueued` runs then (deregisters);
   * the garbage collector frees what was released and the memory is reused; then the impostor
   * reads on: every byte it gets must be 0xab and the response whole.
   */
  async function readBackedUp(p: FakePeer, rkey: number, addr: number, size: number, whileQueued: () => void): Promise<void> {
    p.outS.sock.pause();
    let seen = 0;
    let payload = 0;
    let foreign = 0;
    p.outS.sock.on("data", (c: Buffer) => {
      for (let i = 0; i < c.length; i++, seen++) {
        if (seen < HEADER_LEN) continue;
        payload++;
        if (c[i] !== 0xab) foreign++;
      }
      p.w.poke();
    });
    p.outS.sock.write(hdr(FrameType.READ_REQ, { psn: nextPsn(p), rkey, raddr: addr, aux: size }));
    const resp = p.qp as unknown as { sock: net.Socket | null };
    await p.w.until(() => (resp.sock?.writableLength ?? 0) > 0, "the READ response to back up in the responder's socket", DEADLINE_MS, 1);
    whileQueued();
    v8.setFlagsFromString("--expose-gc");
    const gc = vm.runInNewContext("gc") as () => void;
    gc();
    gc();
    const churn: Uint8Array[] = [];
    for (let i = 0; i < 8; i++) churn.push(new Uint8Array(size / 8).fill(0x11));
    p.outS.sock.resume();
    await p.w.until(() => payload >= size || p.outS.closed, "the whole READ response or the stream's end", DEADLINE_MS * 2);
    assert.equal(foreign, 0, `${foreign} bytes of the READ response were not the registered bytes (freed or recycled memory sent to the peer)`);
    assert.equal(payload, size, `the READ response was cut after ${payload} of ${size} bytes`);
    assert.ok(churn.length > 0);
  }

  it("a READ response still queued when its MR is deregistered: the peer gets exactly the MR's bytes, never freed memory", () =>
    withFakePeer(async (p) => {
      const SIZE = 16 << 20;
      const m = p.side.pd.registerMr(SIZE, ALL_REMOTE);
      bytes(m).fill(0xab);
      await readBackedUp(p, m.rkey, m.addr, SIZE, () => m.deregister());
    }));

  it("a READ response through a grant over part of a buffer, still queued when the grant and then the buffer's owner are deregistered: the peer gets exactly the granted bytes", () =>
    withFakePeer(async (p) => {
      // The agent's shape: an owner registration (allocLocalMr) and a second registration over
      // part of it (a grant or share) that the peer READs through.
      const SIZE = 16 << 20;
      const OFF = 4096;
      const owner = p.side.pd.registerMr(SIZE + 2 * OFF, Access.LOCAL_WRITE);
      bytes(owner).fill(0x55);
      bytes(owner).fill(0xab, OFF, OFF + SIZE);
      const grant = p.side.pd.registerMr((owner as unknown as { buffer: ArrayBuffer }).buffer, Access.LOCAL_WRITE | Access.REMOTE_READ, OFF, SIZE);
      await readBackedUp(p, grant.rkey, grant.addr, SIZE, () => {
        // The owner may not recycle the bytes under the queued write either.
        assert.equal((owner as unknown as { renewBuffer(): boolean }).renewBuffer(), false, "the owner renewed (recycled) its buffer under a queued READ response");
        grant.deregister();
        owner.deregister();
      });
    }));

  it(
    "setError() with a big WRITE still queued, then deregister its source MR: no freed memory is read (EFAULT) or sent to the peer",
    () =>
      withFakePeer(async (p) => {
        const SIZE = 16 << 20;
        const m = p.side.pd.registerMr(SIZE, ALL_REMOTE);
        bytes(m).fill(0xab);
        // We (the peer) stop reading the QP's requests: its WRITE backs up into its socket queue.
        p.inS.sock.pause();
        let seen = 0;
        let payload = 0;
        let foreign = 0;
        p.inS.sock.on("data", (c: Buffer) => {
          for (let i = 0; i < c.length; i++, seen++) {
            if (seen < HEADER_LEN) continue;
            payload++;
            if (c[i] !== 0xab) foreign++;
          }
          p.w.poke();
        });
        p.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(m)], remoteAddr: 0x10000, rkey: 0x42 }]);
        const req = p.qp as unknown as { sock: net.Socket | null };
        const sockErrors: string[] = [];
        req.sock!.on("error", (e: NodeJS.ErrnoException) => {
          sockErrors.push(e.code ?? e.message);
          p.w.poke();
        });
        await p.w.until(() => (req.sock?.writableLength ?? 0) > 0, "the WRITE to back up in the requester's socket", DEADLINE_MS, 1);
        p.qp.setError();
        const [wc] = await waitCompletions(p.side, 1);
        assert.equal(wcStatusName(wc!.status), "WR_FLUSH_ERR");
        // The WR is complete: verbs lets the application free its buffer now.
        m.deregister();
        v8.setFlagsFromString("--expose-gc");
        const gc = vm.runInNewContext("gc") as () => void;
        gc();
        gc();
        const churn: Uint8Array[] = [];
        for (let i = 0; i < 8; i++) churn.push(new Uint8Array(SIZE / 8).fill(0x11));
        p.inS.sock.resume();
        await p.w.until(() => payload >= SIZE || p.inS.closed, "the rest of the WRITE or the stream's end", DEADLINE_MS * 2);
        assert.deepEqual(sockErrors, [], "the requester's socket read freed memory");
        assert.equal(foreign, 0, `${foreign} bytes sent to the peer were not the MR's bytes (freed memory)`);
        assert.ok(churn.length > 0);
      }),
  );

  describe("malformed responses (to the QP's requester)", () => {
    it("truncated response header, then close: RETRY_EXC_ERR, the rest flushes", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        p.inS.write(hdr(FrameType.ACK, { psn: p.qPsn }).subarray(0, 30));
        p.inS.sock.end();
        await outstandingCompletions(p, WcStatus.RETRY_EXC_ERR);
        assert.equal(p.qp.state, QpState.ERR);
        await streamsClosed(p);
        assertSentinels(p);
      }));

    it("wrong wire version: BAD_RESP_ERR, the rest flushes, QP_FATAL naming the version", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        const h = hdr(FrameType.ACK, { psn: p.qPsn });
        h[1] = 0;
        p.inS.write(h);
        await fatal(p, /requester.*wire version 0/);
        await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
        await streamsClosed(p);
        assertSentinels(p);
      }));

    it("an ACK with an unknown syndrome: BAD_RESP_ERR", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        p.inS.write(hdr(FrameType.ACK, { psn: p.qPsn, aux: 9 }));
        await fatal(p, /unknown ACK syndrome 9/);
        await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
      }));

    it("a HELLO after the stream's first frame (issue 21 point 2: one stream, HELLO only first): QP_FATAL, the rest flushes", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        p.inS.write(hdr(FrameType.HELLO, { psn: FAKE_PSN, aux: p.qp.qpNum, op1: BigInt(FAKE_QPN) }));
        await fatal(p, /unexpected frame type 1 \(HELLO\)/);
        await outstandingCompletions(p, WcStatus.WR_FLUSH_ERR);
        await streamsClosed(p);
        assertSentinels(p);
      }));

    const notOutstanding: { name: string; frame: (p: FakePeer) => Buffer[]; reason: RegExp }[] = [
      {
        name: "a READ_RESP for an old PSN",
        frame: (p) => [hdr(FrameType.READ_RESP, { psn: (p.qPsn - 1) & PSN_MASK, payloadLen: 100 }), Buffer.alloc(100, 0xee)],
        reason: /matches no outstanding request/,
      },
      {
        name: "a READ_RESP for the SEND's PSN (no READ outstanding)",
        frame: (p) => [hdr(FrameType.READ_RESP, { psn: p.qPsn, payloadLen: 100 }), Buffer.alloc(100, 0xee)],
        reason: /matches no outstanding request/,
      },
      { name: "an ATOMIC_RESP for the SEND's PSN", frame: (p) => [hdr(FrameType.ATOMIC_RESP, { psn: p.qPsn, op1: 5n })], reason: /matches no outstanding request/ },
      { name: "a NAK for an old PSN", frame: (p) => [hdr(FrameType.ACK, { psn: (p.qPsn - 3) & PSN_MASK, aux: Syndrome.NAK_REM_ACCESS })], reason: /not outstanding/ },
      { name: "an RNR NAK for an old PSN", frame: (p) => [hdr(FrameType.ACK, { psn: (p.qPsn - 3) & PSN_MASK, aux: Syndrome.RNR_NAK, op2: 1n })], reason: /not outstanding/ },
    ];
    for (const c of notOutstanding) {
      it(`${c.name}: BAD_RESP_ERR, nothing placed`, () =>
        withFakePeer(async (p) => {
          await outstanding(p);
          p.inS.write(...c.frame(p));
          await fatal(p, c.reason);
          await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
          await streamsClosed(p);
          assertSentinels(p);
        }));
    }

    /** The QP issues a 256-byte READ (wrId 1) into local[1024, 1280) and a SEND (wrId 2). */
    async function outstandingRead(p: FakePeer): Promise<Frame> {
      p.qp.postRecv([{ wrId: 100, sgList: [sge(p.recvBuf)] }]);
      p.qp.postSend([
        { wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 1024, 256)], remoteAddr: 0x9000, rkey: 0x99 },
        { wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 16)] },
      ]);
      const r = await p.inS.next("READ_REQ");
      assert.equal(r.h.type, FrameType.READ_REQ);
      assert.equal(r.h.aux, 256);
      await p.inS.next("SEND");
      return r;
    }

    for (const len of [100, 255, 257, 512]) {
      it(`a READ_RESP of ${len} bytes for a 256-byte READ: BAD_RESP_ERR, nothing placed`, () =>
        withFakePeer(async (p) => {
          const r = await outstandingRead(p);
          p.inS.write(hdr(FrameType.READ_RESP, { psn: r.h.psn, payloadLen: len }), Buffer.alloc(len, 0xee));
          await fatal(p, new RegExp(`read response of ${len} bytes for a 256-byte read`));
          await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
          assertSentinels(p);
        }));
    }

    it("a READ_RESP claiming 1 GiB, then close: BAD_RESP_ERR, nothing placed", () =>
      withFakePeer(async (p) => {
        const r = await outstandingRead(p);
        p.inS.write(hdr(FrameType.READ_RESP, { psn: r.h.psn, payloadLen: 1 << 30 }), Buffer.alloc(64 * 1024, 0xee));
        p.inS.sock.end();
        await fatal(p, /read response of 1073741824 bytes/);
        await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
        assertSentinels(p);
      }));

    it("a READ_RESP cut off mid-payload (close): RETRY_EXC_ERR; only the READ's own landing zone may change", () =>
      withFakePeer(async (p) => {
        const r = await outstandingRead(p);
        p.inS.write(hdr(FrameType.READ_RESP, { psn: r.h.psn, payloadLen: 256 }), Buffer.alloc(100, 0xee));
        p.inS.sock.end();
        await outstandingCompletions(p, WcStatus.RETRY_EXC_ERR);
        assert.equal(p.qp.state, QpState.ERR);
        assertSentinels(p, [[p.local, [1024, 1124]]]);
      }));

    it("an ACK that skips a READ's response: BAD_RESP_ERR", () =>
      withFakePeer(async (p) => {
        const r = await outstandingRead(p);
        // ACK for the SEND after the READ, without the READ_RESP: the READ's data never came.
        p.inS.write(hdr(FrameType.ACK, { psn: (r.h.psn + 1) & PSN_MASK }));
        await fatal(p, /skips the response/);
        await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
        assertSentinels(p);
      }));
  });

  describe("piggybacked ACKs (flag ACK on the impostor's requests)", () => {
    const stats = (p: FakePeer) => (p.qp as unknown as TcpQueuePair).stats;
    /** A zero-length WRITE from the impostor (no rkey check for zero length), carrying `ack` as a piggybacked ACK. */
    const ackingWrite = (p: FakePeer, ack: number): Buffer => hdr(FrameType.WRITE, { psn: nextPsn(p), flags: FrameFlags.ACK, op2: BigInt(ack) });

    it("a standalone ACK for a PSN never sent: BAD_RESP_ERR, QP_FATAL naming it", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        // The QP sent qPsn and qPsn+1: qPsn+2 is the first PSN it never sent.
        p.inS.write(hdr(FrameType.ACK, { psn: (p.qPsn + 2) & PSN_MASK }));
        await fatal(p, /for the requester: ACK for PSN \d+, which was never sent/);
        await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
        await streamsClosed(p);
        assertSentinels(p);
      }));

    for (const [name, delta] of [
      ["the first PSN never sent", 2],
      ["half the PSN space ahead", 0x800000],
    ] as const) {
      it(`a piggybacked ACK for ${name}: BAD_RESP_ERR, QP_FATAL naming it, no crash`, () =>
        withFakePeer(async (p) => {
          await outstanding(p);
          p.outS.write(ackingWrite(p, (p.qPsn + delta) & PSN_MASK));
          await fatal(p, /for the responder: piggybacked ACK for PSN \d+, which was never sent/);
          await outstandingCompletions(p, WcStatus.BAD_RESP_ERR);
          await streamsClosed(p);
          assertSentinels(p);
        }));
    }

    it("the ACK flag on an ATOMIC (operand2 is its swap value): QP_FATAL, the atomic is not executed", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        p.outS.write(hdr(FrameType.ATOMIC, { psn: nextPsn(p), flags: FrameFlags.ACK, rkey: p.target.rkey, raddr: p.target.addr, aux: 0, op1: 0n, op2: BigInt(p.qPsn) }));
        await fatal(p, /responder.*ACK flag on frame type 5/);
        await outstandingCompletions(p, WcStatus.WR_FLUSH_ERR);
        await streamsClosed(p);
        assertSentinels(p);
      }));

    it("a piggybacked ACK completes the QP's SEND and WRITE like a standalone ACK (old ones are ignored)", () =>
      withFakePeer(async (p) => {
        await outstanding(p);
        p.outS.write(ackingWrite(p, (p.qPsn - 5) & PSN_MASK));
        p.outS.write(ackingWrite(p, p.qPsn));
        const [a] = await waitCompletions(p.side, 1);
        assert.equal(statuses([a!]), "1:SUCCESS");
        p.outS.write(ackingWrite(p, (p.qPsn - 1) & PSN_MASK));
        p.outS.write(ackingWrite(p, (p.qPsn + 1) & PSN_MASK));
        const [b] = await waitCompletions(p.side, 1);
        assert.equal(statuses([b!]), "2:SUCCESS");
        // The QP had nothing to send back: its ACK for our four WRITEs comes alone, cumulative.
        let ack = await p.outS.next("the QP's ACK");
        while (ack.h.psn !== ((p.myPsn - 1) & PSN_MASK)) ack = await p.outS.next("the QP's cumulative ACK");
        assert.equal(ack.h.type, FrameType.ACK);
        assert.equal(stats(p).piggybackedAcksReceived, 4);
        assert.equal(p.qp.state, QpState.RTS);
        assert.deepEqual(p.events, []);
        assertSentinels(p);
      }));

    /** READ (wrId 1, 256 B into local[1024, 1280)), SEND (2), FADD (3, into local[2048, 2056)), SEND (4): the request frames. */
    async function readAtomicMix(p: FakePeer): Promise<Frame[]> {
      p.qp.postSend([
        { wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 1024, 256)], remoteAddr: 0x9000, rkey: 0x99 },
        { wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 16)] },
        { wrId: 3, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 2048, 8)], remoteAddr: 0xa000, rkey: 0x9a, compareAdd: 1n },
        { wrId: 4, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 16, 16)] },
      ]);
      const frames: Frame[] = [];
      for (const t of [FrameType.READ_REQ, FrameType.SEND, FrameType.ATOMIC, FrameType.SEND]) {
        const f = await p.inS.next(`request of type ${t}`);
        assert.equal(f.h.type, t);
        frames.push(f);
      }
      return frames;
    }

    it("a piggybacked ACK that overtakes a READ_RESP and an ATOMIC_RESP: nothing completes past them until each arrives, then all in order", () =>
      withFakePeer(async (p) => {
        const [read, , atomic, last] = await readAtomicMix(p);
        // Acknowledges everything, though neither response has been sent: it overtook them.
        const w = p.myPsn;
        p.outS.write(ackingWrite(p, last!.h.psn));
        // The QP's ACK for our WRITE is written after the piggybacked ACK was applied.
        const ack = await p.outS.next("the QP's ACK of our WRITE");
        assert.equal(ack.h.psn, w);
        assert.equal(stats(p).piggybackedAcksReceived, 1);
        assert.equal(p.side.cq.poll(p.side.buf), 0, "nothing completes before the READ's data is in");
        assert.equal(p.qp.state, QpState.RTS, `no protocol error: ${JSON.stringify(p.events)}`);

        p.inS.write(hdr(FrameType.READ_RESP, { psn: read!.h.psn, payloadLen: 256 }), Buffer.alloc(256, 0xc3));
        const first = await waitCompletions(p.side, 2);
        assert.equal(statuses(first), "1:SUCCESS 2:SUCCESS", "the READ, then the SEND the earlier piggybacked ACK covered");
        assert.ok(bytes(p.local).subarray(1024, 1280).every((x) => x === 0xc3));
        assert.equal(p.side.cq.poll(p.side.buf), 0, "the SEND after the atomic waits for the atomic's response");

        p.inS.write(hdr(FrameType.ATOMIC_RESP, { psn: atomic!.h.psn, op1: 41n }));
        const second = await waitCompletions(p.side, 2);
        assert.equal(statuses(second), "3:SUCCESS 4:SUCCESS");
        assert.equal(new DataView(p.local.buffer, p.local.offset).getBigUint64(2048, true), 41n);
        assert.equal(p.qp.state, QpState.RTS);
        assert.deepEqual(p.events, []);
        assertSentinels(p, [[p.local, [1024, 2056]]]);
      }));

    it("a READ_RESP that arrives before the piggybacked ACK covering it: the later ACK completes the rest", () =>
      withFakePeer(async (p) => {
        const [read, send, atomic, last] = await readAtomicMix(p);
        p.inS.write(hdr(FrameType.READ_RESP, { psn: read!.h.psn, payloadLen: 256 }), Buffer.alloc(256, 0x3c));
        assert.equal(statuses(await waitCompletions(p.side, 1)), "1:SUCCESS");
        p.outS.write(ackingWrite(p, send!.h.psn));
        assert.equal(statuses(await waitCompletions(p.side, 1)), "2:SUCCESS");
        p.inS.write(hdr(FrameType.ATOMIC_RESP, { psn: atomic!.h.psn, op1: 7n }));
        assert.equal(statuses(await waitCompletions(p.side, 1)), "3:SUCCESS");
        p.outS.write(ackingWrite(p, last!.h.psn));
        assert.equal(statuses(await waitCompletions(p.side, 1)), "4:SUCCESS");
        assert.deepEqual(p.events, []);
      }));

    it("a piggybacked ACK on a request the QP discards (while its RNR NAK is pending) still completes the QP's work", () =>
      withFakePeer(async (p) => {
        // No receive posted: our SEND gets an RNR NAK, and the QP discards what follows until we resend it.
        const s1 = nextPsn(p);
        p.outS.write(hdr(FrameType.SEND, { psn: s1, payloadLen: 4 }), Buffer.alloc(4, 0xee));
        const nak = await p.outS.next("RNR NAK");
        assert.equal(nak.h.aux, Syndrome.RNR_NAK);
        assert.equal(nak.h.psn, s1);
        p.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 8)] }]);
        const send = await p.inS.next("the QP's SEND");
        // A request the QP must discard (it is not the NAKed PSN), carrying the ACK for the QP's SEND.
        p.outS.write(hdr(FrameType.SEND, { psn: nextPsn(p), payloadLen: 4, flags: FrameFlags.ACK, op2: BigInt(send.h.psn) }), Buffer.alloc(4, 0xee));
        const [wc] = await waitCompletions(p.side, 1);
        assert.equal(statuses([wc!]), "1:SUCCESS");
        assert.equal(p.qp.state, QpState.RTS);
        assertSentinels(p);
      }));

    it("the ACK the QP owes is sent alone when its next request cannot go out (waiting out an RNR timer)", () =>
      withFakePeer(async (p) => {
        p.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 0, 8)] }]);
        const send = await p.inS.next("the QP's SEND");
        // RNR timer code 0 = 655 ms: the QP holds its send queue that long.
        p.inS.write(hdr(FrameType.ACK, { psn: send.h.psn, aux: Syndrome.RNR_NAK, op2: 0n }));
        await p.w.until(() => (p.qp as unknown as { rnrWait: unknown }).rnrWait !== null, "the QP to wait out the RNR timer", DEADLINE_MS, 1);
        // Our WRITE_WITH_IMM completes a receive; the QP answers with a SEND in the same event-loop turn (before
        // the turn's standalone ACK would go out), but the SEND cannot go out yet: the ACK must not ride on it.
        p.qp.postRecv([{ wrId: 100, sgList: [sge(p.recvBuf, 0, 8)] }]);
        const w = nextPsn(p);
        p.outS.write(hdr(FrameType.WRITE, { psn: w, flags: FrameFlags.IMM, imm: 5, payloadLen: 8, rkey: p.target.rkey, raddr: p.target.addr }), Buffer.alloc(8, 0xee));
        const [rc] = await waitCompletions(p.side, 1);
        p.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.local, 8, 8)] }]);
        assert.equal(rc!.wrId, 100);
        assert.equal(stats(p).acks, 1, "only the ping's ACK has gone out so far (the new one is still owed)");
        const ack = await p.outS.next("the QP's standalone ACK of our WRITE");
        assert.equal(ack.h.type, FrameType.ACK);
        assert.equal(ack.h.aux, Syndrome.ACK);
        assert.equal(ack.h.psn, w);
        assert.equal(p.qp.state, QpState.RTS);
        // The resent SEND and the queued one follow after the timer, without an ACK to carry.
        const again = await p.inS.next("the resent SEND");
        const next = await p.inS.next("the queued SEND");
        assert.equal(again.h.psn, send.h.psn);
        assert.equal(again.h.flags & FrameFlags.ACK, 0);
        assert.equal(next.h.flags & FrameFlags.ACK, 0);
        assertSentinels(p, [[p.target, [0, 8]]]);
      }));
  });
});

/**
 * Issue 9, point 9: the responder enforces maxDestRdAtomic and does not read a
 * peer's requests while its responses pile up unread.
 */
describe("responder resources and back-pressure [issue 9 #9]", () => {
  /** Samples how many response bytes the QP keeps queued in user space (its response stream's writableLength). */
  function queuedSampler(qp: QueuePair): { max(): number; stop(): void } {
    const qpi = qp as unknown as { sock: net.Socket | null };
    let max = 0;
    const t = setInterval(() => (max = Math.max(max, qpi.sock?.writableLength ?? 0)), 1);
    return { max: () => max, stop: () => clearInterval(t) };
  }

  /** Writes `n` request frames made by `make`, in batches, without waiting for anything. */
  function flood(p: FakePeer, n: number, make: (psn: number) => Buffer): void {
    for (let i = 0; i < n; i += 2000) {
      const parts: Buffer[] = [];
      for (let k = 0; k < 2000 && i + k < n; k++) parts.push(make(nextPsn(p)));
      p.outS.sock.write(Buffer.concat(parts));
    }
  }

  for (const kind of ["atomics", "READs"] as const) {
    it(`a flood of ${kind} whose responses are never read: NAK invalid request past maxDestRdAtomic, queued responses stay bounded, other QPs keep working`, () =>
      withFakePeer(async (p) => {
        // The impostor never reads the QP's responses.
        p.outS.sock.pause();
        const sampler = queuedSampler(p.qp);
        try {
          if (kind === "atomics") flood(p, 600_000, (psn) => hdr(FrameType.ATOMIC, { psn, rkey: p.target.rkey, raddr: p.target.addr, aux: 1, op1: 1n }));
          else flood(p, 20_000, (psn) => hdr(FrameType.READ_REQ, { psn, rkey: p.target.rkey, raddr: p.target.addr, aux: MR_LEN }));
          const e = await fatal(p, /maxDestRdAtomic 16/, ["QP_FATAL"], DEADLINE_MS * 3);
          assert.match(e.reason, /more RDMA READ\/atomic requests outstanding than maxDestRdAtomic 16/);
        } finally {
          sampler.stop();
        }
        // Bounded: the kernel's socket buffers take most of it; user space holds at most about one pause threshold
        // (1 MiB) plus what one received chunk produced.
        assert.ok(sampler.max() <= 2 * 1024 * 1024, `the QP queued up to ${sampler.max()} response bytes`);
        // The QP gives up on the stream after its linger even though the impostor never reads.
        const qpi = p.qp as unknown as { sock: net.Socket | null };
        await p.w.until(() => qpi.sock?.destroyed === true, "the QP to destroy the unread stream", DEADLINE_MS * 2, 5);
        // Other QPs on the device are untouched.
        const a = makeSide(p.dev);
        const b = makeSide(p.dev);
        const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
        a.qp.connect(b.qp.localEndpoint(), attr);
        b.qp.connect(a.qp.localEndpoint(), attr);
        await movesData(a, b, 7);
      }),
    );
  }

  it("responses not read: the QP stops reading requests (back-pressure), and resumes once the peer reads, losing nothing", () =>
    withFakePeer(async (p) => {
      const big = p.side.pd.registerMr(4 * 1024 * 1024, ALL_REMOTE);
      fill(big, 0x5a);
      p.outS.sock.pause();
      const qpi = p.qp as unknown as { stats: { requestPauses: number }; sock: net.Socket };
      // 16 READs of 4 MiB (within maxDestRdAtomic): 64 MiB of responses the impostor does not read yet.
      const readPsns: number[] = [];
      for (let i = 0; i < 16; i++) {
        const psn = nextPsn(p);
        readPsns.push(psn);
        p.outS.write(hdr(FrameType.READ_REQ, { psn, rkey: big.rkey, raddr: big.addr, aux: big.length }));
      }
      await p.w.until(() => qpi.stats.requestPauses >= 1, "the QP to pause the request stream", DEADLINE_MS, 1);
      assert.equal(qpi.sock.isPaused(), true);
      // A WRITE sent now waits in the stream until the QP reads again.
      const wpsn = nextPsn(p);
      p.outS.write(hdr(FrameType.WRITE, { psn: wpsn, rkey: p.target.rkey, raddr: p.target.addr, payloadLen: 8 }), Buffer.from([1, 2, 3, 4, 5, 6, 7, 8]));
      p.outS.sock.resume();
      for (const psn of readPsns) {
        const f = await p.outS.next(`READ_RESP ${psn}`, DEADLINE_MS * 2);
        assert.equal(f.h.type, FrameType.READ_RESP);
        assert.equal(f.h.psn, psn);
        assert.ok(f.payload.equals(Buffer.from(bytes(big))), "the READ brought the MR's bytes");
      }
      // Acknowledged (possibly after progress ACKs that repeat an earlier PSN).
      for (;;) {
        const f = await p.outS.next("the WRITE's ACK");
        assert.equal(f.h.type, FrameType.ACK);
        assert.equal(f.h.aux, Syndrome.ACK);
        if (f.h.psn === wpsn) break;
      }
      assert.deepEqual([...bytes(p.target).subarray(0, 8)], [1, 2, 3, 4, 5, 6, 7, 8]);
      assert.equal(qpi.sock.isPaused(), false, "reading again");
      assert.deepEqual(p.events, []);
      assert.equal(p.qp.state, QpState.RTS);
    }));

  /**
   * The responder's count of outstanding READ responses must not depend on when
   * Node runs a write's callback: libuv can run it an event-loop iteration after
   * the kernel took the bytes (CI's two-hosts run refused a requester within its
   * limit that way). Here the responder's write callbacks are held until the end,
   * the latest they could ever run: a requester that keeps exactly
   * maxDestRdAtomic READs outstanding, posting the next one as each completes,
   * is never refused.
   */
  it("issue 21: a requester keeping exactly maxDestRdAtomic READs outstanding is never refused, however late the responder's write callbacks run", async () => {
    const devA = await openDevice();
    const devB = await openDevice();
    cleanups.push(() => devA.close(), () => devB.close());
    try {
      const a = makeSide(devA);
      const b = makeSide(devB);
      const events: AsyncEvent[] = [];
      a.qp.onEvent = (e) => events.push(e);
      b.qp.onEvent = (e) => events.push(e);
      const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
      a.qp.connect(b.qp.localEndpoint(), attr);
      b.qp.connect(a.qp.localEndpoint(), { ...attr, maxDestRdAtomic: 16 });
      const SLOT = 64;
      const src = b.pd.registerMr(4096, ALL_REMOTE);
      fill(src, 3);
      const dst = a.pd.registerMr(16 * SLOT, ALL_REMOTE);
      const read = (i: number): void =>
        a.qp.postSend([{ wrId: i, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(dst, (i % 16) * SLOT, SLOT)], remoteAddr: src.addr + ((i * SLOT) % src.length), rkey: src.rkey }]);
      // One READ first: the pair is up and the responder holds its stream.
      read(0);
      assert.equal(statuses(await waitCompletions(a, 1)), "0:SUCCESS");
      const sock = (b.qp as unknown as { sock: net.Socket }).sock;
      const held: (() => void)[] = [];
      const write = sock.write;
      const plain = write as (chunk: Uint8Array, cb?: (err?: Error | null) => void) => boolean;
      sock.write = ((chunk: Uint8Array, cb?: (err?: Error | null) => void) =>
        plain.call(sock, chunk, cb === undefined ? undefined : (err?: Error | null) => void held.push(() => cb(err)))) as typeof sock.write;
      try {
        const TOTAL = 300;
        let posted = 1;
        for (; posted <= 16; posted++) read(posted);
        for (let done = 1; done < TOTAL; done++) {
          const [wc] = await waitCompletions(a, 1);
          assert.equal(statuses([wc!]), `${done}:SUCCESS`, `READ ${done} of ${TOTAL} (16 outstanding; events: ${events.map((e) => e.reason).join("; ")})`);
          const got = bytes(dst).subarray((done % 16) * SLOT, (done % 16 + 1) * SLOT);
          const off = (done * SLOT) % src.length;
          assert.deepEqual(got, bytes(src).subarray(off, off + SLOT), `READ ${done} brought its bytes`);
          if (posted < TOTAL) read(posted++);
        }
        assert.ok(held.length >= TOTAL - 1, `the responder's write callbacks were held (${held.length})`);
      } finally {
        sock.write = write;
        for (const f of held.splice(0)) f();
      }
      assert.deepEqual(events, []);
      assert.equal(b.qp.state, QpState.RTS);
    } finally {
      devA.close();
      devB.close();
    }
  });

  it("maxDestRdAtomic 0: a READ is answered with NAK invalid request (REM_INV_REQ_ERR), as verbs does", async () => {
    const w = new Waiter();
    const devA = await openDevice();
    const devB = await openDevice();
    cleanups.push(() => devA.close(), () => devB.close());
    try {
      const a = makeSide(devA);
      const b = makeSide(devB);
      const events: AsyncEvent[] = [];
      b.qp.onEvent = (e) => {
        events.push(e);
        w.poke();
      };
      const attr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
      a.qp.connect(b.qp.localEndpoint(), attr);
      b.qp.connect(a.qp.localEndpoint(), { ...attr, maxDestRdAtomic: 0 });
      const src = b.pd.registerMr(64, ALL_REMOTE);
      const dst = a.pd.registerMr(64, ALL_REMOTE);
      a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(dst)], remoteAddr: src.addr, rkey: src.rkey }]);
      const [wc] = await waitCompletions(a, 1);
      assert.equal(wcStatusName(wc!.status), "REM_INV_REQ_ERR");
      await w.until(() => events.length > 0, "the responder's async event");
      assert.match(events[0]!.reason, /maxDestRdAtomic 0/);
    } finally {
      devA.close();
      devB.close();
    }
  });
});
