/**
 * The tcp provider's wire format (codec.ts): every frame kind round-trips
 * with the documented byte layout, every malformed header is rejected with a
 * reason, and decodeHeader never throws on arbitrary bytes (seeded fuzz).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import {
  FrameFlags,
  FrameType,
  HEADER_LEN,
  MAGIC,
  MAX_MESSAGE,
  Syndrome,
  VERSION,
  decodeHeader,
  encodeHeader,
  newHeader,
  type FrameHeader,
} from "../../src/transport/tcp/codec.js";

type HeaderFields = Omit<FrameHeader, "type"> & { type: FrameType };

function encode(f: HeaderFields): Buffer {
  // encodeHeader hands out views of a shared arena: copy, so later encodes cannot alias it.
  return Buffer.from(encodeHeader(f.type, f.flags, f.psn, f.payloadLen, f.rkey, f.raddr, f.imm, f.aux, f.op1, f.op2));
}

/** A decoded header's fields as a plain object (the decoder keeps the operands as 32-bit halves until asked). */
function fields(h: FrameHeader): HeaderFields {
  return { type: h.type as FrameType, flags: h.flags, psn: h.psn, payloadLen: h.payloadLen, rkey: h.rkey, raddr: h.raddr, imm: h.imm, aux: h.aux, op1: h.op1, op2: h.op2 };
}

function decode(b: Uint8Array, off = 0): { err: string | null; h: FrameHeader } {
  const h = newHeader();
  return { err: decodeHeader(b, off, h), h };
}

const base: HeaderFields = {
  type: FrameType.SEND,
  flags: 0,
  psn: 0x00abcdef,
  payloadLen: 0,
  rkey: 0,
  raddr: 0,
  imm: 0,
  aux: 0,
  op1: 0n,
  op2: 0n,
};

/** One representative, valid frame of each kind, with fields that exercise every byte. */
const KINDS: { name: string; f: HeaderFields }[] = [
  { name: "HELLO", f: { ...base, type: FrameType.HELLO, psn: 0x00123456, aux: 0x00fedcba, op1: 0x0000000000654321n } },
  { name: "SEND", f: { ...base, type: FrameType.SEND, payloadLen: 4096 } },
  { name: "SEND_WITH_IMM (solicited)", f: { ...base, type: FrameType.SEND, flags: FrameFlags.IMM | FrameFlags.SOLICITED, payloadLen: 1, imm: 0xdeadbeef } },
  { name: "WRITE", f: { ...base, type: FrameType.WRITE, payloadLen: MAX_MESSAGE, rkey: 0x89abcdef, raddr: 0x7f0012345678 } },
  { name: "WRITE_WITH_IMM", f: { ...base, type: FrameType.WRITE, flags: FrameFlags.IMM, payloadLen: 8, rkey: 0x1234, raddr: 2 ** 53 - 1, imm: 0x01020304 } },
  { name: "READ_REQ", f: { ...base, type: FrameType.READ_REQ, rkey: 0xffffffff, raddr: 0x100000000, aux: MAX_MESSAGE } },
  { name: "SEND with a piggybacked ACK", f: { ...base, type: FrameType.SEND, flags: FrameFlags.ACK, payloadLen: 8, op2: 0x00fedcban } },
  {
    name: "WRITE_WITH_IMM (solicited) with a piggybacked ACK",
    f: { ...base, type: FrameType.WRITE, flags: FrameFlags.IMM | FrameFlags.SOLICITED | FrameFlags.ACK, payloadLen: 8, rkey: 0x55, raddr: 0x1000, imm: 7, op2: 0x00ffffffn },
  },
  { name: "READ_REQ with a piggybacked ACK", f: { ...base, type: FrameType.READ_REQ, flags: FrameFlags.ACK, rkey: 0x66, raddr: 0x2000, aux: 64, op2: 0n } },
  {
    name: "ATOMIC CAS",
    f: { ...base, type: FrameType.ATOMIC, rkey: 0x4242, raddr: 0x7f0000001000, aux: 0, op1: 0x0102030405060708n, op2: 0xf1f2f3f4f5f6f7f8n },
  },
  { name: "ATOMIC FADD", f: { ...base, type: FrameType.ATOMIC, rkey: 0x4243, raddr: 8, aux: 1, op1: 0xffffffffffffffffn } },
  { name: "ACK", f: { ...base, type: FrameType.ACK, aux: Syndrome.ACK } },
  { name: "RNR NAK", f: { ...base, type: FrameType.ACK, aux: Syndrome.RNR_NAK, op2: 31n } },
  { name: "NAK invalid request", f: { ...base, type: FrameType.ACK, aux: Syndrome.NAK_INV_REQ } },
  { name: "NAK remote access", f: { ...base, type: FrameType.ACK, aux: Syndrome.NAK_REM_ACCESS } },
  { name: "NAK remote operation", f: { ...base, type: FrameType.ACK, aux: Syndrome.NAK_REM_OP } },
  { name: "READ_RESP", f: { ...base, type: FrameType.READ_RESP, payloadLen: 65536 } },
  { name: "ATOMIC_RESP", f: { ...base, type: FrameType.ATOMIC_RESP, op1: 0x8000000000000001n } },
];

/** sfc32: a small seeded PRNG, so every fuzz failure is reproducible from its seed and index. */
function prng(seed: number): () => number {
  let a = 0x9e3779b9;
  let b = 0x243f6a88;
  let c = 0xb7e15162;
  let d = seed >>> 0;
  const next = (): number => {
    const t = (((a + b) | 0) + d) | 0;
    d = (d + 1) | 0;
    a = b ^ (b >>> 9);
    b = (c + (c << 3)) | 0;
    c = (c << 21) | (c >>> 11);
    c = (c + t) | 0;
    return t >>> 0;
  };
  for (let i = 0; i < 16; i++) next();
  return next;
}

describe("tcp wire codec", () => {
  it("header is 48 bytes, magic 0xD7, version 2 (issue 21 point 2: one stream per QP), messages up to 2^31", () => {
    assert.equal(HEADER_LEN, 48);
    assert.equal(MAGIC, 0xd7);
    assert.equal(VERSION, 2);
    assert.equal(MAX_MESSAGE, 2 ** 31);
  });

  for (const { name, f } of KINDS) {
    it(`${name} round-trips with the documented byte layout`, () => {
      const b = encode(f);
      assert.equal(b.length, HEADER_LEN);
      // Byte layout by offset (all multi-byte fields big-endian).
      assert.equal(b[0], 0xd7, "magic at 0");
      assert.equal(b[1], 2, "version at 1");
      assert.equal(b[2], f.type, "type at 2");
      assert.equal(b[3], f.flags, "flags at 3");
      assert.equal(b.readUInt32BE(4), f.psn, "psn at 4");
      assert.equal(b.readUInt32BE(8), f.payloadLen, "payloadLen at 8");
      assert.equal(b.readUInt32BE(12), f.rkey, "rkey at 12");
      assert.equal(b.readUInt32BE(16) * 2 ** 32 + b.readUInt32BE(20), f.raddr, "raddr (u64) at 16");
      assert.equal(b.readUInt32BE(24), f.imm, "imm at 24");
      assert.equal(b.readUInt32BE(28), f.aux, "aux at 28");
      assert.equal(b.readBigUInt64BE(32), f.op1, "operand1 at 32");
      assert.equal(b.readBigUInt64BE(40), f.op2, "operand2 at 40");
      const { err, h } = decode(b);
      assert.equal(err, null, `valid ${name} header rejected: ${err}`);
      assert.deepEqual(fields(h), f);
    });
  }

  it("immediate data is big-endian at offset 24 (network order, as verbs carries it)", () => {
    const b = encode({ ...base, type: FrameType.SEND, flags: FrameFlags.IMM, imm: 0x11223344 });
    assert.deepEqual([...b.subarray(24, 28)], [0x11, 0x22, 0x33, 0x44]);
    const w = encode({ ...base, type: FrameType.WRITE, raddr: 0x0001020304050607, rkey: 0xa1b2c3d4 });
    assert.deepEqual([...w.subarray(12, 16)], [0xa1, 0xb2, 0xc3, 0xd4], "rkey big-endian at 12");
    assert.deepEqual([...w.subarray(16, 24)], [0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07], "raddr big-endian at 16");
    const p = encode({ ...base, psn: 0x00abcdef });
    assert.deepEqual([...p.subarray(4, 8)], [0x00, 0xab, 0xcd, 0xef], "psn big-endian at 4");
  });

  it("decodes a header at an offset inside a larger buffer (a frame mid-chunk)", () => {
    const f = KINDS.find((k) => k.name === "WRITE_WITH_IMM")!.f;
    const big = Buffer.alloc(7 + HEADER_LEN + 5, 0xee);
    encode(f).copy(big, 7);
    const { err, h } = decode(big, 7);
    assert.equal(err, null);
    assert.deepEqual(fields(h), f);
    // A view that does not start at its buffer's byte 0 (byteOffset honoured).
    const view = new Uint8Array(big.buffer, big.byteOffset + 3, big.length - 3);
    assert.deepEqual(fields(decode(view, 4).h), f);
  });

  it("consecutive encodes do not alias each other (arena views)", () => {
    const views: Buffer[] = [];
    for (let i = 0; i < 3000; i++) views.push(encodeHeader(FrameType.ACK, 0, i, 0, 0, 0, 0, 0, 0n, 0n));
    views.forEach((v, i) => assert.equal(v.readUInt32BE(4), i, `header ${i} was overwritten`));
  });

  describe("malformed headers are rejected with a reason", () => {
    const valid = (): Buffer => encode(KINDS.find((k) => k.name === "WRITE")!.f);
    const cases: { name: string; make: () => Buffer; reason: RegExp }[] = [
      { name: "bad magic", make: () => ((b) => ((b[0] = 0xd6), b))(valid()), reason: /magic/ },
      { name: "magic 0", make: () => ((b) => ((b[0] = 0), b))(valid()), reason: /magic/ },
      { name: "version 0", make: () => ((b) => ((b[1] = 0), b))(valid()), reason: /version 0/ },
      { name: "version 1 (the two-stream format)", make: () => ((b) => ((b[1] = 1), b))(valid()), reason: /wire version 1 not supported \(this side speaks 2\)/ },
      { name: "version 3", make: () => ((b) => ((b[1] = 3), b))(valid()), reason: /version 3/ },
      { name: "version 255", make: () => ((b) => ((b[1] = 255), b))(valid()), reason: /version 255/ },
      { name: "type 0", make: () => encode({ ...base, type: 0 as FrameType }), reason: /unknown frame type 0/ },
      { name: "type 9", make: () => encode({ ...base, type: 9 as FrameType }), reason: /unknown frame type 9/ },
      { name: "type 255", make: () => encode({ ...base, type: 255 as FrameType }), reason: /unknown frame type 255/ },
      { name: "unknown flag bit 3", make: () => encode({ ...base, flags: 8 }), reason: /unknown flags 0x8/ },
      { name: "unknown flag bit 7", make: () => encode({ ...base, flags: 0x83 }), reason: /unknown flags 0x83/ },
      ...[FrameType.HELLO, FrameType.ATOMIC, FrameType.ACK, FrameType.READ_RESP, FrameType.ATOMIC_RESP].map((type) => ({
        name: `ACK flag on frame type ${type}`,
        make: () => encode({ ...base, type, flags: FrameFlags.ACK }),
        reason: new RegExp(`ACK flag on frame type ${type}`),
      })),
      { name: "piggybacked ACK PSN 2^24", make: () => encode({ ...base, flags: FrameFlags.ACK, op2: 0x1000000n }), reason: /piggybacked ACK PSN 0x1000000 exceeds 24 bits/ },
      { name: "piggybacked ACK PSN 2^64-1", make: () => encode({ ...base, type: FrameType.WRITE, flags: FrameFlags.ACK, op2: 2n ** 64n - 1n }), reason: /exceeds 24 bits/ },
      ...[FrameType.HELLO, FrameType.READ_REQ, FrameType.ATOMIC, FrameType.ACK, FrameType.ATOMIC_RESP].map((type) => ({
        name: `payload on no-payload type ${type}`,
        make: () => encode({ ...base, type, payloadLen: 1 }),
        reason: new RegExp(`type ${type} carries no payload, got 1 bytes`),
      })),
      { name: "SEND payload 2^31+1", make: () => encode({ ...base, type: FrameType.SEND, payloadLen: MAX_MESSAGE + 1 }), reason: /exceeds 2\^31/ },
      { name: "WRITE payload 2^32-1", make: () => encode({ ...base, type: FrameType.WRITE, payloadLen: 0xffffffff }), reason: /exceeds 2\^31/ },
      { name: "READ_RESP payload 2^31+1", make: () => encode({ ...base, type: FrameType.READ_RESP, payloadLen: MAX_MESSAGE + 1 }), reason: /exceeds 2\^31/ },
      { name: "READ length 2^31+1", make: () => encode({ ...base, type: FrameType.READ_REQ, aux: MAX_MESSAGE + 1 }), reason: /read length .* exceeds 2\^31/ },
      {
        name: "raddr 2^53",
        make: () => ((b) => (b.writeUInt32BE(0x200000, 16), b.writeUInt32BE(0, 20), b))(valid()),
        reason: /beyond 2\^53/,
      },
      { name: "raddr 2^64-1", make: () => ((b) => (b.fill(0xff, 16, 24), b))(valid()), reason: /beyond 2\^53/ },
      { name: "atomic op 2", make: () => encode({ ...base, type: FrameType.ATOMIC, aux: 2 }), reason: /unknown atomic op 2/ },
      { name: "atomic op 2^32-1", make: () => encode({ ...base, type: FrameType.ATOMIC, aux: 0xffffffff }), reason: /unknown atomic op/ },
      { name: "ACK syndrome 5", make: () => encode({ ...base, type: FrameType.ACK, aux: Syndrome.NAK_REM_OP + 1 }), reason: /unknown ACK syndrome 5/ },
      { name: "ACK syndrome 2^32-1", make: () => encode({ ...base, type: FrameType.ACK, aux: 0xffffffff }), reason: /unknown ACK syndrome/ },
    ];
    for (const c of cases) {
      it(c.name, () => {
        const b = c.make();
        const { err } = decode(b);
        assert.equal(typeof err, "string", `${c.name} was accepted`);
        assert.match(err!, c.reason);
      });
    }

    it("the boundaries are accepted: payload 2^31, raddr 2^53-1, atomic op 1, syndrome NAK_REM_OP, read length 2^31, ACK PSN 2^24-1", () => {
      for (const f of [
        { ...base, type: FrameType.WRITE, payloadLen: MAX_MESSAGE },
        { ...base, type: FrameType.WRITE, raddr: 2 ** 53 - 1 },
        { ...base, type: FrameType.ATOMIC, aux: 1 },
        { ...base, type: FrameType.ACK, aux: Syndrome.NAK_REM_OP },
        { ...base, type: FrameType.READ_REQ, aux: MAX_MESSAGE },
        { ...base, flags: FrameFlags.IMM | FrameFlags.SOLICITED },
        { ...base, flags: FrameFlags.IMM | FrameFlags.SOLICITED | FrameFlags.ACK, op2: 0xffffffn },
        // Without the flag operand2 of a SEND is not an ACK PSN and is not checked.
        { ...base, op2: 2n ** 64n - 1n },
      ] as HeaderFields[]) {
        const { err, h } = decode(encode(f));
        assert.equal(err, null, `${JSON.stringify(f, (_, v) => (typeof v === "bigint" ? String(v) : v))}: ${err}`);
        assert.deepEqual(fields(h), f);
      }
    });
  });

  describe("property: decodeHeader never throws and accepts only well-formed headers", () => {
    /**
     * Whatever decodeHeader accepts must satisfy every rule of the format, and
     * re-encoding the decoded fields must give back the exact same 48 bytes.
     */
    function checkAccepted(b: Uint8Array, h: FrameHeader, ctx: string): void {
      assert.equal(b[0], MAGIC, ctx);
      assert.equal(b[1], VERSION, ctx);
      assert.ok(h.type >= FrameType.HELLO && h.type <= FrameType.ATOMIC_RESP, `${ctx}: type ${h.type}`);
      assert.equal(h.flags & ~7, 0, ctx);
      if (h.flags & FrameFlags.ACK) {
        assert.ok(h.type === FrameType.SEND || h.type === FrameType.WRITE || h.type === FrameType.READ_REQ, `${ctx}: ACK flag on type ${h.type}`);
        assert.ok(h.op2 <= 0xffffffn, `${ctx}: ACK PSN ${h.op2}`);
      }
      assert.ok(h.payloadLen <= MAX_MESSAGE, ctx);
      assert.ok(Number.isSafeInteger(h.raddr) && h.raddr >= 0, ctx);
      const noPayload = [FrameType.HELLO, FrameType.READ_REQ, FrameType.ATOMIC, FrameType.ACK, FrameType.ATOMIC_RESP] as number[];
      if (noPayload.includes(h.type)) assert.equal(h.payloadLen, 0, ctx);
      if (h.type === FrameType.ATOMIC) assert.ok(h.aux <= 1, ctx);
      if (h.type === FrameType.ACK) assert.ok(h.aux <= Syndrome.NAK_REM_OP, ctx);
      if (h.type === FrameType.READ_REQ) assert.ok(h.aux <= MAX_MESSAGE, ctx);
      const again = encodeHeader(h.type as FrameType, h.flags, h.psn, h.payloadLen, h.rkey, h.raddr, h.imm, h.aux, h.op1, h.op2);
      assert.ok(Buffer.compare(Buffer.from(b.buffer, b.byteOffset, HEADER_LEN), again) === 0, `${ctx}: re-encoding differs`);
    }

    function run(b: Uint8Array, ctx: () => string): boolean {
      const h = newHeader();
      let err: string | null;
      try {
        err = decodeHeader(b, 0, h);
      } catch (e) {
        assert.fail(`decodeHeader threw on ${ctx()}: ${(e as Error).stack}`);
      }
      if (err === null) {
        checkAccepted(b, h, ctx());
        return true;
      }
      assert.equal(typeof err, "string", ctx());
      assert.ok(err.length > 0, `${ctx()}: empty reason`);
      return false;
    }

    const hex = (b: Uint8Array): string => Buffer.from(b.buffer, b.byteOffset, HEADER_LEN).toString("hex");

    it("200k uniformly random 48-byte headers (seeded)", () => {
      const SEED = 0x5eed1;
      const rnd = prng(SEED);
      const b = new Uint8Array(HEADER_LEN);
      const dv = new DataView(b.buffer);
      let accepted = 0;
      for (let i = 0; i < 200_000; i++) {
        for (let k = 0; k < HEADER_LEN; k += 4) dv.setUint32(k, rnd());
        // A quarter get a valid magic, version, type, flags and address, so the later checks are reached too.
        if (i % 4 === 0) {
          b[0] = MAGIC;
          b[1] = VERSION;
          b[2] = 1 + (b[2]! % 8);
          b[3]! &= 7;
          b[16] = 0;
          b[17]! &= 0x1f;
        }
        if (run(b, () => `seed ${SEED} #${i}: ${hex(b)}`)) accepted++;
      }
      // Sanity: the structured quarter must sometimes pass (SEND/WRITE/READ_RESP with a length <= 2^31).
      assert.ok(accepted > 1000, `only ${accepted} random headers accepted`);
    });

    it("200k mutated valid headers (bit flips, byte stores, boundary values; seeded)", () => {
      const SEED = 0xc0dec;
      const rnd = prng(SEED);
      const seeds = KINDS.map((k) => encode(k.f));
      const interesting = [0, 1, 2, 3, 0x7f, 0x80, 0xff, 0x20, 0x1f];
      const u32 = [0, 1, 0x7fffffff, 0x80000000, 0x80000001, 0xffffffff, 0x001fffff, 0x00200000, 0x00ffffff];
      const b = new Uint8Array(HEADER_LEN);
      const dv = new DataView(b.buffer);
      let accepted = 0;
      let rejected = 0;
      for (let i = 0; i < 200_000; i++) {
        b.set(seeds[rnd() % seeds.length]!);
        const n = 1 + (rnd() % 4);
        for (let m = 0; m < n; m++) {
          const kind = rnd() % 4;
          if (kind === 0) {
            const bit = rnd() % (HEADER_LEN * 8);
            b[bit >> 3]! ^= 1 << (bit & 7);
          } else if (kind === 1) {
            b[rnd() % HEADER_LEN] = interesting[rnd() % interesting.length]!;
          } else if (kind === 2) {
            dv.setUint32(4 * (rnd() % 12), u32[rnd() % u32.length]!);
          } else {
            b[rnd() % HEADER_LEN] = rnd() & 0xff;
          }
        }
        if (run(b, () => `seed ${SEED} #${i}: ${hex(b)}`)) accepted++;
        else rejected++;
      }
      // Both outcomes must be well represented, or the mutations explore nothing.
      assert.ok(accepted > 10_000, `only ${accepted} mutants accepted`);
      assert.ok(rejected > 10_000, `only ${rejected} mutants rejected`);
    });
  });
});
