/**
 * issue 21 point 2 (tcp bulk WRITE path): the requester's small frames are
 * staged in a process-wide slab and the frames of one posted list leave in
 * as few socket writes as the slab allows; the slab starts over only once
 * none of its bytes is pending or queued in a socket. Checked here:
 *
 * - a posted list of 64 small WRITEs reaches the socket as one write (it was
 *   one write per WRITE), and a steady stream of such lists reuses one slab;
 * - WRITEs of random small sizes posted while the peer does not read (so the
 *   writes queue in user space, holding their slabs) land byte for byte once
 *   it reads again: no staged frame is overwritten while queued;
 * - a list mixing small WRITEs, large WRITEs and READs keeps its order on the
 *   wire (the small frames written as one are flushed before a large one).
 *
 * Provider-specific (the tcp provider's write path): tcp only.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import type net from "node:net";
import { createHash } from "node:crypto";
import { SendFlags, WcStatus, WrOpcode, wcStatusName, type Device, type SendWr } from "../../src/transport/types.js";
import { tcpProvider } from "../../src/transport/tcp/index.js";
import { stageStats } from "../../src/transport/tcp/requester.js";
import { ALL_REMOTE, bytes, makeSide, sge, waitCompletions, type Side } from "../support/seam.js";
import { eventually } from "../support/api.js";

const HOST = "127.0.0.1";
const ATTR = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };
const DEADLINE = 30_000;

const devices: Device[] = [];
after(() => {
  for (const d of devices.splice(0)) d.close();
});

async function pair(name: string, maxSendWr = 256): Promise<[Side, Side]> {
  const da = await tcpProvider.openDevice(`${name}-a`, { host: HOST });
  const db = await tcpProvider.openDevice(`${name}-b`, { host: HOST });
  devices.push(da, db);
  const a = makeSide(da, { maxSendWr });
  const b = makeSide(db, { maxSendWr });
  a.qp.connect(b.qp.localEndpoint(), ATTR);
  b.qp.connect(a.qp.localEndpoint(), ATTR);
  await eventually(() => sockOf(a) !== null && sockOf(b) !== null, DEADLINE, "both QPs to hold their stream");
  return [a, b];
}

const sockOf = (s: Side): net.Socket | null => (s.qp as unknown as { sock: net.Socket | null }).sock;

/** Counts the socket writes made while `f` runs. */
function countWrites(sock: net.Socket, f: () => void): number {
  const orig = sock.write;
  let n = 0;
  sock.write = function (this: net.Socket, ...args: unknown[]) {
    n++;
    return (orig as (...a: unknown[]) => boolean).apply(this, args);
  } as typeof sock.write;
  try {
    f();
  } finally {
    sock.write = orig;
  }
  return n;
}

const sha = (u: Uint8Array): string => createHash("sha256").update(u).digest("hex");

function expectSuccess(wcs: { status: number }[]): void {
  assert.ok(
    wcs.every((c) => c.status === WcStatus.SUCCESS),
    wcs.map((c) => wcStatusName(c.status)).join(" "),
  );
}

describe("tcp: the bulk WRITE path (issue 21 point 2)", () => {
  it("issue 21 point 2: a posted list of 64 small WRITEs leaves in one socket write, and a steady stream of such lists reuses one staging slab", async () => {
    const [a, b] = await pair("tcp-bulk-join");
    const src = a.pd.registerMr(64 * 512, ALL_REMOTE);
    const dst = b.pd.registerMr(64 * 512, ALL_REMOTE);
    const list = (round: number): SendWr[] =>
      Array.from({ length: 64 }, (_, i) => ({
        wrId: round * 64 + i,
        opcode: WrOpcode.RDMA_WRITE,
        flags: i === 63 ? SendFlags.SIGNALED : 0,
        sgList: [sge(src, i * 512, 512)],
        remoteAddr: dst.addr + i * 512,
        rkey: dst.rkey,
      }));
    const sock = sockOf(a)!;
    let slabsAfterFirst = 0;
    for (let round = 0; round < 20; round++) {
      bytes(src).fill(round + 1);
      const writes = countWrites(sock, () => a.qp.postSend(list(round)));
      if (round === 0) assert.equal(writes, 1, `64 small WRITEs of one list took ${writes} socket writes`);
      expectSuccess(await waitCompletions(a, 1, DEADLINE));
      assert.ok(bytes(dst).every((x) => x === round + 1), `round ${round}: the target holds that round's bytes`);
      // Each round's write is done before the next is posted (its completion needs the peer's ACK).
      await eventually(() => sock.writableLength === 0, DEADLINE, "the socket to hand its bytes to the kernel");
      if (round === 0) slabsAfterFirst = stageStats.slabs;
    }
    assert.ok(stageStats.slabs - slabsAfterFirst <= 1, `a steady stream took ${stageStats.slabs - slabsAfterFirst} new staging slabs in 19 rounds`);
  });

  it("issue 21 point 2: small WRITEs of random sizes posted while the peer does not read land byte for byte (no queued staged frame is overwritten)", async () => {
    const [a, b] = await pair("tcp-bulk-queued", 16384);
    const TOTAL = 32 << 20;
    const src = a.pd.registerMr(TOTAL, ALL_REMOTE);
    const dst = b.pd.registerMr(TOTAL, ALL_REMOTE);
    const s = bytes(src);
    // A pattern no shifted copy reproduces: a position-dependent hash of every byte.
    for (let i = 0; i < s.length; i++) s[i] = (i * 2654435761) >>> 24;
    // Sizes 1 B to 8 KiB (all staged), packed back to back over the whole region.
    let seed = 12345;
    const rnd = (): number => (seed = (seed * 1103515245 + 12345) >>> 0) / 2 ** 32;
    const wrs: SendWr[] = [];
    for (let off = 0; off < TOTAL; ) {
      const len = Math.min(TOTAL - off, 1 + Math.floor(rnd() * 8192));
      wrs.push({ wrId: wrs.length, opcode: WrOpcode.RDMA_WRITE, flags: 0, sgList: [sge(src, off, len)], remoteAddr: dst.addr + off, rkey: dst.rkey });
      off += len;
    }
    assert.ok(wrs.length <= 16384);
    wrs[wrs.length - 1]!.flags = SendFlags.SIGNALED;
    // The peer stops reading: once the kernel's buffers are full, A's writes queue in user space.
    sockOf(b)!.pause();
    a.qp.postSend(wrs);
    await eventually(() => sockOf(a)!.writableLength > 0, DEADLINE, "A's writes to queue in user space");
    sockOf(b)!.resume();
    expectSuccess(await waitCompletions(a, 1, DEADLINE));
    assert.equal(sha(bytes(dst)), sha(s), "every byte landed where it was written");
  });

  it("issue 21 point 2: a list mixing small WRITEs, large WRITEs and READs keeps its order on the wire", async () => {
    const [a, b] = await pair("tcp-bulk-mixed");
    const SIZES = [100, 70_000, 3000, 8192, 8193, 1, 200_000, 4096, 4096, 64];
    const total = SIZES.reduce((x, y) => x + y, 0);
    const src = a.pd.registerMr(total, ALL_REMOTE);
    const back = a.pd.registerMr(total, ALL_REMOTE);
    const dst = b.pd.registerMr(total, ALL_REMOTE);
    const s = bytes(src);
    for (let i = 0; i < s.length; i++) s[i] = (i * 2654435761) >>> 24;
    const wrs: SendWr[] = [];
    let off = 0;
    for (const len of SIZES) {
      // Each WRITE is read back at once by a READ behind it: a READ that overtook its WRITE would read zeros.
      wrs.push({ wrId: wrs.length, opcode: WrOpcode.RDMA_WRITE, flags: 0, sgList: [sge(src, off, len)], remoteAddr: dst.addr + off, rkey: dst.rkey });
      wrs.push({ wrId: wrs.length, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(back, off, len)], remoteAddr: dst.addr + off, rkey: dst.rkey });
      off += len;
    }
    a.qp.postSend(wrs);
    expectSuccess(await waitCompletions(a, SIZES.length, DEADLINE));
    assert.equal(sha(bytes(dst)), sha(s), "the WRITEs landed");
    assert.equal(sha(bytes(back)), sha(s), "each READ saw its WRITE");
  });
});
