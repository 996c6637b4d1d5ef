/**
 * issue 21 point 1: a large payload is read straight from the socket into
 * its registered memory (FrameReader.pullDirect, read-path.ts), with no copy
 * through the read buffer. The reader is driven here with a fake socket read,
 * so every case is deterministic: the bytes land exactly in the segment the
 * header's checks gave and nowhere else, a read never asks for a byte past
 * the payload or the segment, a short read ends the pull, a deregister
 * between two reads stops the next one (the rest is discarded and reported),
 * and small segments go the copy path. Provider-specific: tcp only.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { DIRECT_MAX, DIRECT_MIN, FrameReader, type DirectRead, type PlacementMr } from "../../src/transport/tcp/frame-reader.js";
import { FrameType, HEADER_LEN, encodeHeader } from "../../src/transport/tcp/codec.js";

interface FakeMr extends PlacementMr {
  unusable: boolean;
}

function fakeMr(len: number, fill: number): FakeMr {
  return { view: new Uint8Array(len).fill(fill), dvc: { ab: null, dv: null }, unusable: false };
}

/** A WRITE frame's header for `payloadLen` bytes (the reader decodes and checks it). */
function writeHeader(payloadLen: number): Buffer {
  return Buffer.from(encodeHeader(FrameType.WRITE, 0, 1, payloadLen, 7, 0x1000, 0, 0, 0, 0));
}

/**
 * A reader whose every WRITE is placed in `segs` (as the responder does after
 * its checks), and a fake socket holding `wire`: `read` hands out at most
 * `avail` bytes per call, in order, and records what each call asked for.
 */
function rig(segs: { mr: FakeMr; off: number; len: number }[], wire: Uint8Array, win: { rkey: number } | null = null) {
  const events: string[] = [];
  const reader = new FrameReader(
    () => {
      reader.placeBegin();
      for (const s of segs) reader.placeSeg(s.mr, s.off, s.len);
      if (win !== null) reader.placeWindow(win, win.rkey);
    },
    () => events.push("done"),
    (reason) => events.push(`malformed: ${reason}`),
    () => events.push("revoked"),
  );
  let pos = 0;
  const asks: { view: Uint8Array; at: number; len: number }[] = [];
  const sock = {
    avail: Infinity,
    /** Bytes still in the fake socket. */
    get left(): number {
      return wire.length - pos;
    },
    /** The next `n` bytes as a read-buffer chunk (what a read through the shared buffer gets). */
    chunk(n: number): Buffer {
      const b = Buffer.from(wire.subarray(pos, pos + n));
      pos += b.length;
      return b;
    },
    read: ((view, at, len) => {
      asks.push({ view, at, len });
      const n = Math.min(len, sock.avail, wire.length - pos);
      view.set(wire.subarray(pos, pos + n), at);
      pos += n;
      return n;
    }) as DirectRead,
  };
  return { reader, events, sock, asks };
}

describe("tcp direct reads (FrameReader.pullDirect)", () => {
  it("the payload lands exactly in its segment, read straight from the socket after the first chunk; nothing is asked past the payload", () => {
    const L = 300_000;
    const mr = fakeMr(L + 2000, 0x55);
    const payload = randomBytes(L);
    const { reader, events, sock, asks } = rig([{ mr, off: 1000, len: L }], Buffer.concat([writeHeader(L), payload, writeHeader(0)]));
    reader.feed(sock.chunk(HEADER_LEN + 5000));
    assert.equal(reader.payloadLeft, L - 5000);
    reader.pullDirect(sock.read);
    assert.deepEqual(events, ["done"]);
    assert.equal(reader.payloadLeft, 0);
    assert.equal(asks.length, 1, "one read asks for the whole rest");
    assert.equal(asks[0]!.at, 1000 + 5000);
    assert.equal(asks[0]!.len, L - 5000, "never past the payload's end: the next frame's header stays in the socket");
    assert.equal(sock.left, HEADER_LEN);
    assert.deepEqual(Buffer.from(mr.view.subarray(1000, 1000 + L)), payload);
    assert.ok(mr.view.subarray(0, 1000).every((x) => x === 0x55) && mr.view.subarray(1000 + L).every((x) => x === 0x55), "no byte outside the segment changed");
    // The next frame is read the usual way.
    reader.feed(sock.chunk(HEADER_LEN));
    assert.deepEqual(events, ["done", "done"]);
  });

  it("one pull reads at most DIRECT_MAX bytes, then leaves the rest to the socket's next read", () => {
    const L = 3 * DIRECT_MAX + 12_345;
    const mr = fakeMr(L, 0);
    const payload = randomBytes(L);
    const { reader, events, sock, asks } = rig([{ mr, off: 0, len: L }], Buffer.concat([writeHeader(L), payload]));
    reader.feed(sock.chunk(HEADER_LEN + 1000));
    let pulls = 0;
    while (reader.payloadLeft >= DIRECT_MIN) {
      const before = asks.length;
      const left = reader.payloadLeft;
      reader.pullDirect(sock.read);
      pulls++;
      const took = left - reader.payloadLeft;
      assert.ok(took > 0 && took <= DIRECT_MAX, `pull ${pulls} took ${took} bytes`);
      assert.ok(asks.slice(before).every((a) => a.len <= DIRECT_MAX));
    }
    assert.equal(pulls, 3);
    reader.feed(sock.chunk(sock.left));
    assert.deepEqual(events, ["done"]);
    assert.deepEqual(Buffer.from(mr.view), payload);
  });

  it("a short read ends the pull (the socket is drained); the next one goes on where it stopped", () => {
    const L = 200_000;
    const mr = fakeMr(L, 0);
    const payload = randomBytes(L);
    const { reader, events, sock, asks } = rig([{ mr, off: 0, len: L }], Buffer.concat([writeHeader(L), payload]));
    reader.feed(sock.chunk(HEADER_LEN + 100));
    sock.avail = 30_000;
    reader.pullDirect(sock.read);
    assert.equal(asks.length, 1, "the read came back short (the socket had less than the rest): the pull ends");
    assert.equal(reader.payloadLeft, L - 100 - 30_000);
    assert.deepEqual(events, []);
    // Now a chunk through the read buffer, then a pull that finishes the payload.
    reader.feed(sock.chunk(5000));
    sock.avail = Infinity;
    reader.pullDirect(sock.read);
    assert.deepEqual(events, ["done"]);
    assert.deepEqual(Buffer.from(mr.view), payload);
  });

  it("a deregister between two reads stops the next one: nothing more lands, the rest is discarded and reported", () => {
    const L = 200_000;
    const mr = fakeMr(L, 0x55);
    const payload = Buffer.alloc(L, 0xee);
    const { reader, events, sock, asks } = rig([{ mr, off: 0, len: L }], Buffer.concat([writeHeader(L), payload, writeHeader(0)]));
    reader.feed(sock.chunk(HEADER_LEN + 100));
    sock.avail = 50_000;
    reader.pullDirect(sock.read);
    const landed = 100 + 50_000;
    assert.equal(asks.length, 1);
    mr.unusable = true; // deregistered (or its buffer detached) before the next read
    reader.pullDirect(sock.read);
    assert.equal(asks.length, 1, "no read into deregistered memory");
    // The rest arrives through the read buffer: discarded.
    while (sock.left > 0) reader.feed(sock.chunk(65536));
    assert.deepEqual(events, ["revoked", "done", "done"]);
    assert.ok(mr.view.subarray(0, landed).every((x) => x === 0xee));
    assert.ok(mr.view.subarray(landed).every((x) => x === 0x55), "no byte landed after the deregister");
  });

  it("a memory window invalidated or rebound between two reads (its key changed) stops the next one", () => {
    const L = 200_000;
    const mr = fakeMr(L, 0x55);
    const win = { rkey: 0x1234 };
    const { reader, events, sock, asks } = rig([{ mr, off: 0, len: L }], Buffer.concat([writeHeader(L), Buffer.alloc(L, 0xee)]), win);
    reader.feed(sock.chunk(HEADER_LEN + 100));
    sock.avail = 50_000;
    reader.pullDirect(sock.read);
    assert.equal(asks.length, 1);
    win.rkey = 0x1299; // LOCAL_INV, or a new bind: the key the placement was checked with is gone
    reader.pullDirect(sock.read);
    assert.equal(asks.length, 1, "no read through a window whose key changed");
    while (sock.left > 0) reader.feed(sock.chunk(65536));
    assert.deepEqual(events, ["revoked", "done"]);
    assert.ok(mr.view.subarray(100 + 50_000).every((x) => x === 0x55), "no byte landed after the key changed");
  });

  it("segments: each read stays inside one segment; a segment below DIRECT_MIN goes through the read buffer", () => {
    const a = fakeMr(100_000, 0x11);
    const b = fakeMr(DIRECT_MIN - 1, 0x22);
    const c = fakeMr(80_000, 0x33);
    const la = 90_000;
    const lb = DIRECT_MIN - 1;
    const lc = 70_000;
    const L = la + lb + lc;
    const payload = randomBytes(L);
    const { reader, events, sock, asks } = rig(
      [
        { mr: a, off: 10_000, len: la },
        { mr: b, off: 0, len: lb },
        { mr: c, off: 5000, len: lc },
      ],
      Buffer.concat([writeHeader(L), payload]),
    );
    reader.feed(sock.chunk(HEADER_LEN + 1000));
    reader.pullDirect(sock.read);
    assert.equal(asks.length, 1, "the pull stops at a segment too small to read straight into");
    assert.equal(asks[0]!.view, a.view);
    assert.equal(asks[0]!.len, la - 1000);
    // The small segment (and a bit of the next) through the read buffer, then a pull for the rest.
    reader.feed(sock.chunk(lb + 2000));
    reader.pullDirect(sock.read);
    assert.equal(asks.length, 2);
    assert.equal(asks[1]!.view, c.view);
    assert.equal(asks[1]!.at, 5000 + 2000);
    assert.equal(asks[1]!.len, lc - 2000);
    assert.deepEqual(events, ["done"]);
    assert.deepEqual(Buffer.from(a.view.subarray(10_000, 10_000 + la)), payload.subarray(0, la));
    assert.deepEqual(Buffer.from(b.view), payload.subarray(la, la + lb));
    assert.deepEqual(Buffer.from(c.view.subarray(5000, 5000 + lc)), payload.subarray(la + lb));
    assert.ok(a.view.subarray(0, 10_000).every((x) => x === 0x11) && a.view.subarray(10_000 + la).every((x) => x === 0x11));
    assert.ok(c.view.subarray(0, 5000).every((x) => x === 0x33) && c.view.subarray(5000 + lc).every((x) => x === 0x33));
  });

  it("nothing is read straight for a small rest, a discarded payload, or after a failed read", () => {
    const L = 100_000;
    const mr = fakeMr(L, 0);
    {
      // The rest of the payload is below DIRECT_MIN.
      const { reader, sock, asks } = rig([{ mr, off: 0, len: L }], Buffer.concat([writeHeader(L), randomBytes(L)]));
      reader.feed(sock.chunk(HEADER_LEN + L - DIRECT_MIN + 1));
      reader.pullDirect(sock.read);
      assert.equal(asks.length, 0);
    }
    {
      // A payload the handler discards (no placement): never read into anything.
      const { reader, sock, asks } = rig([], Buffer.concat([writeHeader(L), randomBytes(L)]));
      reader.feed(sock.chunk(HEADER_LEN + 10));
      reader.pullDirect(sock.read);
      assert.equal(asks.length, 0);
    }
    {
      // A read that fails (-1) or finds nothing (0): the pull stops, nothing is counted.
      const { reader, sock, events } = rig([{ mr, off: 0, len: L }], Buffer.concat([writeHeader(L), randomBytes(L)]));
      reader.feed(sock.chunk(HEADER_LEN + 10));
      let calls = 0;
      reader.pullDirect(() => (calls++, -1));
      reader.pullDirect(() => (calls++, 0));
      assert.equal(calls, 2);
      assert.equal(reader.payloadLeft, L - 10);
      assert.deepEqual(events, []);
    }
  });
});
