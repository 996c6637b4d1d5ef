/**
 * issue 20 point 2: the parts of RdmaStream one at a time, without a
 * connection: the control messages' bytes (api/stream-wire.ts) and the ring
 * accounting (api/stream-ring.ts's RingCredit). Each rule is a test that
 * fails when the rule is broken; the same rules end to end, against hostile
 * peers, are in stream.test.ts.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { decodeControl, describeControl, encodeFin, encodeRingName, encodeRingRequest, encodeWnd } from "../../src/api/stream-wire.js";
import { MAX_CHUNK, RING, RingCredit, SendRing } from "../../src/api/stream-ring.js";

describe("issue 20 point 2: stream control messages (api/stream-wire.ts)", () => {
  it("each kind has its documented bytes and decodes back", () => {
    assert.deepEqual([...encodeFin(2 ** 32 + 5)], [0x02, 0, 0, 0, 1, 0, 0, 0, 5]);
    assert.deepEqual(decodeControl(encodeFin(2 ** 40 + 7)), { kind: "fin", total: 2 ** 40 + 7 });
    assert.deepEqual([...encodeWnd(RING / 4)], [0x03, 0, 4, 0, 0]);
    assert.deepEqual(decodeControl(encodeWnd(123)), { kind: "wnd", n: 123 });
    assert.deepEqual([...encodeRingRequest()], [0x04]);
    assert.deepEqual(decodeControl(encodeRingRequest()), { kind: "ringRequest" });
    assert.deepEqual(decodeControl(encodeRingName("async-rdma/stream/x")), { kind: "ringName", name: "async-rdma/stream/x" });
    assert.equal(encodeRingName("é")[0], 0x05);
    assert.equal(encodeRingName("é").length, 3, "the name in UTF-8");
  });

  it("a known kind of the wrong length, an unknown kind, an empty message and a name over 256 bytes decode to null", () => {
    for (const bad of [[0x02, 0], [0x03, 0, 1], [0x03, 0, 0, 0, 0, 0], [0x04, 0], [0x05], [0x01], [0x06, 1, 2], []]) {
      assert.equal(decodeControl(Buffer.from(bad)), null, `[${bad.join(", ")}]`);
    }
    assert.notEqual(decodeControl(encodeRingName("n".repeat(256))), null, "256 bytes is the longest name");
    assert.equal(decodeControl(encodeRingName("n".repeat(257))), null);
    assert.equal(describeControl(Buffer.from([0x07, 1])), "kind 7, 2 bytes");
    assert.equal(describeControl(Buffer.alloc(0)), "kind -1, 0 bytes");
  });
});

describe("issue 20 point 2: stream ring credit (api/stream-ring.ts)", () => {
  it("credit goes back in steps of at least a quarter ring, counted as given once", () => {
    const c = new RingCredit();
    assert.equal(c.give(RING / 4 - 1), 0, "under a quarter ring: nothing yet");
    assert.equal(c.granted, RING);
    assert.equal(c.give(RING / 4), RING / 4);
    assert.equal(c.granted, RING + RING / 4);
    assert.equal(c.give(RING / 4), 0, "what was given is not given again");
  });

  it("a WND of 0, or one that returns more than this side wrote, is refused and changes nothing", () => {
    const c = new RingCredit();
    assert.match(c.windowUpdate(0) ?? "", /0 bytes of ring credit/);
    assert.match(c.windowUpdate(1) ?? "", /more than was written \(0 at most\)/, "nothing written: nothing to return");
    c.post(1000);
    assert.equal(c.windowUpdate(1001) !== null, true);
    assert.equal(c.window, RING);
    assert.equal(c.windowUpdate(1000), null);
    assert.equal(c.window, RING + 1000);
    assert.equal(c.room(), RING);
  });

  it("a FIN below what was read or above what was allowed is refused; a good one sets the end", () => {
    const c = new RingCredit();
    assert.notEqual(c.fin(9, 10), null);
    assert.notEqual(c.fin(RING + 1, 0), null);
    assert.equal(c.peerFinAt, -1);
    assert.equal(c.fin(RING, 10), null);
    assert.equal(c.peerFinAt, RING);
  });

  it("a chunk must be 1..MAX_CHUNK bytes, inside the ring, inside the credit and inside the FIN's total", () => {
    const c = new RingCredit();
    assert.equal(c.chunkError(MAX_CHUNK, 0), null);
    assert.notEqual(c.chunkError(0, 0), null);
    assert.notEqual(c.chunkError(MAX_CHUNK + 1, 0), null);
    assert.match(c.chunkError(2, RING - 1) ?? "", /ring offset/, "a chunk never wraps");
    assert.match(c.chunkError(1, RING) ?? "", /credit/, "the whole ring read and no credit given back");
    c.give(RING);
    assert.equal(c.chunkError(1, RING), null, "credit given back: the next lap may start");
    assert.equal(c.fin(10, 0), null);
    assert.match(c.chunkError(11, 0) ?? "", /FIN/);
    assert.equal(c.chunkError(10, 0), null);
  });

  it("the writer's chunks stay within its room and MAX_CHUNK and are cut at the ring's end", () => {
    const c = new RingCredit();
    assert.equal(c.nextChunk(10 * RING), MAX_CHUNK);
    assert.equal(c.post(RING - 100), 0);
    assert.equal(c.nextChunk(1000), 100, "only the room left");
    assert.equal(c.windowUpdate(RING - 100), null);
    assert.equal(c.nextChunk(1000), 100, "cut at the ring's end");
    assert.equal(c.post(100), RING - 100);
    assert.equal(c.nextChunk(1000), 1000, "the next chunk starts at offset 0");
    assert.equal(c.post(1000), 0);
  });

  it("the writer's chunks also stay within the send ring's free space (the cap)", () => {
    const c = new RingCredit();
    assert.equal(c.nextChunk(1000, 10), 10);
    assert.equal(c.nextChunk(1000, 0), 0);
  });
});

describe("issue 21: the stream's send ring (api/stream-ring.ts)", () => {
  it("a region is free again only once every WRITE posted before it completed, whatever order completions come in", () => {
    const r = new SendRing();
    assert.equal(r.room(0), RING, "nothing posted: all of it");
    r.posted(100);
    r.posted(300);
    r.posted(RING);
    assert.equal(r.room(RING), 0, "the whole ring in flight");
    r.complete(300);
    assert.equal(r.room(RING), 0, "the first WRITE is still in flight: nothing is free");
    r.complete(100);
    assert.equal(r.room(RING), 300, "the first two completed: their 300 bytes");
    r.complete(999);
    assert.equal(r.room(RING), 300, "a completion of nothing posted changes nothing");
    r.complete(RING);
    assert.equal(r.room(RING), RING);
  });

  it("opens by registering RING bytes in place and frees them once", () => {
    const registered: ArrayBuffer[] = [];
    let disposed = 0;
    const r = new SendRing();
    r.open({
      registerMr: (b: ArrayBuffer) => {
        registered.push(b);
        return { dispose: () => void disposed++ } as never;
      },
    });
    assert.equal(registered.length, 1);
    assert.equal(registered[0]!.byteLength, RING);
    assert.equal(r.bytes!.buffer, registered[0]);
    r.free();
    r.free();
    assert.equal(disposed, 1, "disposed once");
    assert.equal(r.mr, null);
    assert.equal(r.bytes, null);
  });
});
