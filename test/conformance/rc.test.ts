/**
 * Transport conformance: the RC rules of verbs, written against the seam
 * only, so the same file runs on the tcp provider and on real verbs
 * (ASYNC_RDMA_PROVIDER=verbs inside the Soft-RoCE guest).
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { Access, QpState, SendFlags, WcFlags, WcOpcode, WcStatus, WrOpcode, wcStatusName } from "../../src/transport/types.js";
import { RdmaError } from "../../src/errors.js";
import { PROVIDER, bytes, deviates, expectNoCompletion, mr, openPair, sge, waitCompletions, type DeviationRule, type Pair } from "../support/seam.js";

async function withPair(fn: (p: Pair) => Promise<void>, opts?: Parameters<typeof openPair>[0]): Promise<void> {
  const p = await openPair(opts);
  try {
    await fn(p);
  } finally {
    p.close();
  }
}

function status(s: number): string {
  return wcStatusName(s);
}

describe(`RC conformance [${PROVIDER}]`, () => {
  it("SEND lands in the posted receive with byte_len, opcode and wr_id", () =>
    withPair(async ({ a, b }) => {
      const src = mr(a, 64);
      const dst = mr(b, 64);
      bytes(src).set([1, 2, 3, 4, 5]);
      b.qp.postRecv([{ wrId: 7, sgList: [sge(dst)] }]);
      a.qp.postSend([{ wrId: 9, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 5)] }]);
      const [rc] = await waitCompletions(b, 1);
      assert.equal(rc!.status, WcStatus.SUCCESS, status(rc!.status));
      assert.equal(rc!.wrId, 7);
      assert.equal(rc!.opcode, WcOpcode.RECV);
      assert.equal(rc!.byteLen, 5);
      assert.equal(rc!.flags & WcFlags.WITH_IMM, 0);
      assert.deepEqual([...bytes(dst).subarray(0, 6)], [1, 2, 3, 4, 5, 0]);
      const [sc] = await waitCompletions(a, 1);
      assert.equal(sc!.wrId, 9);
      assert.equal(sc!.opcode, WcOpcode.SEND);
      assert.equal(sc!.status, WcStatus.SUCCESS);
    }));

  it("delivers and places in order: 200 SENDs and WRITE-then-SEND visibility", () =>
    withPair(
      async ({ a, b }) => {
        const N = 200;
        const src = mr(a, N * 4);
        const dst = mr(b, N * 4);
        const big = mr(b, 4096);
        const bigSrc = mr(a, 4096);
        for (let i = 0; i < N; i++) new DataView(src.buffer, src.offset).setUint32(i * 4, i);
        const recvs = [];
        for (let i = 0; i < N; i++) recvs.push({ wrId: i, sgList: [sge(dst, i * 4, 4)] });
        b.qp.postRecv(recvs);
        const sends = [];
        for (let i = 0; i < N; i++) sends.push({ wrId: i, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, i * 4, 4)] });
        a.qp.postSend(sends);
        const rcs = await waitCompletions(b, N);
        rcs.forEach((c, i) => {
          assert.equal(c.status, WcStatus.SUCCESS);
          assert.equal(c.wrId, i, "receives complete in order");
          assert.equal(new DataView(dst.buffer, dst.offset).getUint32(i * 4), i);
        });
        const scs = await waitCompletions(a, N);
        scs.forEach((c, i) => assert.equal(c.wrId, i, "sends complete in order"));

        // A WRITE followed by a SEND: when the SEND's receive completes, the WRITE's data is in place.
        bytes(bigSrc).fill(0xab);
        b.qp.postRecv([{ wrId: 1000, sgList: [sge(dst, 0, 4)] }]);
        a.qp.postSend([
          { wrId: 1, opcode: WrOpcode.RDMA_WRITE, sgList: [sge(bigSrc)], remoteAddr: big.addr, rkey: big.rkey },
          { wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 4)] },
        ]);
        const [r] = await waitCompletions(b, 1);
        assert.equal(r!.wrId, 1000);
        assert.ok(bytes(big).every((x) => x === 0xab), "write placed before the later send completed");
        const [s] = await waitCompletions(a, 1);
        assert.equal(s!.wrId, 2, "the unsignaled write produced no completion");
      },
      { a: { maxSendWr: 512 }, b: { maxRecvWr: 512 } },
    ));

  it("SEND_WITH_IMM and RDMA_WRITE_WITH_IMM carry the immediate value unchanged (byte order)", () =>
    withPair(async ({ a, b }) => {
      const src = mr(a, 16);
      const dst = mr(b, 16);
      bytes(src).fill(5);
      b.qp.postRecv([{ wrId: 1, sgList: [sge(dst)] }, { wrId: 2, sgList: [] }, { wrId: 3, sgList: [] }]);
      a.qp.postSend([
        { wrId: 1, opcode: WrOpcode.SEND_WITH_IMM, imm: 0x01020304, sgList: [sge(src, 0, 8)] },
        { wrId: 2, opcode: WrOpcode.RDMA_WRITE_WITH_IMM, imm: 0xfffffffe, sgList: [sge(src, 0, 4)], remoteAddr: dst.addr + 12, rkey: dst.rkey },
        { wrId: 3, opcode: WrOpcode.RDMA_WRITE_WITH_IMM, imm: 0, sgList: [], remoteAddr: dst.addr, rkey: dst.rkey, flags: SendFlags.SIGNALED },
      ]);
      const rc = await waitCompletions(b, 3);
      assert.equal(rc[0]!.status, WcStatus.SUCCESS);
      assert.equal(rc[0]!.opcode, WcOpcode.RECV);
      assert.equal(rc[0]!.imm, 0x01020304);
      assert.equal(rc[0]!.flags & WcFlags.WITH_IMM, WcFlags.WITH_IMM);
      assert.equal(rc[0]!.byteLen, 8);
      assert.equal(rc[1]!.opcode, WcOpcode.RECV_RDMA_WITH_IMM);
      assert.equal(rc[1]!.imm, 0xfffffffe);
      assert.equal(rc[1]!.flags & WcFlags.WITH_IMM, WcFlags.WITH_IMM);
      assert.deepEqual([...bytes(dst).subarray(12, 16)], [5, 5, 5, 5]);
      assert.equal(rc[2]!.opcode, WcOpcode.RECV_RDMA_WITH_IMM, "zero-length write with immediate still consumes a receive");
      assert.equal(rc[2]!.imm, 0);
      const [sc] = await waitCompletions(a, 1);
      assert.equal(sc!.wrId, 3);
      assert.equal(sc!.opcode, WcOpcode.RDMA_WRITE);
    }));

  it("RDMA_WRITE, RDMA_READ, scatter/gather and exact-fit bounds", () =>
    withPair(async ({ a, b }) => {
      const local = mr(a, 300);
      const remote = mr(b, 100);
      for (let i = 0; i < 300; i++) bytes(local)[i] = i & 0xff;
      a.qp.postSend([
        // gather three pieces into exactly the 100 remote bytes
        { wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 10), sge(local, 50, 40), sge(local, 200, 50)], remoteAddr: remote.addr, rkey: remote.rkey },
      ]);
      const [w] = await waitCompletions(a, 1);
      assert.equal(w!.status, WcStatus.SUCCESS, status(w!.status));
      assert.equal(w!.opcode, WcOpcode.RDMA_WRITE);
      const want = [...bytes(local).subarray(0, 10), ...bytes(local).subarray(50, 90), ...bytes(local).subarray(200, 250)];
      assert.deepEqual([...bytes(remote)], want);
      bytes(remote).reverse();
      // scatter a read of all 100 bytes into two local pieces
      a.qp.postSend([{ wrId: 2, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 30), sge(local, 100, 70)], remoteAddr: remote.addr, rkey: remote.rkey }]);
      const [r] = await waitCompletions(a, 1);
      assert.equal(r!.status, WcStatus.SUCCESS, status(r!.status));
      assert.equal(r!.opcode, WcOpcode.RDMA_READ);
      const rev = want.slice().reverse();
      assert.deepEqual([...bytes(local).subarray(0, 30), ...bytes(local).subarray(100, 170)], rev);
    }));

  it("atomics: compare-and-swap and fetch-and-add return the old value", () =>
    withPair(async ({ a, b }) => {
      const local = mr(a, 16);
      const remote = mr(b, 16);
      const rv = new DataView(remote.buffer, remote.offset);
      const lv = new DataView(local.buffer, local.offset);
      rv.setBigUint64(8, 41n, true);
      a.qp.postSend([
        { wrId: 1, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 8)], remoteAddr: remote.addr + 8, rkey: remote.rkey, compareAdd: 1n },
      ]);
      let [c] = await waitCompletions(a, 1);
      assert.equal(c!.status, WcStatus.SUCCESS, status(c!.status));
      assert.equal(c!.opcode, WcOpcode.FETCH_ADD);
      assert.equal(lv.getBigUint64(0, true), 41n);
      assert.equal(rv.getBigUint64(8, true), 42n);
      a.qp.postSend([
        { wrId: 2, opcode: WrOpcode.ATOMIC_CMP_AND_SWP, flags: SendFlags.SIGNALED, sgList: [sge(local, 8, 8)], remoteAddr: remote.addr + 8, rkey: remote.rkey, compareAdd: 42n, swap: 0xffffffffffffffffn },
        { wrId: 3, opcode: WrOpcode.ATOMIC_CMP_AND_SWP, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 8)], remoteAddr: remote.addr + 8, rkey: remote.rkey, compareAdd: 42n, swap: 7n },
      ]);
      const cs = await waitCompletions(a, 2);
      c = cs[0];
      assert.equal(c!.opcode, WcOpcode.COMP_SWAP);
      assert.equal(lv.getBigUint64(8, true), 42n, "first CAS saw 42 and swapped");
      assert.equal(lv.getBigUint64(0, true), 0xffffffffffffffffn, "second CAS saw the swapped value and did not swap");
      assert.equal(rv.getBigUint64(8, true), 0xffffffffffffffffn);
      // fetch-and-add wraps at 2^64
      a.qp.postSend([{ wrId: 4, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 8)], remoteAddr: remote.addr + 8, rkey: remote.rkey, compareAdd: 2n }]);
      await waitCompletions(a, 1);
      assert.equal(rv.getBigUint64(8, true), 1n);
    }));

  it("inline SEND: the buffer may change right after postSend", () =>
    withPair(async ({ a, b }) => {
      const src = mr(a, 32);
      const dst = mr(b, 32);
      bytes(src).fill(1);
      b.qp.postRecv([{ wrId: 1, sgList: [sge(dst)] }]);
      a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED | SendFlags.INLINE, sgList: [sge(src, 0, 32)] }]);
      bytes(src).fill(2);
      await waitCompletions(b, 1);
      assert.ok(bytes(dst).every((x) => x === 1));
      await waitCompletions(a, 1);
      assert.throws(
        () => a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.INLINE, sgList: [sge(src, 0, 32), sge(src, 0, 32), sge(src, 0, 32)] }]),
        (e: unknown) => e instanceof RdmaError && e.code === "INVALID_ARGUMENT",
        "inline data above maxInlineData is refused at post",
      );
    }, { a: { maxInlineData: 64 } }));

  it("fence: a SEND fenced after a READ carries the data the READ brought", () =>
    withPair(async ({ a, b }) => {
      const local = mr(a, 64);
      const remote = mr(b, 64);
      const dst = mr(b, 64);
      bytes(remote).fill(0x5a);
      b.qp.postRecv([{ wrId: 1, sgList: [sge(dst)] }]);
      a.qp.postSend([
        { wrId: 1, opcode: WrOpcode.RDMA_READ, sgList: [sge(local)], remoteAddr: remote.addr, rkey: remote.rkey },
        { wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED | SendFlags.FENCE, sgList: [sge(local)] },
      ]);
      await waitCompletions(b, 1);
      assert.ok(bytes(dst).every((x) => x === 0x5a));
      await waitCompletions(a, 1);
    }));

  it("REMOTE_WRITE/ATOMIC without LOCAL_WRITE is refused at registration", () =>
    withPair(async ({ a }) => {
      for (const acc of [Access.REMOTE_WRITE, Access.REMOTE_ATOMIC]) {
        assert.throws(
          () => a.pd.registerMr(64, acc),
          (e: unknown) => e instanceof RdmaError && e.code === "INVALID_ARGUMENT",
        );
      }
    }));

  /**
   * `deviation`: a documented device deviation (DEVICE_DEVIATIONS) from this
   * rule; on such a device the case asserts the device's behaviour instead:
   * another completion status, or a refusal at post (INVALID_ARGUMENT).
   */
  const negative: {
    name: string;
    expect: number;
    deviation?: { rule: DeviationRule; expect: number } | { rule: DeviationRule; refusedAtPost: true };
    run: (p: Pair) => Promise<void>;
  }[] = [
    {
      name: "a write one byte past the MR end fails with REM_ACCESS_ERR",
      expect: WcStatus.REM_ACCESS_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 100);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 101)], remoteAddr: r.addr, rkey: r.rkey }]);
      },
    },
    {
      name: "a read starting before the MR fails with REM_ACCESS_ERR",
      expect: WcStatus.REM_ACCESS_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 100);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 8)], remoteAddr: r.addr - 1, rkey: r.rkey }]);
      },
    },
    {
      name: "a bad rkey fails with REM_ACCESS_ERR",
      expect: WcStatus.REM_ACCESS_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 100);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 8)], remoteAddr: r.addr, rkey: (r.rkey ^ 0x5a5a00) >>> 0 }]);
      },
    },
    {
      name: "a deregistered MR's rkey fails with REM_ACCESS_ERR",
      expect: WcStatus.REM_ACCESS_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 100);
        r.deregister();
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 8)], remoteAddr: r.addr, rkey: r.rkey }]);
      },
    },
    {
      name: "a write to an MR without REMOTE_WRITE fails with REM_ACCESS_ERR",
      expect: WcStatus.REM_ACCESS_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 100, Access.LOCAL_WRITE | Access.REMOTE_READ);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 8)], remoteAddr: r.addr, rkey: r.rkey }]);
      },
    },
    {
      name: "a read of an MR without REMOTE_READ fails with REM_ACCESS_ERR",
      expect: WcStatus.REM_ACCESS_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 100, Access.LOCAL_WRITE | Access.REMOTE_WRITE);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 8)], remoteAddr: r.addr, rkey: r.rkey }]);
      },
    },
    {
      name: "an atomic on an MR without REMOTE_ATOMIC fails with REM_ACCESS_ERR",
      expect: WcStatus.REM_ACCESS_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 64, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.ATOMIC_FETCH_AND_ADD, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 8)], remoteAddr: r.addr, rkey: r.rkey, compareAdd: 1n }]);
      },
    },
    // An atomic on an unaligned target is refused at post by every provider (transport/validate.ts,
    // checked in validation.test.ts); the tcp responder's NAK for one that a hostile peer sends
    // anyway is checked in test/tcp/hostile.test.ts.
    {
      name: "a bad lkey fails with LOC_PROT_ERR",
      expect: WcStatus.LOC_PROT_ERR,
      deviation: { rule: "rxe-lkey-status", expect: WcStatus.LOC_QP_OP_ERR },
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 64);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [{ addr: l.addr, length: 8, lkey: (l.lkey ^ 0x777700) >>> 0 }], remoteAddr: r.addr, rkey: r.rkey }]);
      },
    },
    {
      name: "a local SGE past its MR fails with LOC_PROT_ERR",
      expect: WcStatus.LOC_PROT_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128);
        const r = mr(b, 256);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(l, 64, 65)], remoteAddr: r.addr, rkey: r.rkey }]);
      },
    },
    {
      name: "a READ into an MR without LOCAL_WRITE fails with LOC_PROT_ERR",
      expect: WcStatus.LOC_PROT_ERR,
      run: async ({ a, b }) => {
        const l = mr(a, 128, Access.REMOTE_READ);
        const r = mr(b, 64);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(l, 0, 8)], remoteAddr: r.addr, rkey: r.rkey }]);
      },
    },
  ];

  for (const t of negative) {
    it(`${t.name}; the QP goes to ERR and later work is flushed`, () =>
      withPair(async (p) => {
        const dev = t.deviation && deviates(t.deviation.rule, p.a.dev) ? t.deviation : null;
        if (dev) console.log(`# device deviation [${dev.rule}] on ${p.a.dev.name} (expected, documented)`);
        if (dev && "refusedAtPost" in dev) {
          await assert.rejects(t.run(p), (e: unknown) => e instanceof RdmaError && e.code === "INVALID_ARGUMENT", "device deviation changed: update DEVICE_DEVIATIONS");
          assert.equal(p.a.qp.state, QpState.RTS, "a WR refused at post leaves the QP usable");
          return;
        }
        await t.run(p);
        const [c] = await waitCompletions(p.a, 1);
        assert.equal(status(c!.status), status(dev && "expect" in dev ? dev.expect : t.expect));
        assert.equal(c!.wrId, 1);
        assert.equal(p.a.qp.state, QpState.ERR);
        // flush after error: a later WR, even unsignaled, completes with WR_FLUSH_ERR
        const l = mr(p.a, 8);
        p.a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, sgList: [sge(l)] }]);
        p.a.qp.postRecv([{ wrId: 3, sgList: [sge(l)] }]);
        const fl = await waitCompletions(p.a, 2);
        assert.deepEqual(
          fl.map((x) => [x.wrId, status(x.status)]).sort(),
          [
            [2, "WR_FLUSH_ERR"],
            [3, "WR_FLUSH_ERR"],
          ],
        );
      }));
  }

  it("a receive buffer too small: LOC_LEN_ERR at the responder, REM_INV_REQ_ERR at the requester", () =>
    withPair(async ({ a, b }) => {
      const src = mr(a, 64);
      const dst = mr(b, 64);
      b.qp.postRecv([{ wrId: 5, sgList: [sge(dst, 0, 16)] }]);
      a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 17)] }]);
      // Documented device deviation (DEVICE_DEVIATIONS["rxe-recv-len-status"]): rxe reports other statuses.
      const dev = deviates("rxe-recv-len-status", b.dev);
      if (dev) console.log(`# device deviation [rxe-recv-len-status] on ${b.dev.name} (expected, documented)`);
      const [rc] = await waitCompletions(b, 1);
      assert.equal(status(rc!.status), dev ? "LOC_QP_OP_ERR" : "LOC_LEN_ERR");
      const [sc] = await waitCompletions(a, 1);
      assert.equal(status(sc!.status), dev ? "REM_OP_ERR" : "REM_INV_REQ_ERR");
    }));

  it("RNR: a SEND before any receive is posted is retried and succeeds once one is posted", () =>
    withPair(
      async ({ a, b }) => {
        const src = mr(a, 8);
        const dst = mr(b, 8);
        bytes(src).fill(9);
        a.qp.postSend([{ wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] }]);
        // Nothing may complete while the responder has no receive posted.
        await expectNoCompletion(a, 100 * (PROVIDER === "verbs" ? 3 : 1));
        b.qp.postRecv([{ wrId: 2, sgList: [sge(dst)] }]);
        const [rc] = await waitCompletions(b, 1);
        assert.equal(rc!.status, WcStatus.SUCCESS);
        assert.ok(bytes(dst).every((x) => x === 9));
        const [sc] = await waitCompletions(a, 1);
        assert.equal(sc!.status, WcStatus.SUCCESS, status(sc!.status));
      },
      { attrA: { rnrRetry: 7 }, attrB: { minRnrTimer: 1 } },
    ));

  it("RNR exhaustion: rnr_retry tries, then RNR_RETRY_EXC_ERR and the rest is flushed", () =>
    withPair(
      async ({ a, b }) => {
        const src = mr(a, 8);
        a.qp.postSend([
          { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] },
          { wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] },
        ]);
        const cs = await waitCompletions(a, 2);
        assert.deepEqual(
          cs.map((c) => [c.wrId, status(c.status)]),
          [
            [1, "RNR_RETRY_EXC_ERR"],
            [2, "WR_FLUSH_ERR"],
          ],
        );
        void b;
      },
      { attrA: { rnrRetry: 2 }, attrB: { minRnrTimer: 1 } },
    ));

  it("memory window type 2: bind gives an rkey for the range; after LOCAL_INV a read through it fails", () =>
    withPair(async ({ a, b }) => {
      if (b.dev.attr.maxMw === 0 || !b.dev.attr.mwTypes.includes(2)) {
        assert.fail(`device ${b.dev.name} has no type-2 memory windows: this conformance case cannot run`);
      }
      const local = mr(a, 64);
      const base = b.pd.registerMr(256, Access.LOCAL_WRITE | Access.MW_BIND | Access.REMOTE_READ);
      for (let i = 0; i < 256; i++) bytes(base)[i] = i;
      const mw = b.pd.allocMw(2);
      const rkey = mw.nextRkey();
      b.qp.postSend([{ wrId: 10, opcode: WrOpcode.BIND_MW, flags: SendFlags.SIGNALED, mw, bindRkey: rkey, bind: { mr: base, addr: base.addr + 64, length: 32, access: Access.REMOTE_READ } }]);
      const [bc] = await waitCompletions(b, 1);
      assert.equal(status(bc!.status), "SUCCESS");
      assert.equal(bc!.opcode, WcOpcode.BIND_MW);
      assert.equal(mw.rkey, rkey);
      a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 32)], remoteAddr: base.addr + 64, rkey }]);
      const [rc] = await waitCompletions(a, 1);
      assert.equal(status(rc!.status), "SUCCESS");
      assert.deepEqual([...bytes(local).subarray(0, 32)], [...bytes(base).subarray(64, 96)]);

      b.qp.postSend([{ wrId: 11, opcode: WrOpcode.LOCAL_INV, flags: SendFlags.SIGNALED, invalidateRkey: rkey }]);
      const [ic] = await waitCompletions(b, 1);
      assert.equal(status(ic!.status), "SUCCESS");
      assert.equal(ic!.opcode, WcOpcode.LOCAL_INV);
      a.qp.postSend([{ wrId: 2, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 8)], remoteAddr: base.addr + 64, rkey }]);
      const [fc] = await waitCompletions(a, 1);
      assert.equal(status(fc!.status), "REM_ACCESS_ERR");
      mw.dealloc();
    }));

  it("memory window bounds: an access past the window's end fails (rule), unless the device is a documented deviation", () =>
    withPair(async ({ a, b }) => {
      const local = mr(a, 64);
      const base = b.pd.registerMr(256, Access.LOCAL_WRITE | Access.MW_BIND | Access.REMOTE_READ);
      const mw = b.pd.allocMw(2);
      const rkey = mw.nextRkey();
      b.qp.postSend([{ wrId: 10, opcode: WrOpcode.BIND_MW, flags: SendFlags.SIGNALED, mw, bindRkey: rkey, bind: { mr: base, addr: base.addr + 64, length: 32, access: Access.REMOTE_READ } }]);
      await waitCompletions(b, 1);
      a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(local, 0, 33)], remoteAddr: base.addr + 64, rkey }]);
      const [c] = await waitCompletions(a, 1);
      if (deviates("mw-bounds", b.dev)) {
        // Documented device deviation (DEVICE_DEVIATIONS["mw-bounds"]): rxe lets it through.
        assert.equal(status(c!.status), "SUCCESS", "device deviation changed: update DEVICE_DEVIATIONS");
        console.log(`# device deviation [mw-bounds] on ${b.dev.name}: window bounds not enforced (expected, documented)`);
      } else {
        assert.equal(status(c!.status), "REM_ACCESS_ERR");
      }
      // Invalidate before the QP goes away (rxe takes ~50 s to exit otherwise).
      if (b.qp.state === QpState.RTS) {
        b.qp.postSend([{ wrId: 11, opcode: WrOpcode.LOCAL_INV, flags: SendFlags.SIGNALED, invalidateRkey: rkey }]);
        await waitCompletions(b, 1);
      }
      mw.dealloc();
    }));

  it("selective signaling: only signaled WRs complete, and they drain the queue", () =>
    withPair(
      async ({ a, b }) => {
        const l = mr(a, 64);
        const r = mr(b, 64 * 1000);
        for (let round = 0; round < 4; round++) {
          const wrs = [];
          for (let i = 0; i < 250; i++) {
            wrs.push({ wrId: round * 1000 + i, opcode: WrOpcode.RDMA_WRITE, flags: i === 249 ? SendFlags.SIGNALED : 0, sgList: [sge(l)], remoteAddr: r.addr + i * 64, rkey: r.rkey });
          }
          a.qp.postSend(wrs);
          const [c] = await waitCompletions(a, 1);
          assert.equal(c!.wrId, round * 1000 + 249);
        }
      },
      { a: { maxSendWr: 256 } },
    ));

  it("a full send queue refuses the post with RESOURCE_EXHAUSTED, naming the WR", () =>
    withPair(
      async ({ a, b }) => {
        const l = mr(a, 8);
        const r = mr(b, 8);
        const wr = (i: number) => ({ wrId: i, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(l)], remoteAddr: r.addr, rkey: r.rkey });
        assert.throws(
          () => a.qp.postSend(Array.from({ length: a.qp.caps.maxSendWr + 1 }, (_, i) => wr(i))),
          (e: unknown) => e instanceof RdmaError && e.code === "RESOURCE_EXHAUSTED",
        );
        await waitCompletions(a, a.qp.caps.maxSendWr);
      },
      { a: { maxSendWr: 16 } },
    ));
});
