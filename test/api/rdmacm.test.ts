/**
 * RDMA CM specific behaviour: private-data codec, rejects (by the library and
 * by a raw CM peer), no listener, unreachable addresses, timeouts and abort,
 * DISCONNECTED failing an established connection (a CM disconnect without the
 * library's CLOSE, and kill -9 of the peer with keepalive off, so only the
 * CM can notice).
 *
 * The CM tests run with ASYNC_RDMA_PROVIDER=verbs ASYNC_RDMA_CM=rdmacm (npm
 * run test:verbs does); elsewhere they are skipped, loudly. The codec and
 * validation tests run everywhere.
 */
import { describe, it, before } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { RdmaBuilder, RdmaError } from "../../src/index.js";
import { cmIdOf } from "../../src/api/establish/rdmacm.js";
import { decodeHello, decodeReject, encodeHello, encodeReject } from "../../src/api/establish/rdmacm-wire.js";
import { PROTOCOL_VERSION } from "../../src/api/establish/protocol.js";
import type { CmId } from "../../src/transport/types.js";
import { CM, HOST, PROVIDER, apiPair, at, builder } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const peer = join(dirname(fileURLToPath(import.meta.url)), "..", "support", "api-peer.js");
const ACTIVE = PROVIDER === "verbs" && CM === "rdmacm";
const SKIP = ACTIVE ? false : `RDMA CM tests need ASYNC_RDMA_PROVIDER=verbs ASYNC_RDMA_CM=rdmacm (have provider ${PROVIDER}, connection manager ${CM}); npm run test:verbs runs them`;
if (!ACTIVE) console.warn(`\n*** SKIPPED: test/api/rdmacm.test.ts RDMA CM tests: ${SKIP as string} ***\n`);

function code(c: string, re?: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `expected RdmaError, got ${String(e)}`);
    assert.equal(e.code, c, e.message);
    if (re) assert.match(e.message, re);
    return true;
  };
}

/** A TCP port nobody listens on (the RDMA CM port space is separate, and as empty). */
function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.listen(0, "127.0.0.1", () => {
      const p = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(p));
    });
  });
}

describe(`RDMA CM private data [${PROVIDER}, ${CM}]`, () => {
  it("hello round-trips, fits RC's 56 bytes, and is validated field by field", () => {
    const b = encodeHello(1, { psn: 0xabcdef, recvDepth: 32, eagerMax: 4096 });
    assert.ok(b.length <= 56);
    // IB pads private data: trailing zeros are ignored
    const padded = new Uint8Array(56);
    padded.set(b);
    assert.deepEqual(decodeHello(padded, 1), { psn: 0xabcdef, recvDepth: 32, eagerMax: 4096 });
    assert.throws(() => decodeHello(padded, 2), code("PROTOCOL", /kind/));
    assert.throws(() => decodeHello(null, 1), code("PROTOCOL", /missing/));
    assert.throws(() => decodeHello(new Uint8Array(56), 1), code("PROTOCOL", /not an async-rdma hello/));
    assert.throws(() => decodeHello(encodeHello(1, { psn: 1, recvDepth: 32, eagerMax: 0 }, 99), 1), code("PROTOCOL", /version mismatch.*99.*1/));
    assert.throws(() => decodeHello(encodeHello(1, { psn: 1, recvDepth: 2, eagerMax: 0 }), 1), code("PROTOCOL", /recvDepth/));
    assert.throws(() => decodeHello(encodeHello(1, { psn: 1, recvDepth: 32, eagerMax: 2 ** 30 }), 1), code("PROTOCOL", /eagerMax/));
    assert.throws(() => decodeHello(b.subarray(0, 12), 1), code("PROTOCOL", /truncated/));
    assert.equal(PROTOCOL_VERSION, b[4]);
  });

  it("reject reasons round-trip, are cut to fit REJ's 148 bytes on a character boundary, and garbage is not ours", () => {
    assert.deepEqual(decodeReject(encodeReject(1, "go away")), { code: 1, reason: "go away" });
    const long = encodeReject(2, "é".repeat(200));
    assert.ok(long.length <= 148);
    const r = decodeReject(long)!;
    assert.equal(r.code, 2);
    assert.match(r.reason, /^é+$/);
    assert.equal(decodeReject(new Uint8Array(148)), null);
    assert.equal(decodeReject(null), null);
  });

  it('"rdmacm" with the tcp provider is INVALID_ARGUMENT with a clear message; bad values are refused', async () => {
    await assert.rejects(new RdmaBuilder().setProvider("tcp").setConnectionManager("rdmacm").connect("127.0.0.1:1"), code("INVALID_ARGUMENT", /needs the verbs provider.*setConnectionManager\("tcp"\)/));
    await assert.rejects(new RdmaBuilder().setProvider("tcp").setConnectionManager("rdmacm").bind("127.0.0.1:0"), code("INVALID_ARGUMENT", /needs the verbs provider/));
    assert.throws(() => new RdmaBuilder().setConnectionManager("ib" as never), code("INVALID_ARGUMENT", /"tcp" or "rdmacm"/));
  });
});

describe(`RDMA CM connections [${PROVIDER}, ${CM}]`, { skip: SKIP }, () => {
  type CmModule = typeof import("../../src/transport/verbs/cm.js");
  let cm: CmModule;
  before(async () => {
    cm = await import("../../src/transport/verbs/cm.js");
  });

  /** A raw RDMA CM listener on HOST that answers every request with `answer`. */
  async function rawListener(answer: (child: CmId) => void): Promise<{ port: number; children: CmId[]; close(): void }> {
    const id = cm.CmId.create();
    const children: CmId[] = [];
    id.bind(HOST, 0);
    id.listen(8);
    id.onEvent = (e) => {
      if (e.child) {
        children.push(e.child);
        answer(e.child);
      }
    };
    return {
      port: id.info().localPort,
      children,
      close() {
        for (const c of children) c.destroy();
        id.destroy();
      },
    };
  }

  it("garbage arguments to the native CM surface throw, never crash", () => {
    const a = cm.cmAddon();
    const id = cm.CmId.create();
    const dead = cm.CmId.create();
    dead.destroy();
    const junk: unknown[] = [undefined, null, 0, -1, 2 ** 40, "x", {}, [], new ArrayBuffer(300), new Uint8Array(300), dead.handle, () => 0];
    const fns = ["bindAddr", "listen", "resolveAddr", "resolveRoute", "connect", "accept", "establish", "reject", "disconnect", "destroyId", "info", "initQpAttr"] as const;
    let threw = 0;
    for (const f of fns) {
      for (const j of junk) {
        for (const args of [[j], [id.handle, j], [id.handle, j, j, j, j, j, j], [j, j, j]]) {
          try {
            (a[f] as (...x: unknown[]) => unknown)(...args);
          } catch (e) {
            threw++;
            assert.ok(e instanceof Error, `${f}: ${String(e)}`);
          }
        }
      }
    }
    assert.ok(threw > 100);
    // the id survived all that unless a call legitimately consumed it
    id.destroy();
  });

  it("the listener binds to the rxe address and reports it", async () => {
    const l = await builder("server").bind(at(0));
    try {
      assert.equal(l.address().host, HOST);
      assert.ok(l.port > 0);
    } finally {
      await l.close();
    }
  });

  it("no listener on the port: CONNECTION_REFUSED", async () => {
    const port = await freePort();
    await assert.rejects(builder().connect(at(port)), code("CONNECTION_REFUSED", /refused/));
  });

  it("a peer's reject reaches connect as CONNECTION_REFUSED with its reason", async () => {
    const raw = await rawListener((c) => c.reject(encodeReject(1, "not today")));
    try {
      await assert.rejects(builder().connect(at(raw.port)), code("CONNECTION_REFUSED", /not today/));
      // a reject without our private data still names the CM's reason
      const plain = await rawListener((c) => c.reject(null));
      try {
        await assert.rejects(builder().connect(at(plain.port)), code("CONNECTION_REFUSED", /REJECTED/));
      } finally {
        plain.close();
      }
    } finally {
      raw.close();
    }
  });

  it("a server rejects a bad client hello (garbage, wrong version) with the reason and keeps serving", async () => {
    const listener = await builder("server").bind(at(0));
    try {
      for (const [pdata, re] of [
        [new Uint8Array([1, 2, 3, 4, 5, 6, 7, 8]), /not an async-rdma hello/],
        [encodeHello(1, { psn: 1, recvDepth: 32, eagerMax: 0 }, 99), /version mismatch/],
      ] as const) {
        const id = cm.CmId.create();
        try {
          id.resolveAddr(null, HOST, listener.port, 2000 * SLOW);
          assert.equal((await id.next("resolve addr", 5000 * SLOW)).name, "ADDR_RESOLVED");
          id.resolveRoute(2000 * SLOW);
          assert.equal((await id.next("resolve route", 5000 * SLOW)).name, "ROUTE_RESOLVED");
          // any QP number: the server refuses before touching it
          id.connect(0x123, pdata, { responderResources: 1, initiatorDepth: 1, retryCount: 7, rnrRetryCount: 7 });
          const ev = await id.next("connect", 5000 * SLOW);
          assert.equal(ev.name, "REJECTED");
          const r = decodeReject(ev.privateData);
          assert.ok(r, "the reject carries our reason");
          assert.equal(r.code, 2);
          assert.match(r.reason, re);
        } finally {
          id.destroy();
        }
      }
      assert.equal(listener.rejected.length, 2);
      assert.ok(listener.rejected.every((e) => e.code === "PROTOCOL"));
      const [c, s] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 10_000 * SLOW })]);
      using m = c.allocLocalMr(2);
      m.bytes.set([4, 2]);
      await c.send(m);
      using got = await s.receive();
      assert.deepEqual([...got.bytes], [4, 2]);
      await Promise.all([c.close(), s.close()]);
    } finally {
      await listener.close();
    }
  });

  it("a server that replies with another protocol version: PROTOCOL naming both versions", async () => {
    const raw = await rawListener((c) => c.reject(encodeReject(2, `protocol version mismatch: the peer speaks ${PROTOCOL_VERSION}, this side 99; upgrade the older side`)));
    try {
      await assert.rejects(builder().connect(at(raw.port)), code("PROTOCOL", /version mismatch/));
    } finally {
      raw.close();
    }
  });

  it("unreachable addresses: CONNECTION_REFUSED naming the step; a silent one: TIMEOUT", async () => {
    // no route (TEST-NET-1): address resolution fails
    await assert.rejects(builder().setConnectTimeout(5000 * SLOW).connect("192.0.2.1:7471"), code("CONNECTION_REFUSED", /address resolution \(rdma_resolve_addr\)/));
    // loopback has no rxe device: route resolution fails
    await assert.rejects(builder().setConnectTimeout(5000 * SLOW).connect("127.0.0.1:7471"), code("CONNECTION_REFUSED", /resolution/));
    // on the rxe subnet but nobody there: the neighbour lookup fails (veth) or, on a NOARP
    // dummy netdev, the REQ goes nowhere until the deadline
    await assert.rejects(builder().setConnectTimeout(1000 * SLOW).connect(`${HOST.replace(/\.\d+$/, ".99")}:7471`), (e: unknown) => {
      assert.ok(e instanceof RdmaError && (e.code === "TIMEOUT" || e.code === "CONNECTION_REFUSED"), String(e));
      return true;
    });
  });

  it("a listener that never answers: TIMEOUT at the deadline, ABORTED on abort", async () => {
    const raw = await rawListener(() => {});
    try {
      await assert.rejects(builder().setConnectTimeout(300 * SLOW).connect(at(raw.port)), code("TIMEOUT", /timed out during connection/));
      await assert.rejects(builder().connect(at(raw.port), { signal: AbortSignal.timeout(200 * SLOW) }), code("ABORTED"));
    } finally {
      raw.close();
    }
  });

  it("DISCONNECTED (no CLOSE from the library) fails the established connection with CONNECTION_CLOSED", async () => {
    const p = await apiPair({ server: (b) => b.setKeepalive(0), client: (b) => b.setKeepalive(0) });
    try {
      const pending = p.server.receive();
      const id = cmIdOf.get(p.client);
      assert.ok(id, "the client has a CM id");
      id.disconnect();
      await assert.rejects(pending, code("CONNECTION_CLOSED", /disconnected \(RDMA CM DISCONNECTED\)/));
      // the client learns it from its own CM id too
      await assert.rejects(p.client.receive(), code("CONNECTION_CLOSED"));
    } finally {
      await p.close();
    }
  });

  it("kill -9 of the peer is noticed through the CM (keepalive off): CONNECTION_CLOSED", async () => {
    const listener = await builder("server").setKeepalive(0).bind(at(0));
    const child = spawn(process.execPath, [peer, at(listener.port)], { stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, ASYNC_RDMA_CM: "rdmacm" } });
    try {
      await new Promise<void>((resolve, reject) => {
        child.stdout.on("data", (d: Buffer) => d.toString().includes("connected") && resolve());
        child.once("exit", (c) => reject(new Error(`peer exited early (${c})`)));
      });
      const rdma = await listener.accept({ timeoutMs: 10_000 * SLOW });
      const pending = rdma.receive();
      child.kill("SIGKILL");
      await assert.rejects(pending, code("CONNECTION_CLOSED", /DISCONNECTED/));
      await rdma.close();
    } finally {
      child.kill("SIGKILL");
      await listener.close();
    }
  });
});
