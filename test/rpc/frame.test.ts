/**
 * The RPC frame codec (rpc/frame.ts) on its own: decoding without a
 * DataView, and the cache of method names, which must never give one name
 * for another's bytes, however many names come.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { CALL, OK, decodeFrames, encodeFrame, enc } from "../../src/rpc/frame.js";
import { RdmaError } from "../../src/index.js";

function message(...frames: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(frames.reduce((n, f) => n + f.length, 0));
  let o = 0;
  for (const f of frames) {
    out.set(f, o);
    o += f.length;
  }
  return out;
}

describe("rpc frame codec", () => {
  it("issue 21: decodes ids and lengths above 2^31 and the payloads as copies", () => {
    const payload = new Uint8Array([1, 2, 3, 4, 5]);
    const m = message(encodeFrame(CALL, 0xfffffffe, enc.encode("echo"), payload), encodeFrame(OK, 0x80000001, null, new Uint8Array(0)));
    const [a, b] = decodeFrames(m);
    assert.deepEqual({ kind: a!.kind, id: a!.id, method: a!.method, payload: a!.payload }, { kind: CALL, id: 0xfffffffe, method: "echo", payload });
    assert.deepEqual({ kind: b!.kind, id: b!.id, method: b!.method, len: b!.payload.length }, { kind: OK, id: 0x80000001, method: "", len: 0 });
    m.fill(0);
    assert.deepEqual(a!.payload, payload, "the payload is a copy: the message's buffer is reused");
  });

  it("issue 21: the method-name cache gives each name its own bytes' string: same lengths, more names than it holds, a name whose buffer is reused", () => {
    const names = Array.from({ length: 40 }, (_, i) => `m${String(i).padStart(3, "0")}`); // all 4 bytes
    for (let round = 0; round < 3; round++) {
      for (const n of names) {
        const m = encodeFrame(CALL, 1, enc.encode(n), new Uint8Array(0));
        assert.equal(decodeFrames(m)[0]!.method, n);
        // The message's buffer is reused for another message: the cache kept its own copy.
        m.set(enc.encode("zzzz"), 12);
        assert.equal(decodeFrames(m)[0]!.method, "zzzz");
      }
    }
    // Not UTF-8, at a length a cached name has: still refused.
    const bad = encodeFrame(CALL, 1, new Uint8Array([0xff, 0xfe, 0xfd, 0xfc]), new Uint8Array(0));
    assert.throws(() => decodeFrames(bad), (e: unknown) => e instanceof RdmaError && e.code === "PROTOCOL" && /not UTF-8/.test(e.message));
    assert.equal(decodeFrames(encodeFrame(CALL, 1, enc.encode("é"), new Uint8Array(0)))[0]!.method, "é");
    assert.equal(decodeFrames(encodeFrame(CALL, 1, enc.encode("é"), new Uint8Array(0)))[0]!.method, "é", "a multi-byte name from the cache");
    // Long names are decoded each time (not cached), the same way.
    const long = "x".repeat(1000) + "é";
    assert.equal(decodeFrames(encodeFrame(CALL, 1, enc.encode(long), new Uint8Array(0)))[0]!.method, long);
    // A Buffer's slice() is a view: the name must still be a copy.
    const b = Buffer.from(encodeFrame(CALL, 1, enc.encode("buf1"), new Uint8Array([9])));
    const [f] = decodeFrames(b);
    b.fill(0x61, 12);
    assert.equal(f!.method, "buf1");
    assert.deepEqual(f!.payload, new Uint8Array([9]), "the payload is a copy of a Buffer's bytes too");
    assert.equal(decodeFrames(Buffer.from(encodeFrame(CALL, 1, enc.encode("aaaa"), new Uint8Array(0))))[0]!.method, "aaaa");
  });

  it("issue 21: a payload length of 2^31 or more in a short message is refused (PROTOCOL), not read as negative", () => {
    const m = encodeFrame(OK, 7, null, new Uint8Array(4));
    for (const len of [0x80000000, 0xfffffff4, 0xffffffff]) {
      m[8] = len >>> 24;
      m[9] = (len >>> 16) & 0xff;
      m[10] = (len >>> 8) & 0xff;
      m[11] = len & 0xff;
      assert.throws(() => decodeFrames(m), (e: unknown) => e instanceof RdmaError && e.code === "PROTOCOL" && /longer than its message/.test(e.message), `payload length ${len}`);
    }
  });
});
