/**
 * Issue 9, point 10: streams that connect to a tcp device's port and never
 * say HELLO are bounded per source and in time, so a legitimate client always
 * gets through. The silent streams come from other loopback addresses
 * (127.0.0.2 and up: Linux routes all of 127/8 to lo), the legitimate QPs
 * from 127.0.0.1.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import { SendFlags, WrOpcode, wcStatusName, type QpConnectAttr } from "../../src/transport/types.js";
import { tcpProvider, type TcpDevice } from "../../src/transport/tcp/index.js";
import { sourceKey } from "../../src/transport/tcp/accept.js";
import { ALL_REMOTE, DEADLINE_MS, bytes, makeSide, sge, waitCompletions } from "../support/seam.js";

const HOST = "127.0.0.1";
const ATTR: QpConnectAttr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };

const opened: { close(): void }[] = [];
after(() => {
  for (const o of opened.splice(0)) o.close();
});

async function open(): Promise<TcpDevice> {
  const dev = (await tcpProvider.openDevice("tcp-silent", { host: HOST })) as TcpDevice;
  opened.push(dev);
  return dev;
}

/** Resolves once `cond()` holds, re-checking on every poke and every `pollMs`; rejects after `ms`. */
function until(cond: () => boolean, what: string, ms: number, pollMs = 5): Promise<void> {
  return new Promise((resolve, reject) => {
    const check = (): void => {
      if (!cond()) return;
      clearInterval(iv);
      clearTimeout(t);
      resolve();
    };
    const iv = setInterval(check, pollMs);
    const t = setTimeout(() => {
      clearInterval(iv);
      reject(new Error(`timed out after ${ms} ms waiting for ${what}`));
    }, ms);
    check();
  });
}

/** `n` connections to `port` from `localAddress` that never send a byte. */
async function silent(port: number, localAddress: string, n: number): Promise<{ socks: net.Socket[]; closed(): number; close(): void }> {
  const socks: net.Socket[] = [];
  let closed = 0;
  for (let i = 0; i < n; i += 200) {
    await Promise.all(
      Array.from(
        { length: Math.min(200, n - i) },
        () =>
          new Promise<void>((resolve) => {
            const s = net.connect({ host: HOST, port, localAddress });
            s.on("error", () => {});
            s.once("connect", () => resolve());
            // The device may evict it before our side has seen the connection complete.
            s.once("close", () => {
              closed++;
              resolve();
            });
            socks.push(s);
          }),
      ),
    );
  }
  const o = { socks, closed: () => closed, close: () => socks.forEach((s) => s.destroy()) };
  opened.push(o);
  return o;
}

/** A QP on `dev` and one on a fresh device, connected both ways, move data both ways. */
async function legitimatePair(dev: TcpDevice): Promise<void> {
  const other = await open();
  const a = makeSide(dev);
  const b = makeSide(other);
  a.qp.connect(b.qp.localEndpoint(), ATTR);
  b.qp.connect(a.qp.localEndpoint(), ATTR);
  const ma = a.pd.registerMr(4096, ALL_REMOTE);
  const mb = b.pd.registerMr(4096, ALL_REMOTE);
  bytes(ma).fill(0xa1);
  bytes(mb).fill(0xb2);
  // b's stream to dev is the one the silent streams compete with: b → a WRITE, then a → b WRITE.
  b.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(mb, 0, 1024)], remoteAddr: ma.addr + 2048, rkey: ma.rkey }]);
  a.qp.postSend([{ wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(ma, 0, 1024)], remoteAddr: mb.addr + 2048, rkey: mb.rkey }]);
  const [wb] = await waitCompletions(b, 1, DEADLINE_MS * 2);
  const [wa] = await waitCompletions(a, 1, DEADLINE_MS * 2);
  assert.equal(wcStatusName(wb!.status), "SUCCESS", "the legitimate client's first operation");
  assert.equal(wcStatusName(wa!.status), "SUCCESS");
  assert.ok(bytes(ma).subarray(2048, 3072).every((x) => x === 0xb2));
  assert.ok(bytes(mb).subarray(2048, 3072).every((x) => x === 0xa1));
}

describe("silent streams on the device port [tcp, issue 9 #10]", () => {
  it("4,200 silent streams from one source: it keeps at most 64 pending, a legitimate client gets through, the rest go at the HELLO deadline", async () => {
    const dev = await open();
    dev.helloTimeoutMs = 1_500; // short, so the test sees the deadline; the default is documented
    const flood = await silent(dev.port, "127.0.0.2", 4_200);
    // Every stream beyond the per-source bound evicted an older one of the same source.
    await until(() => flood.closed() >= 4_200 - dev.maxPendingHelloPerSource, "the device to evict the excess silent streams", DEADLINE_MS * 3);
    assert.ok(dev.pendingHello.countOf("127.0.0.2") <= dev.maxPendingHelloPerSource, `${dev.pendingHello.countOf("127.0.0.2")} pending from 127.0.0.2`);
    await legitimatePair(dev);
    // The survivors are dropped at the deadline.
    await until(() => flood.closed() === 4_200, "the HELLO deadline to drop every silent stream", dev.helloTimeoutMs + DEADLINE_MS * 3);
    assert.equal(dev.pendingHello.size, 0);
    assert.ok(dev.pendingHello.timedOut >= 1, "some were dropped by the deadline");
  });

  it("silent streams from many sources: the total stays bounded, and a new source still gets a slot", async () => {
    const dev = await open();
    // Small bounds keep the test short; the mechanism is the same at the defaults (4096 total, 64 per source).
    dev.maxPendingHello = 128;
    dev.maxPendingHelloPerSource = 32;
    const floods: Awaited<ReturnType<typeof silent>>[] = [];
    for (let i = 0; i < 8; i++) floods.push(await silent(dev.port, `127.0.0.${10 + i}`, 32));
    const total = (): number => floods.reduce((n, f) => n + f.closed(), 0);
    await until(() => total() >= 8 * 32 - 128, "the device to evict down to its total bound", DEADLINE_MS * 2);
    assert.ok(dev.pendingHello.size <= 128, `${dev.pendingHello.size} pending`);
    await legitimatePair(dev);
    for (const f of floods) f.close();
    await until(() => dev.pendingHello.size === 0, "the closed streams to leave the table", DEADLINE_MS);
  });

  it("source keys: IPv4, IPv4-mapped IPv6, and IPv6 by /64", () => {
    assert.equal(sourceKey("10.1.2.3"), "10.1.2.3");
    assert.equal(sourceKey("::ffff:10.1.2.3"), "10.1.2.3");
    assert.equal(sourceKey("2001:db8:1:2:aaaa::1"), sourceKey("2001:db8:1:2::ffff:3"));
    assert.notEqual(sourceKey("2001:db8:1:2::1"), sourceKey("2001:db8:1:3::1"));
    assert.equal(sourceKey("::1"), "0:0:0:0::/64");
    assert.equal(sourceKey("fe80::1%eth0"), "fe80:0:0:0::/64");
    assert.equal(sourceKey(undefined), "?");
  });
});
