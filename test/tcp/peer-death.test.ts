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
async function startPeer(attr: QpConnectAttr, childAttr: QpConnectAttr = {}, exchange: "both" | "child-only" = "both"): Promise<Peer> {
  const child = spawn(process.execPath, [PEER, "serve", "--host", "127.0.0.1", "--bytes", String(BYTES), "--seed", String(SEED)], {
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
  const src = side.pd.registerMr(BYTES, ACCESS);
  const land = side.pd.registerMr(BYTES, ACCESS);
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
    regions: { src: { addr: src.addr, rkey: src.rkey, length: BYTES }, write: { addr: land.addr, rkey: land.rkey, length: BYTES } },
    chunk: BYTES,
    attr: childAttr,
  });
  await deadline(ch.next("connected"), DEADLINE_MS, "the peer to connect");
  const childSrc = new Uint8Array(BYTES);
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
    ch.send({ type: "run", chunk: BYTES });
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

  const TIMEOUT = 10;
  const RETRY = 2;
  const LIMIT = ackTimeoutMs(TIMEOUT) * (RETRY + 1);

  it(`silent peer (SIGSTOP, connection up): RETRY_EXC_ERR within timeout × (retryCnt+1) ≈ ${LIMIT.toFixed(1)} ms`, async () => {
    const p = await startPeer({ timeout: TIMEOUT, retryCnt: RETRY, rnrRetry: 7, minRnrTimer: 1 }, {}, "child-only");
    try {
      await stopChild(p.child);
      p.side.qp.postSend([
        { wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 4096)], remoteAddr: p.remote.write.addr, rkey: p.remote.write.rkey },
        { wrId: 2, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 4096, 4096)], remoteAddr: p.remote.write.addr + 4096, rkey: p.remote.write.rkey },
        { wrId: 3, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(p.land, 0, 64)], remoteAddr: p.remote.src.addr, rkey: p.remote.src.rkey },
      ]);
      const t0 = performance.now();
      const wcs = await waitCompletions(p.side, 3);
      const elapsed = performance.now() - t0;
      assert.equal(split(wcs).send, "1:RETRY_EXC_ERR 2:WR_FLUSH_ERR 3:WR_FLUSH_ERR");
      // Bounded: the limit plus timer slack (a tick is timeout ms; allow generously for a loaded machine).
      assert.ok(elapsed < LIMIT + 500, `RETRY_EXC_ERR after ${elapsed.toFixed(1)} ms (limit ${LIMIT.toFixed(1)} ms)`);
      assert.equal(p.side.qp.state, QpState.ERR);
      assert.equal(p.events.length, 1, JSON.stringify(p.events));
      assert.equal(p.events[0]!.type, "QP_FATAL");
      assert.match(p.events[0]!.reason, /no response from the peer within 13 ms/);
      assert.ok(alive(p.child), "the child is still there (stopped), its connection never closed");
    } finally {
      p.close();
    }
  });

  it(
    "silent peer after an idle spell: the ACK timeout runs from the transmission, not from the last ACK",
    async () => {
      const p = await startPeer({ timeout: TIMEOUT, retryCnt: RETRY, rnrRetry: 7, minRnrTimer: 1 }, {}, "child-only");
      try {
        await stopChild(p.child);
        // Our requester has been idle since connect() (child-only exchange, process start-up, SIGSTOP): far longer than LIMIT.
        const t0 = performance.now();
        p.side.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(p.src, 0, 64)], remoteAddr: p.remote.write.addr, rkey: p.remote.write.rkey }]);
        const [wc] = await waitCompletions(p.side, 1);
        const elapsed = performance.now() - t0;
        assert.equal(wcStatusName(wc!.status), "RETRY_EXC_ERR");
        assert.ok(elapsed >= LIMIT, `RETRY_EXC_ERR after ${elapsed.toFixed(1)} ms, before timeout × (retryCnt+1) = ${LIMIT.toFixed(1)} ms`);
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
