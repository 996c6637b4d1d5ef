/**
 * Connection establishment through RDMA CM (librdmacm), the alternative to
 * the TCP side channel: `new RdmaBuilder().setConnectionManager("rdmacm")`.
 *
 * User-managed QPs: the connection's QP is created by the library on the
 * device the CM id resolved to, its number travels in the CM's REQ/REP, and
 * INIT → RTR → RTS use the CM's path (rdma_init_qp_attr: dgid, sgid index,
 * path MTU) with this side's settings (timeouts, retries, atomics).
 *
 *   client: resolve_addr → resolve_route → create QP → connect(private data: hello)
 *           → CONNECT_RESPONSE(private data: hello) → RTR/RTS → establish (RTU)
 *   server: CONNECT_REQUEST(hello) → create QP → RTR/RTS → accept(hello) → ESTABLISHED
 *
 * Private data (compact binary, big-endian, versioned, validated):
 *
 *   hello  (20 bytes; CONNECT ≤ 56, ACCEPT ≤ 196)
 *     0 u32 magic "aRDM"   4 u8 protocol version   5 u8 kind (1 connect, 2 accept)
 *     6 u16 0              8 u32 psn (24 bits)     12 u32 recvDepth   16 u32 eagerMax
 *   reject (8 + n bytes, ≤ 148)
 *     0 u32 magic   4 u8 version   5 u8 kind 3   6 u8 code (1 refused, 2 protocol)   7 u8 n
 *     8 reason, n bytes of UTF-8
 *
 * The CM id lives as long as the connection: a DISCONNECTED event (the peer
 * closed, or died and its kernel tore the id down) fails the connection with
 * CONNECTION_CLOSED; releasing the connection disconnects and destroys the id.
 */
import { isIP } from "node:net";
import { lookup } from "node:dns/promises";
import { RdmaError } from "../errors.js";
import { CmEventType as T, type CmEvent, type CmId, type DeviceAttr, type RdmaCm } from "../transport/types.js";
import { loadProvider, type ProviderChoice } from "../transport/providers.js";
import type { Connection } from "../agent/connection.js";
import type { ResolvedSettings } from "./builder.js";
import { Context } from "./context.js";
import { PROTOCOL_VERSION } from "./handshake.js";
import { Rdma } from "./rdma.js";
import { abandon, connectAttr, makeConnection } from "./setup.js";
import type { Establisher, ListenerSink, ListenerSource } from "./establish.js";

const MAGIC = 0x6152444d; // "aRDM"
const KIND_CONNECT = 1;
const KIND_ACCEPT = 2;
const KIND_REJECT = 3;
const HELLO_BYTES = 20;
const REJECT_REFUSED = 1;
const REJECT_PROTOCOL = 2;
const MAX_REASON = 140;

export interface CmHello {
  psn: number;
  recvDepth: number;
  eagerMax: number;
}

export function encodeHello(kind: typeof KIND_CONNECT | typeof KIND_ACCEPT, h: CmHello, version = PROTOCOL_VERSION): Uint8Array {
  const b = new Uint8Array(HELLO_BYTES);
  const v = new DataView(b.buffer);
  v.setUint32(0, MAGIC);
  v.setUint8(4, version);
  v.setUint8(5, kind);
  v.setUint32(8, h.psn & 0xffffff);
  v.setUint32(12, h.recvDepth);
  v.setUint32(16, h.eagerMax);
  return b;
}

/** Validates a peer's hello; PROTOCOL errors name what is wrong. Trailing bytes (IB pads private data) are ignored. */
export function decodeHello(pd: Uint8Array | null, kind: typeof KIND_CONNECT | typeof KIND_ACCEPT): CmHello {
  if (!pd || pd.length < 6) throw new RdmaError("PROTOCOL", "the peer's RDMA CM private data is missing: is the other side an async-rdma endpoint?");
  const v = new DataView(pd.buffer, pd.byteOffset, pd.byteLength);
  if (v.getUint32(0) !== MAGIC) throw new RdmaError("PROTOCOL", "the peer's RDMA CM private data is not an async-rdma hello: is the other side an async-rdma endpoint?");
  const ver = v.getUint8(4);
  if (ver !== PROTOCOL_VERSION) throw new RdmaError("PROTOCOL", `protocol version mismatch: the peer speaks ${ver}, this side ${PROTOCOL_VERSION}; upgrade the older side`);
  if (v.getUint8(5) !== kind) throw new RdmaError("PROTOCOL", `unexpected RDMA CM hello kind ${v.getUint8(5)} (expected ${kind})`);
  if (pd.length < HELLO_BYTES) throw new RdmaError("PROTOCOL", `the peer's RDMA CM hello is truncated (${pd.length} bytes)`);
  const psn = v.getUint32(8);
  const recvDepth = v.getUint32(12);
  const eagerMax = v.getUint32(16);
  if (psn > 0xffffff) throw new RdmaError("PROTOCOL", "handshake field psn is invalid");
  if (recvDepth < 8 || recvDepth > 65536) throw new RdmaError("PROTOCOL", "handshake field recvDepth is invalid");
  if (eagerMax > 1 << 20) throw new RdmaError("PROTOCOL", "handshake field eagerMax is invalid");
  return { psn, recvDepth, eagerMax };
}

export function encodeReject(code: typeof REJECT_REFUSED | typeof REJECT_PROTOCOL, reason: string): Uint8Array {
  let r = new TextEncoder().encode(reason);
  if (r.length > MAX_REASON) {
    // cut on a character boundary
    let n = MAX_REASON;
    while (n > 0 && (r[n]! & 0xc0) === 0x80) n--;
    r = r.subarray(0, n);
  }
  const b = new Uint8Array(8 + r.length);
  const v = new DataView(b.buffer);
  v.setUint32(0, MAGIC);
  v.setUint8(4, PROTOCOL_VERSION);
  v.setUint8(5, KIND_REJECT);
  v.setUint8(6, code);
  v.setUint8(7, r.length);
  b.set(r, 8);
  return b;
}

/** Our reject's reason, or null when the REJ did not come from an async-rdma peer. */
export function decodeReject(pd: Uint8Array | null): { code: number; reason: string } | null {
  if (!pd || pd.length < 8) return null;
  const v = new DataView(pd.buffer, pd.byteOffset, pd.byteLength);
  if (v.getUint32(0) !== MAGIC || v.getUint8(5) !== KIND_REJECT) return null;
  const n = Math.min(v.getUint8(7), pd.length - 8, MAX_REASON);
  return { code: v.getUint8(6), reason: new TextDecoder("utf-8", { fatal: false }).decode(pd.subarray(8, 8 + n)) };
}

async function loadCm(choice: ProviderChoice): Promise<RdmaCm> {
  const tcpMsg =
    'setConnectionManager("rdmacm") needs the verbs provider: RDMA CM establishes connections between RDMA devices. The tcp provider connects through the TCP side channel: use setConnectionManager("tcp") (the default) with it';
  if (choice === "tcp") throw new RdmaError("INVALID_ARGUMENT", tcpMsg);
  const provider = await loadProvider(choice);
  if (provider.name !== "verbs") throw new RdmaError("INVALID_ARGUMENT", `${tcpMsg} (provider "auto" chose tcp: no RDMA device with an active port here)`);
  if (!provider.rdmaCm) throw new RdmaError("PROVIDER_UNAVAILABLE", `the ${provider.name} provider has no RDMA CM`);
  return provider.rdmaCm();
}

async function resolveHost(host: string, forBind: boolean): Promise<string> {
  if (isIP(host)) return host;
  try {
    return (await lookup(host)).address;
  } catch (e) {
    throw new RdmaError(forBind ? "INVALID_ARGUMENT" : "CONNECTION_REFUSED", `cannot resolve host ${JSON.stringify(host)}: ${(e as Error).message}`, { cause: e });
  }
}

function rdParams(s: ResolvedSettings, attr: DeviceAttr): { responderResources: number; initiatorDepth: number; retryCount: number; rnrRetryCount: number } {
  return {
    responderResources: Math.min(s.maxRdAtomic, attr.maxQpRdAtom, 255),
    initiatorDepth: Math.min(s.maxRdAtomic, attr.maxQpInitRdAtom, 255),
    retryCount: s.retryCount,
    rnrRetryCount: s.rnrRetry,
  };
}

/** RTR/RTS with the CM's path (dgid, sgid index, MTU) and this side's settings. */
function connectQp(conn: Connection, id: CmId, peerQpn: number, peerPsn: number, s: ResolvedSettings): void {
  const a = id.initQpAttr(2);
  const mtu = a.pathMtu >= 256 ? Math.min(s.mtu, a.pathMtu) : s.mtu;
  conn.qp.connect(
    { provider: "verbs", qpNum: a.destQpNum || peerQpn, psn: peerPsn, lid: a.dlid, gid: a.dgid, port: 0, mtu },
    { ...connectAttr(s), portNum: a.portNum || s.port, gidIndex: a.sgidIndex, mtu },
  );
}

/** After establishment: DISCONNECTED fails the connection; its release disconnects and destroys the id. */
function attach(rdma: Rdma, conn: Connection, id: CmId): void {
  id.onEvent = (e: CmEvent) => {
    if (e.type === T.DISCONNECTED) conn.fail(new RdmaError("CONNECTION_CLOSED", "the peer disconnected (RDMA CM DISCONNECTED)"));
    else if (e.type === T.DEVICE_REMOVAL) conn.fail(new RdmaError("CONNECTION_CLOSED", "the RDMA device was removed (RDMA CM DEVICE_REMOVAL)"));
  };
  rdma.onReleased = () => {
    id.disconnect();
    id.destroy();
  };
}

function stepError(e: CmEvent, id: CmId, step: string, where: string, mod: RdmaCm): RdmaError {
  if (e.type === T.REJECTED) {
    const r = decodeReject(e.privateData);
    if (r) return new RdmaError(r.code === REJECT_PROTOCOL ? "PROTOCOL" : "CONNECTION_REFUSED", `${where} refused the connection: ${r.reason}`);
    return new RdmaError("CONNECTION_REFUSED", `connection to ${where} refused (RDMA CM REJECTED: ${mod.rejectReason(e.status)})${e.status === 8 ? ": is the server listening?" : ""}`);
  }
  const st = e.status < 0 ? id.errnoName(-e.status) : String(e.status);
  return new RdmaError("CONNECTION_REFUSED", `cannot reach ${where}: ${step} failed (RDMA CM ${e.name}, status ${st})`, e.status < 0 ? { errno: st } : {});
}

/** A CM call's synchronous failure (e.g. ENETUNREACH from rdma_resolve_addr) as CONNECTION_REFUSED naming the step. */
function step(where: string, what: string, fn: () => void): void {
  try {
    fn();
  } catch (e) {
    if (e instanceof RdmaError && (e.code === "INVALID_STATE" || e.code === "PROVIDER_UNAVAILABLE")) throw e;
    const errno = e instanceof RdmaError ? e.errno : undefined;
    throw new RdmaError("CONNECTION_REFUSED", `cannot reach ${where}: ${what} failed: ${(e as Error).message}`, errno === undefined ? { cause: e } : { errno, cause: e });
  }
}

/** @internal The CM id of an RDMA CM connection (tests use it to disconnect without the library's CLOSE). */
export const cmIdOf = new WeakMap<Rdma, CmId>();

async function expect(id: CmId, type: number, step: string, where: string, timeoutMs: number, signal: AbortSignal | undefined, mod: RdmaCm): Promise<CmEvent> {
  let e: CmEvent;
  try {
    e = await id.next(`${step} for ${where}`, timeoutMs, signal);
  } catch (err) {
    if (err instanceof RdmaError && err.code === "TIMEOUT") throw new RdmaError("TIMEOUT", `connect to ${where} timed out during ${step}`, { cause: err });
    throw err;
  }
  if (e.type !== type) {
    e.child?.destroy();
    throw stepError(e, id, step, where, mod);
  }
  return e;
}

/**
 * Client side: dials `addr` through RDMA CM. `ctx`, when given, is an existing
 * (retained) context (newConnection); failure releases it, as dialWith does.
 */
async function dialCm(
  base: ResolvedSettings,
  resolve: (attr: DeviceAttr) => ResolvedSettings,
  addr: { host: string; port: number },
  signal: AbortSignal | undefined,
  existing?: Context,
): Promise<Rdma> {
  let ctx: Context | null = existing ?? null;
  let id: CmId | null = null;
  let conn: Connection | null = null;
  let responded = false;
  const holder: { rdma: Rdma | null } = { rdma: null };
  const where = `${addr.host}:${addr.port}`;
  let deadline = performance.now() + base.connectTimeoutMs;
  const left = (): number => Math.max(1, Math.ceil(deadline - performance.now()));
  try {
    if (signal?.aborted) throw new RdmaError("ABORTED", "connect aborted");
    const t0 = performance.now();
    const mod = await loadCm(existing ? "verbs" : base.provider);
    deadline += performance.now() - t0;
    const dst = await resolveHost(addr.host, false);
    // The deadline bounds the network steps, as the side channel's does: local setup (opening a device) does not count.
    const local = async <T>(f: () => Promise<T>): Promise<T> => {
      const t0 = performance.now();
      try {
        return await f();
      } finally {
        deadline += performance.now() - t0;
      }
    };
    if (!ctx && base.device !== undefined) ctx = await local(() => Context.open(base.provider, base.device));
    if (ctx && ctx.provider.name !== "verbs") throw new RdmaError("INVALID_ARGUMENT", 'setConnectionManager("rdmacm") needs the verbs provider');
    // No source address: the routing table picks the device (with one bound,
    // rxe resolves even unroutable destinations and the connect then times out).
    const src = null;
    id = mod.createId();
    const cmId = id;
    step(where, "address resolution (rdma_resolve_addr)", () => cmId.resolveAddr(src, dst, addr.port, left()));
    await expect(id, T.ADDR_RESOLVED, "address resolution (rdma_resolve_addr)", where, left(), signal, mod);
    step(where, "route resolution (rdma_resolve_route)", () => cmId.resolveRoute(left()));
    await expect(id, T.ROUTE_RESOLVED, "route resolution (rdma_resolve_route)", where, left(), signal, mod);
    const info = id.info();
    if (!info.deviceName) throw new RdmaError("DEVICE", `RDMA CM resolved ${where} to no RDMA device`);
    if (ctx && ctx.device.name !== info.deviceName) {
      throw new RdmaError("INVALID_ARGUMENT", `the route to ${where} goes through RDMA device ${info.deviceName}, but this connection uses ${ctx.device.name}: set the device to ${info.deviceName} (or none)`);
    }
    if (!ctx) ctx = await local(() => Context.open("verbs", info.deviceName!));
    const s: ResolvedSettings = { ...resolve(ctx.device.attr), port: info.portNum || base.port, cm: "rdmacm" };
    conn = makeConnection(ctx, s, { recvDepth: 0, eagerMax: 0 }, holder);
    const psn = conn.qp.localEndpoint({ portNum: s.port }).psn;
    const qpNum = conn.qp.qpNum;
    step(where, "connection (rdma_connect)", () => cmId.connect(qpNum, encodeHello(KIND_CONNECT, { psn, recvDepth: s.recvDepth, eagerMax: s.eagerMax }), rdParams(s, ctx!.device.attr)));
    const ev = await expect(id, T.CONNECT_RESPONSE, "connection (rdma_connect)", where, left(), signal, mod);
    responded = true;
    const peer = decodeHello(ev.privateData, KIND_ACCEPT);
    conn.setPeer({ recvDepth: peer.recvDepth, eagerMax: peer.eagerMax });
    connectQp(conn, id, ev.conn?.qpNum ?? 0, peer.psn, s);
    id.establish();
    conn.start();
    const rdma = new Rdma(conn, ctx, s, { addr, redial: (again) => dialCm(s, () => s, addr, undefined, again) });
    holder.rdma = rdma;
    attach(rdma, conn, id);
    cmIdOf.set(rdma, id);
    return rdma;
  } catch (e) {
    if (id) {
      if (responded) {
        try {
          id.reject(encodeReject(e instanceof RdmaError && e.code === "PROTOCOL" ? REJECT_PROTOCOL : REJECT_REFUSED, e instanceof Error ? e.message : String(e)));
        } catch {
          /* best effort */
        }
      }
      id.destroy();
    }
    abandon(conn, ctx);
    if (signal?.aborted && !(e instanceof RdmaError && e.code === "ABORTED")) throw new RdmaError("ABORTED", `connect to ${where} aborted`, { cause: e });
    throw e instanceof RdmaError ? e : new RdmaError("DEVICE", `connect to ${where} failed: ${(e as Error)?.message ?? String(e)}`, { cause: e });
  }
}

/**
 * Server side: an RDMA CM listening id behind an RdmaListener. Contexts are
 * opened per device an incoming request arrives on (one for an address bound
 * to a device, opened at once so settings are checked at bind); every
 * accepted connection gets a fork of its device's context (its own PD and
 * pool), as on the side channel. The hello is decoded and checked before
 * anything is allocated; every failure goes through abandon().
 */
async function bindCm(
  base: ResolvedSettings,
  resolve: (attr: DeviceAttr) => ResolvedSettings,
  addr: { host: string; port: number },
  sink: ListenerSink,
): Promise<ListenerSource> {
  const mod = await loadCm(base.provider);
  const host = await resolveHost(addr.host, true);
  const contexts = new Map<string, Promise<{ ctx: Context; s: ResolvedSettings }>>();
  const contextFor = (name: string, port: number): Promise<{ ctx: Context; s: ResolvedSettings }> => {
    let p = contexts.get(name);
    if (!p) {
      p = (async () => {
        if (base.device !== undefined && base.device !== name) {
          throw new RdmaError("INVALID_ARGUMENT", `the connection arrived on RDMA device ${name}, but the listener uses ${base.device}`);
        }
        const ctx = await Context.open("verbs", name);
        try {
          return { ctx, s: { ...resolve(ctx.device.attr), port: port || base.port, cm: "rdmacm" as const } };
        } catch (e) {
          ctx.release();
          throw e;
        }
      })();
      contexts.set(name, p);
      p.catch(() => contexts.delete(name));
    }
    return p;
  };
  const releaseContexts = async (): Promise<void> => {
    const all = [...contexts.values()];
    contexts.clear();
    for (const r of await Promise.allSettled(all)) if (r.status === "fulfilled") r.value.ctx.release();
  };
  const id = mod.createId();
  let info;
  let bound: Context | null = null;
  try {
    try {
      id.bind(host, addr.port);
    } catch (e) {
      const errno = e instanceof RdmaError ? e.errno : undefined;
      const why = errno === "EADDRINUSE" ? "the port is in use" : errno === "EADDRNOTAVAIL" || errno === "ENODEV" ? "no RDMA device has that address" : (e as Error).message;
      throw new RdmaError("INVALID_ARGUMENT", `cannot listen on ${addr.host}:${addr.port} with RDMA CM: ${why}`, errno === undefined ? { cause: e } : { errno, cause: e });
    }
    info = id.info();
    if (info.deviceName) bound = (await contextFor(info.deviceName, info.portNum)).ctx;
    id.listen(128);
  } catch (e) {
    id.destroy();
    await releaseContexts();
    throw e;
  }
  const pending = new Set<CmId>();
  let closed = false;

  const handle = async (child: CmId, ev: CmEvent): Promise<void> => {
    pending.add(child);
    let conn: Connection | null = null;
    let ctx: Context | null = null;
    let accepted = false;
    const holder: { rdma: Rdma | null } = { rdma: null };
    try {
      const hello = decodeHello(ev.privateData, KIND_CONNECT);
      const ci = child.info();
      if (!ci.deviceName) throw new RdmaError("DEVICE", "the connection request arrived on no RDMA device");
      if (closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      const entry = await contextFor(ci.deviceName, ci.portNum);
      const s = entry.s;
      if (closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      // A protection domain and pool of its own: no other connection can reach what it grants or lends.
      ctx = entry.ctx.fork();
      conn = makeConnection(ctx, s, { recvDepth: hello.recvDepth, eagerMax: hello.eagerMax }, holder);
      connectQp(conn, child, ev.conn?.qpNum ?? 0, hello.psn, s);
      const psn = conn.qp.localEndpoint({ portNum: s.port }).psn;
      child.accept(conn.qp.qpNum, encodeHello(KIND_ACCEPT, { psn, recvDepth: s.recvDepth, eagerMax: s.eagerMax }), rdParams(s, ctx.device.attr));
      accepted = true;
      const est = await child.next("waiting for ESTABLISHED", s.connectTimeoutMs);
      if (est.type !== T.ESTABLISHED) {
        const r = est.type === T.REJECTED ? decodeReject(est.privateData) : null;
        throw new RdmaError(r?.code === REJECT_PROTOCOL ? "PROTOCOL" : "CONNECTION_CLOSED", `the client ${ci.peerAddr}:${ci.peerPort} did not complete the connection (RDMA CM ${est.name}${r ? `: ${r.reason}` : ""})`);
      }
      conn.start();
      const rdma = new Rdma(conn, ctx, s, null);
      holder.rdma = rdma;
      attach(rdma, conn, child);
      cmIdOf.set(rdma, child);
      pending.delete(child);
      conn = null;
      ctx = null;
      sink.push(rdma);
    } catch (e) {
      pending.delete(child);
      const err = e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e));
      if (!accepted && !child.isDestroyed) {
        try {
          child.reject(encodeReject(err.code === "PROTOCOL" ? REJECT_PROTOCOL : REJECT_REFUSED, err.message));
        } catch {
          /* the client is gone */
        }
      } else {
        child.disconnect();
      }
      child.destroy();
      abandon(conn, ctx);
      sink.reject(err);
    }
  };

  id.onEvent = (e: CmEvent) => {
    if (e.type === T.CONNECT_REQUEST && e.child) {
      if (closed || pending.size >= base.maxHandshakes) {
        const why = closed ? "the listener is closed" : `the server is busy: ${pending.size} connections are being set up (its limit); retry later`;
        try {
          e.child.reject(encodeReject(REJECT_REFUSED, why));
        } catch {
          /* gone */
        }
        e.child.destroy();
        return;
      }
      void handle(e.child, e);
    } else {
      e.child?.destroy();
    }
  };

  const local = { host: info.localAddr || addr.host, port: info.localPort };
  return {
    address: () => local,
    handshakes: () => pending.size,
    context: () => (closed ? null : bound),
    close: async () => {
      if (closed) return;
      closed = true;
      id.destroy();
      for (const c of [...pending]) c.destroy();
      await releaseContexts();
    },
  };
}

export const rdmaCmEstablisher: Establisher = { name: "rdmacm", dial: dialCm, bind: bindCm };
