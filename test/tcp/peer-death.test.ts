/**
 * Peer death and silent peers: the other side of the QP is a real tcp QP in a
 * child process (test/support/seam-peer.ts, endpoints exchanged as JSON lines
 * on its stdin/stdout). After a successful exchange of data the child is
 * killed (-9) or stopped (SIGSTOP: the TCP connection stays up, no FIN, the
 * peer just goes quiet), and the parent's outstanding work must fail the way
 * verbs fails it, within a bounded time.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import {
  Access,
  QpState,
  SendFlags,
  WcOpcode,
  WcStatus,
  WrOpcode,
  wcStatusName,
  type AsyncEvent,
  type Device,
  type Endpoint,
  type MemoryRegion,
  type QpConnectAttr,
  type WorkCompletion,
} from "../../src/transport/types.js";
import { ackTimeoutMs } from "../../src/transport/tcp/codec.js";
import { tcpProvider } from "../../src/transport/tcp/index.js";
import { DEADLINE_MS, bytes, makeSide, sge, waitCompletions, type Side } from "../support/seam.js";
import { Channel, pattern, type Regions } from "../support/seam-peer.js";

const PEER = fileURLToPath(new URL("../support/seam-peer.js", import.meta.url));
const BYTES = 64 * 1024;
const SEED = 77;
const ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ;

const children = new Set<ChildProcess>();
const cleanups: (() => void)[] = [];
after(() => {
  for (const c of children) killChild(c);
  for (const c of cleanups.splice(0)) {
    try {
      c();
    } catch {
      /* best effort */
    }
  }
});

function alive(c: ChildProcess): boolean {
  return c.exitCode === null && c.signalCode === null;
}

function killChild(c: ChildProcess): void {
  if (!alive(c) || c.pid === undefined) return;
  try {
    process.kill(c.pid, "SIGCONT");
  } catch {
    /* gone */
  }
  c.kill("SIGKILL");
}

function deadline<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let t: NodeJS.Timeout;
  return Promise.race([
    p.finally(() => clearTimeout(t)),
    new Promise<T>((_, reject) => {
      t = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
    }),
  ]);
}

/** Re-checks `cond` every millisecond until it holds; rejects after `ms`. (For state only the kernel or the provider knows.) */
function poll(cond: () => boolean, what: string, ms = DEADLINE_MS): Promise<void> {
  return deadline(
    new Promise<void>((resolve) => {
      const check = (): void => {
        if (cond()) resolve();
        else t = setTimeout(check, 1);
      };
      let t: NodeJS.Timeout | undefined;
      check();
      cleanups.push(() => clearTimeout(t));
    }),
    ms,
    what,
  );
}

/** Process state letter from /proc (R, S, T = stopped, Z...). */
function procState(pid: number): string {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat.slice(stat.lastIndexOf(")") + 2).split(" ")[0] ?? "?";
  } catch {
    return "gone";
  }
}

async function stopChild(c: ChildProcess): Promise<void> {
  process.kill(c.pid!, "SIGSTOP");
  // The signal is asynchronous: only a stopped child is guaranteed not to answer any more.
  await poll(() => procState(c.pid!) === "T" || procState(c.pid!) === "t", `child ${c.pid} to stop`);
}

interface Peer {
  child: ChildProcess;
  ch: Channel;
  dev: Device;
  side: Side;
  events: AsyncEvent[];
  /** Parent-side regions: source of our SENDs/WRITEs, landing zones. */
  src: MemoryRegion;
  land: MemoryRegion;
  remote: Regions;
  /** The child's src bytes (same seed). */
  childSrc: Uint8Array;
  exited: Promise<void>;
  close(): void;
}

/**
 * Starts a child peer, connects our QP to it (attr for our side; childAttr for
 * its side, e.g. its RNR timer) and checks that data moves both ways.
 */
async function startPeer(attr: QpConnectAttr, childAttr: QpConnectAttr = {}, exchange: "both" | "child-only" = "both", size = BYTES): Promise<Peer> {
  const child = spawn(process.execPath, [PEER, "serve", "--host", "127.0.0.1", "--bytes", String(size), "--seed", String(SEED)], {
    stdio: ["pipe", "pipe", "inherit"],
  });
  children.add(child);
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const ch = new Channel(child.stdout!, child.stdin!);
  child.stdin!.on("error", () => {});
  const ready = await deadline(ch.next("ready", DEADLINE_MS * 2), DEADLINE_MS * 2, "the peer's ready line");
  assert.ok(ready, "the peer exited before it was ready");

  const dev = await tcpProvider.openDevice("tcp-parent", { host: "127.0.0.1" });
  const side = makeSide(dev);
  const events: AsyncEvent[] = [];
  side.qp.onEvent = (e) => events.push(e);
  const src = side.pd.registerMr(size, ACCESS);
  const land = side.pd.registerMr(size, ACCESS);
  pattern(bytes(src), 0xabc);
  const close = (): void => {
    killChild(child);
    dev.close();
  };
  cleanups.push(close);

  side.qp.connect(ready.endpoint as Endpoint, attr);
  side.qp.postRecv([{ wrId: 500, sgList: [sge(land, 0, 1024)] }]);
  ch.send({
    type: "connect",
    endpoint: side.qp.localEndpoint(),
    regions: { src: { addr: src.addr, rkey: src.rkey, length: size }, write: { addr: land.addr, rkey: land.rkey, length: size } },
    chunk: size,
    attr: childAttr,
  });
  await deadline(ch.next("connected"), DEADLINE_MS, "the peer to connect");
  const childSrc = new Uint8Array(size);
  pattern(childSrc, SEED);
  const remote = ready.regions as Regions;

  // The child SENDs to us: its first KiB lands in our posted receive.
  ch.send({ type: "send", wrId: 900_001, offset: 0, length: 1024 });
  const sent = await deadline(ch.next("sent"), DEADLINE_MS, "the child's SEND");
  assert.equal(sent!.status, "SUCCESS");
  const [rc] = await waitCompletions(side, 1);
  assert.equal(rc!.wrId, 500);
  assert.equal(wcStatusName(rc!.status), "SUCCESS");
  assert.deepEqual(bytes(land).subarray(0, 1024), childSrc.subarray(0, 1024));

  if (exchange === "both") {
    // We SEND (into its only receive), WRITE into its write region and READ its src.
    side.qp.postSend([
      { wrId: 11, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src, 0, 4096)] },
      { wrId: 12, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(src, 4096, 4096)], remoteAddr: remote.write.addr, rkey: remote.write.rkey },
      { wrId: 13, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(land, 8192, 8192)], remoteAddr: remote.src.addr + 100, rkey: remote.src.rkey },
    ]);
    const wcs = await waitCompletions(side, 3);
    assert.equal(wcs.map((c) => `${c.wrId}:${wcStatusName(c.status)}`).join(" "), "11:SUCCESS 12:SUCCESS 13:SUCCESS");
    assert.deepEqual(bytes(land).subarray(8192, 16384), childSrc.subarray(100, 8292), "READ brought the child's bytes");
  } else {
    // Only the child's requester works (our requester stays idle): it moves its whole src into us three ways.
    side.qp.postRecv([{ wrId: 501, sgList: [sge(land)] }]);
    ch.send({ type: "run", chunk: size });
    const ran = await deadline(ch.next("ran"), DEADLINE_MS, "the child's traffic");
    assert.equal(ran!.ok, true, JSON.stringify(ran));
    const [rc2] = await waitCompletions(side, 1);
    assert.equal(rc2!.wrId, 501);
    assert.equal(wcStatusName(rc2!.status), "SUCCESS");
    assert.deepEqual(bytes(land), childSrc, "the child's SEND and WRITE both carried its src");
  }
  assert.equal(side.qp.state, QpState.RTS);
  assert.deepEqual(events, []);
  return { child, ch, dev, side, events, src, land, remote, childSrc, exited, close };
}

function split(wcs: WorkCompletion[]): { send: string; recv: string } {
  const f = (xs: WorkCompletion[]): string => xs.map((c) => `${c.wrId}:${wcStatusName(c.status)}`).join(" ");
  return { send: f(wcs.filter((c) => c.opcode !== WcOpcode.RECV)), recv: f(wcs.filter((c) => c.opcode === WcOpcode.RECV)) };
}

describe("peer death [tcp, child process]", () => {
  it("kill -9 with sends outstanding: the first fails RETRY_EXC_ERR, the rest and the posted receives flush, promptly", async () => {
    // A long ACK timeout (4.3 s × 8): within the deadline only the death itself can fail the work.
    const p = await startPeer({ timeout: 20, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 });
    try {
      await stopChild(p.child); // so nothing below can be acknowledged before the kill
      p.side.qp.postRecv([
        { wrId: 600, sgList: [sge(p.land, 0, 64)] },
        { wrId: 601, sgList: [sge(p.land, 64, 64)] },
      ]);
      p.side.qp.postSend([
        { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 1000)] },
        { wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 1000)], remoteAddr: p.remote.write.addr, rkey: p.remote.write.rkey },
        { wrId: 3, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.land, 1024, 100)], remoteAddr: p.remote.src.addr, rkey: p.remote.src.rkey },
      ]);
      const t0 = performance.now();
      p.child.kill("SIGKILL");
      await deadline(p.exited, DEADLINE_MS, "the child to die");
      const wcs = await waitCompletions(p.side, 5);
      const elapsed = performance.now() - t0;
      const { send, recv } = split(wcs);
      assert.equal(send, "1:RETRY_EXC_ERR 2:WR_FLUSH_ERR 3:WR_FLUSH_ERR");
      assert.equal(recv, "600:WR_FLUSH_ERR 601:WR_FLUSH_ERR");
      assert.ok(elapsed < 2000, `the death was noticed after ${elapsed.toFixed(0)} ms`);
      assert.equal(p.side.qp.state, QpState.ERR);
      // Later work flushes at once.
      p.side.qp.postSend([{ wrId: 4, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 8)] }]);
      const [late] = await waitCompletions(p.side, 1);
      assert.equal(`${late!.wrId}:${wcStatusName(late!.status)}`, "4:WR_FLUSH_ERR");
    } finally {
      p.close();
    }
  });

  it(
    "kill -9 while the send waits out an RNR NAK: it fails RETRY_EXC_ERR (not a bare flush)",
    async () => {
      // The child answers with its longest RNR timer (code 0 = 655 ms): the death comes in the middle of the wait.
      const p = await startPeer({ timeout: 20, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 }, { minRnrTimer: 0 });
      try {
        // The child's only receive was used by the exchange: this SEND is refused with RNR NAK.
        p.side.qp.postSend([
          { wrId: 1, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 100)] },
          { wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 100)] },
        ]);
        const qpi = p.side.qp as unknown as { rnrWait: unknown };
        await poll(() => qpi.rnrWait !== null, "the RNR NAK");
        const t0 = performance.now();
        p.child.kill("SIGKILL");
        const wcs = await waitCompletions(p.side, 2);
        const elapsed = performance.now() - t0;
        assert.equal(split(wcs).send, "1:RETRY_EXC_ERR 2:WR_FLUSH_ERR");
        assert.ok(elapsed < 600, `noticed after ${elapsed.toFixed(0)} ms: the death, not the RNR timer, must end the wait`);
      } finally {
        p.close();
      }
    },
  );

  // A silent peer is tolerated for max(timeout × (retryCnt+1), livenessMs); set low here so the test stays short.
  const TIMEOUT = 10;
  const RETRY = 2;
  const LIVENESS = 300;
  const LIMIT = Math.max(ackTimeoutMs(TIMEOUT) * (RETRY + 1), LIVENESS);

  it(`silent peer (SIGSTOP, connection up): RETRY_EXC_ERR after the configured bound max(timeout × (retryCnt+1), livenessMs) = ${LIMIT} ms`, async () => {
    const p = await startPeer({ timeout: TIMEOUT, retryCnt: RETRY, rnrRetry: 7, minRnrTimer: 1, livenessMs: LIVENESS }, {}, "child-only");
    try {
      await stopChild(p.child);
      p.side.qp.postSend([
        { wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 4096)], remoteAddr: p.remote.write.addr, rkey: p.remote.write.rkey },
        { wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 4096, 4096)], remoteAddr: p.remote.write.addr + 4096, rkey: p.remote.write.rkey },
        { wrId: 3, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.land, 0, 64)], remoteAddr: p.remote.src.addr, rkey: p.remote.src.rkey },
      ]);
      const t0 = performance.now();
      // Bounded: the deadline is the limit plus generous slack for a loaded machine.
      const wcs = await waitCompletions(p.side, 3, LIMIT + DEADLINE_MS);
      const elapsed = performance.now() - t0;
      assert.equal(split(wcs).send, "1:RETRY_EXC_ERR 2:WR_FLUSH_ERR 3:WR_FLUSH_ERR");
      // Never before the configured bound: a silent peer gets all of it.
      assert.ok(elapsed >= LIMIT, `RETRY_EXC_ERR after ${elapsed.toFixed(1)} ms, before the ${LIMIT} ms bound`);
      assert.equal(p.side.qp.state, QpState.ERR);
      assert.equal(p.events.length, 1, JSON.stringify(p.events));
      assert.equal(p.events[0]!.type, "QP_FATAL");
      assert.match(p.events[0]!.reason, new RegExp(`no response from the peer within ${LIMIT} ms \\(livenessMs ${LIVENESS}`));
      assert.ok(alive(p.child), "the child is still there (stopped), its connection never closed");
    } finally {
      p.close();
    }
  });

  it(
    "silent peer after an idle spell: the ACK timeout runs from the transmission, not from the last ACK",
    async () => {
      const p = await startPeer({ timeout: TIMEOUT, retryCnt: RETRY, rnrRetry: 7, minRnrTimer: 1, livenessMs: LIVENESS }, {}, "child-only");
      try {
        await stopChild(p.child);
        // Our requester has been idle since connect() (child-only exchange, process start-up, SIGSTOP): far longer than LIMIT.
        const t0 = performance.now();
        p.side.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 64)], remoteAddr: p.remote.write.addr, rkey: p.remote.write.rkey }]);
        const [wc] = await waitCompletions(p.side, 1, LIMIT + DEADLINE_MS);
        const elapsed = performance.now() - t0;
        assert.equal(wcStatusName(wc!.status), "RETRY_EXC_ERR");
      assert.ok(elapsed >= LIMIT, `RETRY_EXC_ERR after ${elapsed.toFixed(1)} ms, before the ${LIMIT} ms bound`);
      } finally {
        p.close();
      }
    },
  );

  it("the peer program exits by itself when its control channel closes (no orphans)", async () => {
    const child = spawn(process.execPath, [PEER, "serve", "--host", "127.0.0.1", "--bytes", "4096"], { stdio: ["pipe", "pipe", "inherit"] });
    children.add(child);
    const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
    const ch = new Channel(child.stdout!, child.stdin!);
    await deadline(ch.next("ready", DEADLINE_MS * 2), DEADLINE_MS * 2, "ready");
    child.stdin!.end();
    assert.equal(await deadline(exited, DEADLINE_MS, "the child to exit"), 0);
  });
});

/**
 * Issue 9, point 14: the peer's ACKs come from its event loop, so a stall of
 * that loop (synchronous work, a long GC pause) must not end a healthy
 * connection. With default attributes (timeout 14 × 8 tries = 537 ms, and the
 * default livenessMs of 15 s) a 5 s blocked event loop on either side,
 * mid-transfer, is survived and the transfer completes.
 */
describe("event-loop stalls [tcp, child process]", () => {
  const STALL_MS = 5_000;
  const BIG = 32 * 1024 * 1024;
  const DEFAULTS: QpConnectAttr = { timeout: 14, retryCnt: 7, rnrRetry: 7, minRnrTimer: 1 };

  it("the peer's event loop blocked for 5 s while our 32 MiB WRITE and READ are in flight: both complete, the connection lives on", async () => {
    const p = await startPeer(DEFAULTS, {}, "both", BIG);
    try {
      p.ch.send({ type: "block", ms: STALL_MS });
      await deadline(p.ch.next("blocking"), DEADLINE_MS, "the child to block");
      // The child cannot answer now: neither can complete before its loop runs again (its socket buffers hold a few MiB at most).
      p.side.qp.postSend([
        { wrId: 21, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src)], remoteAddr: p.remote.write.addr, rkey: p.remote.write.rkey },
        { wrId: 22, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.land)], remoteAddr: p.remote.src.addr, rkey: p.remote.src.rkey },
      ]);
      const wcs = await waitCompletions(p.side, 2, STALL_MS + DEADLINE_MS * 3);
      assert.equal(split(wcs).send, "21:SUCCESS 22:SUCCESS");
      assert.equal((await deadline(p.ch.next("unblocked"), DEADLINE_MS, "the child's unblocked line"))!.type, "unblocked");
      assert.ok(Buffer.from(bytes(p.land)).equals(p.childSrc), "the READ brought the child's src");
      // The WRITE landed: read the child's write region back.
      bytes(p.land).fill(0);
      p.side.qp.postSend([{ wrId: 23, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.land)], remoteAddr: p.remote.write.addr, rkey: p.remote.write.rkey }]);
      const [back] = await waitCompletions(p.side, 1, DEADLINE_MS * 2);
      assert.equal(wcStatusName(back!.status), "SUCCESS");
      assert.ok(Buffer.from(bytes(p.land)).equals(Buffer.from(bytes(p.src))), "the WRITE placed every byte");
      assert.equal(p.side.qp.state, QpState.RTS);
      assert.deepEqual(p.events, []);
    } finally {
      p.close();
    }
  });

  it("our own event loop blocked for 5 s while the peer's 32 MiB SEND, WRITE and READ are in flight: its requester waits, everything completes", async () => {
    const p = await startPeer(DEFAULTS, {}, "both", BIG);
    try {
      p.side.qp.postRecv([{ wrId: 502, sgList: [sge(p.land)] }]);
      p.ch.send({ type: "run", chunk: BIG, notify: true });
      await deadline(p.ch.next("running"), DEADLINE_MS, "the child's traffic to start");
      // Synchronous work on our side: no I/O, no timers, no ACKs from us for STALL_MS.
      const end = performance.now() + STALL_MS;
      while (performance.now() < end) {
        /* busy */
      }
      const ran = await deadline(p.ch.next("ran"), DEADLINE_MS * 3, "the child's traffic to finish");
      assert.equal(ran!.ok, true, JSON.stringify(ran));
      const [rc] = await waitCompletions(p.side, 1, DEADLINE_MS);
      assert.equal(`${rc!.wrId}:${wcStatusName(rc!.status)}`, "502:SUCCESS");
      assert.ok(Buffer.from(bytes(p.land)).equals(p.childSrc), "the child's SEND and WRITE carried its src");
      assert.equal(p.side.qp.state, QpState.RTS);
      assert.deepEqual(p.events, []);
    } finally {
      p.close();
    }
  });
});
