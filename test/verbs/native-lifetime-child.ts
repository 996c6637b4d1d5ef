/**
 * Child program of native-lifetime.test.ts (verbs provider only), run as
 * `node --expose-gc native-lifetime-child.js <scenario>`: each scenario drives
 * the native addons (native/verbs.c, native/cm.c) directly or through the
 * provider, drops JavaScript references in a chosen order, forces GC until
 * the native finalizers have run (observed through the addon's debugLive /
 * debugMemRefs counters, never a fixed wait), and checks what the native
 * side holds. Some scenarios end with objects still alive on purpose, so the
 * environment's teardown (worker exit, process exit) walks them. Prints one
 * JSON line {"ok":true,...} when done; a crash, a sanitizer report or a
 * failed check exits non-zero.
 */
import assert from "node:assert/strict";
import { Worker, isMainThread, parentPort, workerData } from "node:worker_threads";
import { fileURLToPath } from "node:url";
import { Access, SendFlags, WcStatus, WrOpcode, type MemoryRegion } from "../../src/transport/types.js";
import { loadAddon, loadCmAddon, type NativeAddon, type NativeCmAddon, type NativeLiveCounts } from "../../src/transport/verbs/native.js";
import { SLOW, openDevice, openPair, sge, waitCompletions, deviceNames, type Pair, type Side } from "../support/seam.js";

const gc = (globalThis as { gc?: () => void }).gc;
if (!gc) throw new Error("run with --expose-gc");

const DEADLINE = 30_000 * SLOW;
const tick = (): Promise<void> => new Promise((r) => setImmediate(r));

function addon(): NativeAddon {
  const r = loadAddon();
  if (!r.ok) throw new Error(`verbs addon: ${r.reason}`);
  return r.addon;
}

function cmAddon(): NativeCmAddon {
  const r = loadCmAddon();
  if (!r.ok) throw new Error(`RDMA CM addon: ${r.reason}`);
  return r.addon;
}

const live = (): NativeLiveCounts => addon().debugLive();

/** Forces GC, one event-loop turn at a time, until `cond` holds (napi finalizers run after GC, some on a later turn). */
async function collectUntil(cond: () => boolean, what: string): Promise<void> {
  const end = performance.now() + DEADLINE;
  for (;;) {
    gc!();
    await tick();
    if (cond()) return;
    if (performance.now() > end) throw new Error(`timed out after ${DEADLINE} ms of forced GC waiting for ${what} (live: ${JSON.stringify(live())})`);
  }
}

const objects = (c: NativeLiveCounts): number => c.device + c.pd + c.cq + c.qp + c.mr + c.mw + c.memory + c.handles;

/** Everything back to `base`: every object freed, every handle collected. */
async function allFreed(base: NativeLiveCounts, what: string): Promise<void> {
  await collectUntil(() => objects(live()) === objects(base), `${what}: every native object freed`);
  assert.deepEqual(live(), base, what);
}

const IBV_DEVICE_MEM_WINDOW_TYPE_2B = 1 << 24;
const ACCESS_ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ;

/** One of everything on a fresh context, as raw handles in a bag the scenarios empty in their own order. */
function openAll(a: NativeAddon): Record<string, unknown> {
  const ctx = a.open(null, () => {});
  const pd = a.allocPd(ctx);
  const [cq] = a.createCq(ctx, 16, () => {});
  const [qp] = a.createQp(pd, cq, cq, 4, 4, 1, 1, 0, 0, 1, ACCESS_ALL);
  const [mr, ab] = a.regMr(pd, 4096, Access.LOCAL_WRITE);
  const alias = a.aliasMr(mr, 0, 64);
  const [umr] = a.regMrUser(pd, new ArrayBuffer(256), 0, 256, Access.LOCAL_WRITE);
  // A registration over a range of the addon's own memory (what a grant over a slab is).
  const [grant] = a.regMrUser(pd, ab, 64, 64, ACCESS_ALL);
  const bag: Record<string, unknown> = { ctx, pd, cq, qp, mr, ab, alias, umr, grant };
  if (a.queryDevice(ctx).deviceCapFlags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) bag.mw = a.allocMw(pd, 2)[0];
  a.reqNotifyCq(cq);
  return bag;
}

const HANDLES = new Set(["ctx", "pd", "cq", "qp", "mr", "umr", "grant", "mw"]);

/**
 * GC order: JS drops its references one at a time in each order below, each
 * collected before the next goes; parents before children is the order that
 * matters (a collected context handle while its PD, CQ, QP and MRs live).
 * Children keep their parents usable, and in the end everything is freed.
 *
 * (Throughout: objects are made and dropped in synchronous helpers or held
 * in a bag whose properties are deleted, never in locals of an async
 * function, whose suspended frame may keep them reachable across an await.)
 */
async function gcOrder(): Promise<object> {
  const a = addon();
  const base = live();
  const orders = [
    ["ctx", "pd", "cq", "mr", "ab", "alias", "qp", "umr", "grant", "mw"],
    ["mw", "grant", "umr", "qp", "alias", "ab", "mr", "cq", "pd", "ctx"],
    ["ab", "alias", "mr", "ctx", "grant", "pd", "cq", "umr", "mw", "qp"],
  ];
  for (const order of orders) {
    const bag = openAll(a);
    for (const k of order) {
      if (!(k in bag)) continue;
      const before = live().handles;
      delete bag[k];
      if (HANDLES.has(k)) await collectUntil(() => live().handles === before - 1, `the ${k} handle to be collected`);
      else {
        gc!();
        await tick();
      }
      if (k === "ctx" && "pd" in bag) {
        // The context's handle is gone; its children hold it open and usable.
        assert.equal(live().device, base.device + 1, "children keep their context");
        const handles = live().handles;
        useOrphanPd(a, bag);
        await collectUntil(() => live().handles === handles, "the orphan PD's test MR to be collected");
      }
    }
    await allFreed(base, `order ${order.join(",")}`);
  }
  return { orders: orders.length };
}

function useOrphanPd(a: NativeAddon, bag: Record<string, unknown>): void {
  const [m, ab] = a.regMr(bag.pd as never, 64, Access.LOCAL_WRITE);
  new Uint8Array(ab).fill(1);
  a.deregMr(m);
}

/**
 * Teardown of an environment whose context handle was collected while its
 * children live: the teardown walk destroys the children, which drop their
 * references on the context; it must not be freed under the walk. Run in a
 * worker (its teardown when it ends) and then by this process at exit.
 */
function keepChildrenDropContext(): { keep: Record<string, unknown>; before: number } {
  const bag = openAll(addon());
  const before = live().handles;
  delete bag.ctx;
  (globalThis as { keep?: unknown }).keep = bag;
  return { keep: bag, before };
}

async function teardownWalk(): Promise<object> {
  const w = new Worker(fileURLToPath(import.meta.url), { workerData: { scenario: "teardown-worker" }, env: process.env });
  const report = new Promise<unknown>((res) => w.once("message", res));
  const code = await new Promise<number>((res) => w.once("exit", res));
  assert.equal(code, 0, "the worker ended normally (its teardown walked a context whose handle was collected)");
  const r = (await report) as { live: NativeLiveCounts };
  assert.equal(r.live.device, 1, "in the worker, the context outlived its handle");
  // Now this process: exits holding the children of a collected context.
  const { before } = keepChildrenDropContext();
  await collectUntil(() => live().handles === before - 1, "the context handle to be collected");
  assert.equal(live().device, 1);
  return { worker: "ok", processExitWalk: "pending (checked by the exit status)" };
}

async function teardownWorker(): Promise<void> {
  const { before } = keepChildrenDropContext();
  await collectUntil(() => live().handles === before - 1, "the context handle to be collected (worker)");
  parentPort!.postMessage({ live: live() });
  // The worker ends here with the PD, CQ, QP and MRs alive: its environment's teardown closes them.
}

/**
 * A CQ armed (with a handler that closes over the CQ's own handle, as the
 * provider's does) when its device is closed: nothing can notify any more,
 * so the handler must go weak again, or handler -> handle -> CQ is a cycle
 * through a strong native reference that the GC can never collect.
 */
async function armedAtClose(): Promise<object> {
  const base = live();
  rawArmedClose(addon());
  await allFreed(base, "raw CQ armed when its device closed");
  // The same through the provider: a connection's CQ armed with onNotify set when the device closes.
  await providerArmed(false);
  await allFreed(base, "provider CQ armed when its device closed");
  // Armed, then destroyed explicitly (the path that already dropped the reference).
  await providerArmed(true);
  await allFreed(base, "provider CQ armed, destroyed, device closed");
  return {};
}

function rawArmedClose(a: NativeAddon): void {
  const ctx = a.open(null, () => {});
  const holder: { cq: unknown } = { cq: null };
  const [cq] = a.createCq(ctx, 4, () => void holder.cq);
  holder.cq = cq;
  a.keepAliveCq(cq, true);
  a.reqNotifyCq(cq);
  a.close(ctx);
}

async function providerArmed(destroyFirst: boolean): Promise<void> {
  const dev = await openDevice(deviceNames()[0]);
  const cq = dev.createCq(8);
  cq.onNotify = () => {};
  cq.requestNotify();
  if (destroyFirst) cq.destroy();
  dev.close();
}

/** RDMA WRITE of `data` through `target` from side `a`, then READ back; returns what came back. */
async function writeRead(a: Side, target: { addr: number; rkey: number }, data: Uint8Array): Promise<Uint8Array> {
  const src = a.pd.registerMr(data.length, Access.LOCAL_WRITE);
  const dst = a.pd.registerMr(data.length, Access.LOCAL_WRITE);
  new Uint8Array(src.buffer, src.offset, data.length).set(data);
  a.qp.postSend([{ wrId: 1, opcode: WrOpcode.RDMA_WRITE, flags: SendFlags.SIGNALED, sgList: [sge(src)], remoteAddr: target.addr, rkey: target.rkey }]);
  a.qp.postSend([{ wrId: 2, opcode: WrOpcode.RDMA_READ, flags: SendFlags.SIGNALED, sgList: [sge(dst)], remoteAddr: target.addr, rkey: target.rkey }]);
  const wcs = await waitCompletions(a, 2);
  for (const wc of wcs) assert.equal(wc.status, WcStatus.SUCCESS, `completion ${wc.wrId}: status ${wc.status}`);
  const out = new Uint8Array(new Uint8Array(dst.buffer, dst.offset, data.length));
  src.deregister();
  dst.deregister();
  return out;
}

/**
 * A grant (a registration with remote access over a range of a slab, as the
 * memory pool makes) outlives its slab: the slab deregistered (its
 * ArrayBuffer detached), or its handle collected. The memory stays until the
 * grant is deregistered, the peer reads and writes it, and it is freed then.
 */
interface GrantBag {
  p?: Pair;
  slab?: MemoryRegion;
  control?: MemoryRegion;
  grant?: MemoryRegion;
}

async function grantOverSlab(): Promise<object> {
  const a = addon();
  const h: GrantBag = {};
  await pairInto(h);
  const refs = (addr: number, len: number): number => a.debugMemRefs(addr, len);
  const data = Uint8Array.from({ length: 64 }, (_, i) => (i * 7 + 3) & 0xff);
  // 1. The slab deregistered: its ArrayBuffer is detached (and collected); the grant keeps the memory.
  let at = slabAndGrant(h, true);
  assert.equal(refs(at.slab, 64), 3, "the slab's registration, its ArrayBuffer and the grant");
  deregSlabs(h);
  await collectUntil(() => refs(at.control, 1) === 0, "the control slab's memory to be freed");
  assert.equal(refs(at.slab, 64), 1, "the grant still holds the slab's memory");
  assert.deepEqual(await writeRead(h.p!.a, at.grant, data), data);
  deregGrant(h);
  await collectUntil(() => refs(at.slab, 64) === 0, "the slab's memory to be freed with the grant's deregistration");
  // 2. The slab's JS objects dropped (never deregistered): collected, and the grant keeps the memory.
  at = slabAndGrant(h, false);
  assert.equal(refs(at.slab, 64), 3, "the slab's registration, its ArrayBuffer and the grant");
  delete h.slab;
  // Its handle collected, the slab's registration is gone and gives its reference back.
  await collectUntil(() => refs(at.slab, 64) === 2, "the slab's MR to be collected");
  const data2 = data.map((x) => x ^ 0xff);
  assert.deepEqual(await writeRead(h.p!.a, at.grant, data2), data2);
  deregGrant(h);
  await collectUntil(() => refs(at.slab, 64) === 0, "the memory to be freed once the grant is gone");
  h.p!.close();
  return {};
}

async function pairInto(h: GrantBag): Promise<void> {
  h.p = await openPair();
}

/** Registers a slab (and a control slab) on side B and a grant over 64 bytes of the slab; returns addresses and the grant's key. */
function slabAndGrant(h: GrantBag, control: boolean): { slab: number; control: number; grant: { addr: number; rkey: number } } {
  const pd = h.p!.b.pd;
  const slab = (h.slab = pd.registerMr(4096, Access.LOCAL_WRITE));
  if (control) h.control = pd.registerMr(4096, Access.LOCAL_WRITE);
  const grant = (h.grant = pd.registerMr(slab.buffer, ACCESS_ALL, slab.offset + 128, 64));
  return { slab: slab.addr + 128, control: h.control?.addr ?? 0, grant: { addr: grant.addr, rkey: grant.rkey } };
}

function deregSlabs(h: GrantBag): void {
  h.slab!.deregister();
  h.control!.deregister();
  delete h.slab;
  delete h.control;
}

function deregGrant(h: GrantBag): void {
  h.grant!.deregister();
  delete h.grant;
}

/**
 * Callbacks that tear down what is calling them: a CQ's notify handler
 * closes the device the CQ belongs to (the CQ's watcher is closed while its
 * callback runs). Then everything is freed.
 */
async function closeFromCallback(): Promise<object> {
  const base = live();
  await closeInsideNotify();
  await allFreed(base, "a device closed from its CQ's notify handler");
  return {};
}

async function closeInsideNotify(): Promise<void> {
  const p = await openPair();
  let calls = 0;
  const closed = new Promise<void>((res) => {
    p.a.cq.onNotify = () => {
      calls++;
      p.a.dev.close();
      res();
    };
  });
  p.a.cq.requestNotify();
  const src = p.a.pd.registerMr(16, Access.LOCAL_WRITE);
  const dst = p.b.pd.registerMr(16, Access.LOCAL_WRITE);
  p.b.qp.postRecv([{ wrId: 1, sgList: [sge(dst)] }]);
  p.a.qp.postSend([{ wrId: 2, opcode: WrOpcode.SEND, flags: SendFlags.SIGNALED, sgList: [sge(src)] }]);
  await closed;
  assert.equal(calls, 1);
  p.close();
}

/**
 * RDMA CM ids destroyed, collected, and left to the environment's teardown
 * while their events are still pending in the channel; the channel keeps
 * working for the others. Also in a worker, whose teardown stops the
 * channel's watcher before it closes the channel.
 */
async function cmPending(): Promise<object> {
  const cm = cmAddon();
  const ip = (process.env.RXE_IPS ?? "").split(/\s+/).filter(Boolean)[0];
  assert.ok(ip, "RXE_IPS names the rxe device's address");
  const seen: { token: number; type: number }[] = [];
  let onEvent: (() => void) | null = null;
  cm.init((token, type) => {
    seen.push({ token, type });
    onEvent?.();
  });
  const destroyed = new Set<number>();
  const kept: unknown[] = [];
  let dropped: unknown[] = [];
  for (let i = 0; i < 12; i++) {
    const [h, tok] = cm.createId();
    cm.resolveAddr(h, null, ip!, 7000 + i, 2000);
    if (i % 3 === 0) {
      cm.destroyId(h); // an event is (or soon will be) pending for it
      destroyed.add(tok);
    } else if (i % 3 === 1) dropped.push(h); // collected below: its finalizer destroys it
    else kept.push(h); // left to the teardown at exit
  }
  dropped = [];
  for (let i = 0; i < 3; i++) {
    gc!();
    await tick();
  }
  // The channel still works: a fresh id gets its ADDR_RESOLVED (0).
  const [fresh, ftok] = cm.createId();
  cm.resolveAddr(fresh, null, ip!, 7100, 2000);
  cm.keepAlive(true);
  await new Promise<void>((res, rej) => {
    const t = setTimeout(() => rej(new Error(`no event for a fresh id within ${DEADLINE} ms after others were destroyed with events pending`)), DEADLINE);
    onEvent = () => {
      if (!seen.some((e) => e.token === ftok)) return;
      clearTimeout(t);
      res();
    };
    onEvent();
  });
  onEvent = null;
  cm.keepAlive(false);
  assert.equal(seen.find((e) => e.token === ftok)!.type, 0, "ADDR_RESOLVED");
  assert.ok(!seen.some((e) => destroyed.has(e.token)), "no event for a destroyed id");
  cm.destroyId(fresh);
  // A worker with ids whose events are pending when it ends.
  const w = new Worker(fileURLToPath(import.meta.url), { workerData: { scenario: "cm-worker", ip }, env: process.env });
  const code = await new Promise<number>((res) => w.once("exit", res));
  assert.equal(code, 0, "the worker ended normally with ids pending");
  (globalThis as { keep?: unknown }).keep = kept;
  return { destroyed: destroyed.size, kept: kept.length, events: seen.length };
}

function cmWorker(ip: string): void {
  const cm = cmAddon();
  cm.init(() => {});
  const ids: unknown[] = [];
  for (let i = 0; i < 6; i++) {
    const [h] = cm.createId();
    cm.resolveAddr(h, null, ip, 7200 + i, 2000);
    ids.push(h);
  }
  (globalThis as { keep?: unknown }).keep = ids;
  // Ends now: the teardown destroys the ids (events unread), stops the watcher, then closes the channel.
}

const SCENARIOS: Record<string, () => Promise<object>> = {
  "gc-order": gcOrder,
  "teardown-walk": teardownWalk,
  "armed-at-close": armedAtClose,
  "grant-over-slab": grantOverSlab,
  "close-from-callback": closeFromCallback,
  "cm-pending": cmPending,
};

if (!isMainThread) {
  const d = workerData as { scenario: string; ip?: string };
  if (d.scenario === "teardown-worker") await teardownWorker();
  else if (d.scenario === "cm-worker") cmWorker(d.ip!);
} else {
  const name = process.argv[2] ?? "";
  const run = SCENARIOS[name];
  if (!run) throw new Error(`unknown scenario ${name}; one of ${Object.keys(SCENARIOS).join(", ")}`);
  try {
    const extra = await run();
    console.log(JSON.stringify({ ok: true, scenario: name, ...extra }));
    // Whatever is still alive now (on purpose in some scenarios) goes with the process's teardown.
  } catch (e) {
    console.error(e);
    process.exitCode = 1;
  }
}
