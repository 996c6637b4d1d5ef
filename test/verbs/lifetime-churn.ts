/**
 * Child program of lifetime.test.ts, run with `node --expose-gc`: creates
 * and drops 200 sets of PD/CQ/QP/MR (plus user-memory MRs, alias buffers and
 * connected pairs) without releasing anything, forcing GC in between so the
 * native finalizers run in whatever order the collector picks. Then checks
 * that a fresh pair still carries data, drops its devices unclosed too, and
 * lets the process exit by itself (teardown in dependency order). Prints one
 * JSON line.
 */
import assert from "node:assert/strict";
import { Access, SendFlags, WcStatus, WrOpcode, type Device } from "../../src/transport/types.js";
import { deviceNames, endpointFor, makeSide, openDevice, openPair, sge, waitCompletions, GID_INDEX } from "../support/seam.js";

const gc = (globalThis as { gc?: () => void }).gc;
if (!gc) throw new Error("run with --expose-gc");

const tick = (): Promise<void> => new Promise((r) => setImmediate(r));
async function collect(): Promise<void> {
  // Finalizers of napi externals / external buffers run after GC, some on a later tick.
  for (let i = 0; i < 3; i++) {
    gc!();
    await tick();
  }
}

function churnOne(dev: Device, i: number): void {
  const s = makeSide(dev, { maxSendWr: 8, maxRecvWr: 8 });
  const m = s.pd.registerMr(4096 + (i % 3) * 4096, Access.LOCAL_WRITE | Access.REMOTE_WRITE);
  const own = s.pd.registerMr(new ArrayBuffer(512), Access.LOCAL_WRITE, 64, 256);
  const view = new Uint8Array(m.buffer, m.offset, m.length);
  view[i % m.length] = i & 0xff;
  if (m.aliasBuffer) {
    const al = m.aliasBuffer(128, 256);
    new Uint8Array(al).fill(i & 0xff);
    if (i % 2 === 0) m.deregister(); // the alias outlives the registration (detached)
  }
  s.qp.postRecv([{ wrId: i, sgList: [sge(m, 0, 64), sge(own, 0, 64)] }]);
  if (i % 4 === 0) s.cq.requestNotify();
  // dropped: s, m, own, view, alias
}

async function main(): Promise<void> {
  const [na, nb] = deviceNames();
  const rss: number[] = [];
  let dev = await openDevice(na);
  for (let i = 0; i < 200; i++) {
    churnOne(dev, i);
    if (i % 10 === 9) {
      // Connected pairs, dropped with work posted.
      const p = await openPair();
      const src = p.a.pd.registerMr(64, Access.LOCAL_WRITE);
      const dst = p.b.pd.registerMr(64, Access.LOCAL_WRITE);
      p.b.qp.postRecv([{ wrId: 1, sgList: [sge(dst)] }]);
      p.a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] }]);
      await waitCompletions(p.b, 1);
      if (i % 20 === 19) p.close(); // half of them closed, half dropped
    }
    if (i % 50 === 49) {
      await collect();
      rss.push(Math.round(process.memoryUsage().rss / 2 ** 20));
      // A device dropped without close now and then, too.
      if (i === 99) dev = await openDevice(na);
    }
  }
  await collect();
  // Still healthy: a fresh pair carries data.
  const devA = await openDevice(na);
  const devB = nb === na ? devA : await openDevice(nb);
  const a = makeSide(devA);
  const b = makeSide(devB);
  const attr = { gidIndex: GID_INDEX, rnrRetry: 7, minRnrTimer: 1 };
  a.qp.connect(endpointFor(b.qp), attr);
  b.qp.connect(endpointFor(a.qp), attr);
  const src = a.pd.registerMr(32, Access.LOCAL_WRITE);
  const dst = b.pd.registerMr(32, Access.LOCAL_WRITE);
  new Uint8Array(src.buffer, src.offset, 32).fill(7);
  b.qp.postRecv([{ wrId: 1, sgList: [sge(dst)] }]);
  a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] }]);
  const [r] = await waitCompletions(b, 1);
  assert.equal(r!.status, WcStatus.SUCCESS);
  assert.ok(new Uint8Array(dst.buffer, dst.offset, 32).every((x) => x === 7));
  console.log(JSON.stringify({ ok: true, sets: 200, rssMb: rss }));
  // Nothing closed: the process must exit by itself.
}

main().catch((e: unknown) => {
  console.error(e);
  process.exitCode = 1;
});
