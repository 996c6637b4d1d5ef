/**
 * issue 21 point 2: the tcp provider's wire format v2 — one TCP stream per
 * QP, carrying both directions (docs/wire-format.md):
 *
 * - a connected pair uses one stream (one accepted connection per pair, was
 *   two), and both QPs hold the two ends of that same connection;
 * - a HELLO of wire version 1 (the two-stream format) is refused: the
 *   stream is closed, the device counts it, and the QP waiting for exactly
 *   that peer fails with a PROTOCOL reason naming both versions;
 * - the side that waits for its peer's stream waits at most the device's
 *   HELLO deadline, then goes to ERR with an async event, its work flushed;
 * - two sides each doing bulk READs of 64 MiB from the other at the same
 *   time complete, with the right bytes (back-pressure never pauses a side
 *   whose own requests await responses on the shared stream).
 *
 * Provider-specific (wire level): tcp only.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import { createHash } from "node:crypto";
import { QpState, SendFlags, WcStatus, WrOpcode, wcStatusName, type AsyncEvent, type Device, type SendWr } from "../../src/transport/types.js";
import { tcpProvider } from "../../src/transport/tcp/index.js";
import { FrameType, encodeHeader } from "../../src/transport/tcp/codec.js";
import { readPathStats } from "../../src/transport/tcp/read-path.js";
import { ALL_REMOTE, DEADLINE_MS, bytes, makeSide, mr, sge, waitCompletions, type Side } from "../support/seam.js";
import { eventually } from "../support/api.js";

const HOST = "127.0.0.1";
const ATTR = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
const MiB = 1 << 20;

const devices: Device[] = [];
after(() => {
  for (const d of devices.splice(0)) d.close();
});

async function openDevice(name: string): Promise<Device> {
  const d = await tcpProvider.openDevice(name, { host: HOST });
  devices.push(d);
  return d;
}

interface SockOf {
  sock: net.Socket | null;
}
const sockOf = (s: Side): net.Socket | null => (s.qp as unknown as SockOf).sock;
const accepted = (): number => readPathStats.onread + readPathStats.fallback;

/** One SEND each way, to prove the pair is up. */
async function ping(a: Side, b: Side): Promise<void> {
  const ma = mr(a, 64);
  const mb = mr(b, 64);
  a.qp.postRecv([{ wrId: 1, sgList: [sge(ma)] }]);
  b.qp.postRecv([{ wrId: 1, sgList: [sge(mb)] }]);
  a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(ma, 0, 8)] }]);
  b.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(mb, 0, 8)] }]);
  for (const s of [a, b]) {
    const wcs = await waitCompletions(s, 2);
    assert.deepEqual(wcs.map((c) => wcStatusName(c.status)), ["SUCCESS", "SUCCESS"]);
  }
}

/** Dials the device's port (a raw peer). */
function dial(port: number): Promise<net.Socket> {
  return new Promise((resolve, reject) => {
    const s = net.connect({ host: HOST, port, noDelay: true });
    s.once("connect", () => resolve(s));
    s.once("error", reject);
  });
}

describe("tcp wire format v2: one stream per QP (issue 21 point 2)", () => {
  it("issue 21 point 2: a connected QP pair uses one TCP stream (one accepted connection per pair, was two), both directions on it", async () => {
    const devA = await openDevice("tcp-1s-a");
    const devB = await openDevice("tcp-1s-b");
    const before = accepted();
    const pairs: [Side, Side][] = [];
    for (let i = 0; i < 3; i++) {
      const a = makeSide(devA);
      const b = makeSide(devB);
      a.qp.connect(b.qp.localEndpoint(), ATTR);
      b.qp.connect(a.qp.localEndpoint(), ATTR);
      pairs.push([a, b]);
    }
    // Loopback too: both QPs of a pair on one device.
    const c = makeSide(devA);
    const d = makeSide(devA);
    c.qp.connect(d.qp.localEndpoint(), ATTR);
    d.qp.connect(c.qp.localEndpoint(), ATTR);
    pairs.push([c, d]);
    for (const [a, b] of pairs) await ping(a, b);
    assert.equal(accepted() - before, pairs.length, `one accepted stream per QP pair: ${accepted() - before} for ${pairs.length} pairs`);
    for (const [a, b] of pairs) {
      const sa = sockOf(a)!;
      const sb = sockOf(b)!;
      assert.ok(sa && sb, "both QPs hold their stream");
      // The two ends of one connection.
      assert.equal(sa.localPort, sb.remotePort);
      assert.equal(sa.remotePort, sb.localPort);
    }
  });

  it("issue 21 point 2: a HELLO of wire version 1 is refused: stream closed, counted, and the QP waiting for that peer fails with PROTOCOL naming both versions", async () => {
    const dev = await openDevice("tcp-1s-v1");
    const side = makeSide(dev);
    const events: AsyncEvent[] = [];
    side.qp.onEvent = (e) => events.push(e);
    const PEER_QPN = 1; // lower than any QP number the device hands out: the peer dials, our QP waits
    const PEER_PSN = 0x4321;
    const port = side.qp.localEndpoint().port;
    side.qp.connect({ provider: "tcp", qpNum: PEER_QPN, psn: PEER_PSN, lid: 0, gid: HOST, port: 9, mtu: 4096 }, ATTR);
    const pending = (dev as unknown as { pendingHello: { versionRefused: number } }).pendingHello;
    const v1Hello = (srcQp: number, psn: number): Buffer => {
      const h = Buffer.from(encodeHeader(FrameType.HELLO, 0, psn, 0, 0, 0, 0, side.qp.qpNum, srcQp, 0));
      h[1] = 1;
      return h;
    };
    // A version-1 HELLO from a stranger: refused and counted; the QP keeps waiting for its peer.
    const stranger = await dial(port);
    stranger.on("error", () => {});
    const strangerClosed = new Promise<void>((r) => stranger.once("close", () => r()));
    stranger.write(v1Hello(0x777, 5));
    await strangerClosed;
    assert.equal(pending.versionRefused, 1);
    assert.equal(side.qp.state, QpState.RTS);
    assert.equal(events.length, 0, "the QP keeps waiting");
    // The peer itself speaks version 1: refused, and the QP fails with the reason.
    const peer = await dial(port);
    peer.on("error", () => {});
    const peerClosed = new Promise<void>((r) => peer.once("close", () => r()));
    peer.write(v1Hello(PEER_QPN, PEER_PSN));
    await peerClosed;
    assert.equal(pending.versionRefused, 2);
    await eventually(() => events.length > 0, DEADLINE_MS, "the QP's async event");
    assert.equal(events[0]!.type, "QP_FATAL");
    assert.match(events[0]!.reason, /PROTOCOL.*wire version 1 not supported \(this side speaks 2\)/);
    assert.equal(side.qp.state, QpState.ERR);
  });

  it("issue 21 point 2: a version-1 peer the QP dials (it dials back with a version-1 HELLO) fails the QP with PROTOCOL naming both versions", async () => {
    const dev = await openDevice("tcp-1s-v1-dial");
    const side = makeSide(dev);
    const events: AsyncEvent[] = [];
    side.qp.onEvent = (e) => events.push(e);
    // The "version-1 peer": a server that takes our stream and never answers on it.
    const server = net.createServer();
    const taken: net.Socket[] = [];
    server.on("connection", (s) => {
      s.on("error", () => {});
      taken.push(s);
    });
    await new Promise<void>((r) => server.listen(0, HOST, r));
    try {
      const PEER_QPN = 0xfffff0; // higher than ours: our QP dials
      const PEER_PSN = 0x1234;
      side.qp.connect({ provider: "tcp", qpNum: PEER_QPN, psn: PEER_PSN, lid: 0, gid: HOST, port: (server.address() as net.AddressInfo).port, mtu: 4096 }, ATTR);
      await eventually(() => taken.length > 0, DEADLINE_MS, "our QP to dial the peer");
      // A version-1 peer dials its own request stream to us, as version 1 did.
      const s = await dial(side.qp.localEndpoint().port);
      s.on("error", () => {});
      const h = Buffer.from(encodeHeader(FrameType.HELLO, 0, PEER_PSN, 0, 0, 0, 0, side.qp.qpNum, PEER_QPN, 0));
      h[1] = 1;
      s.write(h);
      await eventually(() => events.length > 0, DEADLINE_MS, "the QP's async event");
      assert.equal(events[0]!.type, "QP_FATAL");
      assert.match(events[0]!.reason, /PROTOCOL.*wire version 1 not supported \(this side speaks 2\)/);
      assert.equal(side.qp.state, QpState.ERR);
      s.destroy();
    } finally {
      for (const t of taken) t.destroy();
      server.close();
    }
  });

  it("issue 21 point 2: the waiting side's deadline: a peer whose stream never arrives moves the QP to ERR with an async event, its work flushed (no hang)", async () => {
    const dev = await openDevice("tcp-1s-wait");
    (dev as unknown as { helloTimeoutMs: number }).helloTimeoutMs = 300;
    const side = makeSide(dev);
    const events: AsyncEvent[] = [];
    side.qp.onEvent = (e) => events.push(e);
    // QP number 1 compares lower: that peer would dial, so our QP waits; nobody ever dials.
    side.qp.connect({ provider: "tcp", qpNum: 1, psn: 7, lid: 0, gid: HOST, port: 9, mtu: 4096 }, ATTR);
    const m = mr(side, 64);
    side.qp.postRecv([{ wrId: 10, sgList: [sge(m)] }]);
    side.qp.postSend([{ wrId: 11, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(m, 0, 8)] }]);
    await eventually(() => events.length > 0, DEADLINE_MS * 2, "the deadline's async event");
    assert.equal(events[0]!.type, "QP_FATAL");
    assert.match(events[0]!.reason, /did not open its stream within 300 ms/);
    assert.equal(side.qp.state, QpState.ERR);
    const wcs = await waitCompletions(side, 2);
    assert.deepEqual(wcs.map((c) => [c.wrId, wcStatusName(c.status)]).sort(), [
      [10, "WR_FLUSH_ERR"],
      [11, "WR_FLUSH_ERR"],
    ]);
    side.qp.destroy();
  });

  it("issue 21 point 2: two sides each READ 64 MiB from the other at the same time: both complete with the right bytes (no back-pressure deadlock on the shared stream)", { timeout: 120_000 }, async () => {
    const devA = await openDevice("tcp-1s-bulk-a");
    const devB = await openDevice("tcp-1s-bulk-b");
    const a = makeSide(devA, { maxSendWr: 64 });
    const b = makeSide(devB, { maxSendWr: 64 });
    const events: AsyncEvent[] = [];
    a.qp.onEvent = b.qp.onEvent = (e) => events.push(e);
    a.qp.connect(b.qp.localEndpoint(), ATTR);
    b.qp.connect(a.qp.localEndpoint(), ATTR);
    const TOTAL = 64 * MiB;
    const CHUNK = 4 * MiB;
    const sides = [a, b].map((s, k) => {
      const src = s.pd.registerMr(TOTAL, ALL_REMOTE);
      const dst = s.pd.registerMr(TOTAL, ALL_REMOTE);
      const v = bytes(src);
      for (let i = 0; i < v.length; i += 4096) v.fill((i / 4096 + 17 * (k + 1)) & 0xff, i, i + 4096);
      return { s, src, dst };
    });
    const sha = (u: Uint8Array): string => createHash("sha256").update(u).digest("hex");
    const reads = (me: (typeof sides)[number], peer: (typeof sides)[number]): SendWr[] =>
      Array.from({ length: TOTAL / CHUNK }, (_, i) => ({
        wrId: i,
        opcode: WrOpcode.RDMA_READ,
        flags: SendFlags.SIGNALED,
        sgList: [sge(me.dst, i * CHUNK, CHUNK)],
        remoteAddr: peer.src.addr + i * CHUNK,
        rkey: peer.src.rkey,
      }));
    // The stream is up first (a ping each way); then both post all their READs in one tick, so both
    // sides' requests are on the wire before either answers, and the responses cross on the one stream.
    await ping(a, b);
    a.qp.postSend(reads(sides[0]!, sides[1]!));
    b.qp.postSend(reads(sides[1]!, sides[0]!));
    const [wa, wb] = await Promise.all([waitCompletions(a, TOTAL / CHUNK, 30_000), waitCompletions(b, TOTAL / CHUNK, 30_000)]);
    for (const wcs of [wa, wb]) assert.ok(wcs.every((c) => c.status === WcStatus.SUCCESS), wcs.map((c) => wcStatusName(c.status)).join(" "));
    assert.equal(sha(bytes(sides[0]!.dst)), sha(bytes(sides[1]!.src)), "A read B's 64 MiB exactly");
    assert.equal(sha(bytes(sides[1]!.dst)), sha(bytes(sides[0]!.src)), "B read A's 64 MiB exactly");
    assert.deepEqual(events, []);
  });
});
