/**
 * agent/codec.ts's typed messages: every kind survives toWire → encodeMsg →
 * decodeMsg → fromWire unchanged, and its named fields land in the header
 * slots docs/wire-format.md gives them (the bytes did not change when the
 * fields got names).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { HDR, MsgType, decodeMsg, encodeMsg, fromWire, newMsg, toWire, type CtrlMessage } from "../../src/agent/codec.js";

const hash = Uint8Array.from({ length: 16 }, (_, i) => i + 1);
const samples: CtrlMessage[] = [
  { type: MsgType.RNDV, token: 7, length: 70000, addr: 2 ** 40 + 5, rkey: 99, imm: 0xdeadbeef },
  { type: MsgType.RNDV, token: 8, length: 1, addr: 0, rkey: 1, imm: undefined },
  { type: MsgType.RNDV_DONE, token: 7, status: 1 },
  { type: MsgType.RNDV_CANCEL, token: 7 },
  { type: MsgType.CREDIT },
  { type: MsgType.PING, token: 3 },
  { type: MsgType.PONG, token: 3 },
  { type: MsgType.CLOSE },
  { type: MsgType.MR_REQUEST, token: 1, size: 4096, leaseMs: 1000, access: 14 },
  { type: MsgType.MR_GRANT, token: 1, id: 9, size: 4096, leaseMs: 900, addr: 0x1000, rkey: 5, access: 2 },
  { type: MsgType.MR_DENY, token: 1, reason: 1, value: 123, regions: 4 },
  { type: MsgType.MR_RELEASE, token: 9 },
  { type: MsgType.MR_LEND, token: 2, size: 8, leaseMs: 60000, addr: 0x2000, rkey: 6, access: 6 },
  { type: MsgType.MR_RETURN, token: 2 },
  { type: MsgType.MR_GIVE_BACK, token: 2, lent: true },
  { type: MsgType.MR_GIVE_BACK, token: 9, lent: false },
  { type: MsgType.MR_OPEN, token: 4, hash },
  { type: MsgType.MR_SHARED, token: 4, id: 11, size: 64, access: 2, addr: 0x3000, rkey: 7 },
  { type: MsgType.MR_REVOKED, token: 11 },
  { type: MsgType.MR_RENEW, token: 9, leaseMs: 500, lent: false },
  { type: MsgType.MR_RENEWED, token: 9, status: 2, leaseMs: 400 },
  { type: MsgType.LIMITS, maxLeaseMs: 3_600_000, maxMessageSize: 2 ** 32 - 1, quotaBytes: 2 ** 50, maxRegions: 1024 },
];

function roundTrip(c: CtrlMessage): { bytes: DataView; back: CtrlMessage } {
  const buf = new Uint8Array(64);
  const n = encodeMsg(buf, toWire(c));
  const m = newMsg();
  assert.equal(decodeMsg(buf, n, m), null);
  return { bytes: new DataView(buf.buffer, 0, n), back: fromWire(m) };
}

describe("control message codec (agent/codec.ts)", () => {
  it("every kind round-trips through the wire with its named fields", () => {
    const kinds = new Set<number>();
    for (const c of samples) {
      kinds.add(c.type);
      assert.deepEqual(roundTrip(c).back, c);
    }
    const control = Object.values(MsgType).filter((t) => t !== MsgType.DATA);
    assert.deepEqual([...kinds].sort((a, b) => a - b), control.sort((a, b) => a - b), "a sample of every control kind");
  });

  it("named fields sit in the documented header slots (a @16, b @20, imm @8, addr @24, rkey @32, id @36)", () => {
    const grant = roundTrip({ type: MsgType.MR_GRANT, token: 1, id: 9, size: 4096, leaseMs: 900, addr: 0x1000, rkey: 5, access: 2 }).bytes;
    assert.deepEqual([grant.getUint32(16), grant.getUint32(20), grant.getUint32(8), grant.getUint32(28), grant.getUint32(32), grant.getUint32(36)], [4096, 900, 2, 0x1000, 5, 9]);
    const limits = roundTrip({ type: MsgType.LIMITS, maxLeaseMs: 11, maxMessageSize: 22, quotaBytes: 33, maxRegions: 44 }).bytes;
    assert.deepEqual([limits.getUint32(16), limits.getUint32(20), limits.getUint32(28), limits.getUint32(32)], [11, 22, 33, 44]);
    const rndv = roundTrip({ type: MsgType.RNDV, token: 7, length: 5000, addr: 0, rkey: 1, imm: 77 }).bytes;
    assert.deepEqual([rndv.getUint32(16), rndv.getUint32(20), rndv.getUint32(8)], [5000, 1, 77], "RNDV: length in a, immediate flag in b");
    const deny = roundTrip({ type: MsgType.MR_DENY, token: 1, reason: 1, value: 123, regions: 4 }).bytes;
    assert.deepEqual([deny.getUint32(16), deny.getUint32(20), deny.getUint32(8)], [1, 123, 4]);
    const renew = roundTrip({ type: MsgType.MR_RENEW, token: 9, leaseMs: 500, lent: true }).bytes;
    assert.deepEqual([renew.getUint32(16), renew.getUint32(20), renew.byteLength], [1, 500, HDR]);
  });
});
