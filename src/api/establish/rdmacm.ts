/**
 * Connection establishment through RDMA CM (librdmacm), the alternative to
 * the TCP side channel: `new RdmaBuilder().setConnectionManager("rdmacm")`.
 * This file owns the client (dialCm) and what both sides share (loading the
 * CM, the QP's connect through the CM's path, the CM id's life after
 * establishment); the server is rdmacm-listener.ts, the bytes rdmacm-wire.ts.
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
 * Private data: rdmacm-wire.ts (the codec, every byte and MAC input).
 *
 * The CM id lives as long as the connection: a DISCONNECTED event (the peer
 * closed, or died and its kernel tore the id down) fails the connection with
 * CONNECTION_CLOSED, once the completions already in the CQ were taken (the
 * DREQ can overtake them: the peer's last messages and its CLOSE stay
 * delivered, as over the side channel); releasing the connection
 * disconnects and destroys the id.
 */
import { isIP } from "node:net";
import { lookup } from "node:dns/promises";
import { RdmaError } from "../../errors.js";
import { CmEventType as T, type CmEvent, type CmId, type DeviceAttr, type RdmaCm } from "../../transport/types.js";
import { loadProvider, type ProviderChoice } from "../../transport/providers.js";
import type { Connection } from "../../agent/connection.js";
import type { ResolvedSettings } from "../settings.js";
import { Context } from "../context.js";
import { canonicalIp } from "./protocol.js";
import { macEqual, nonce } from "./auth.js";
import { Rdma } from "../rdma.js";
import { abandon, connectAttr, makeConnection, startConnection } from "./setup.js";
import { AUTH_SIGNED, CM_MAC_BYTES, CM_NONCE_BYTES, HELLO_BYTES, KIND_ACCEPT, KIND_CONNECT, REJECT_AUTH, REJECT_PROTOCOL, REJECT_REFUSED, acceptMac, decodeChallenge, decodeHello, decodeReject, encodeAuthConnect, encodeAuthRequest, encodeHello, encodeReject, rejectCode, type CmHello } from "./rdmacm-wire.js";

export async function loadCm(choice: ProviderChoice): Promise<RdmaCm> {
  const tcpMsg =
    'setConnectionManager("rdmacm") needs the verbs provider: RDMA CM establishes connections between RDMA devices. The tcp provider connects through the TCP side channel: use setConnectionManager("tcp") (the default) with it';
  if (choice === "tcp") throw new RdmaError("INVALID_ARGUMENT", tcpMsg);
  const provider = await loadProvider(choice);
  if (provider.name !== "verbs") throw new RdmaError("INVALID_ARGUMENT", `${tcpMsg} (provider "auto" chose tcp: no RDMA device with an active port here)`);
  if (!provider.rdmaCm) throw new RdmaError("PROVIDER_UNAVAILABLE", `the ${provider.name} provider has no RDMA CM`);
  return provider.rdmaCm();
}

export async function resolveHost(host: string, forBind: boolean): Promise<string> {
  if (isIP(host)) return host;
  try {
    return (await lookup(host)).address;
  } catch (e) {
    throw new RdmaError(forBind ? "INVALID_ARGUMENT" : "CONNECTION_REFUSED", `cannot resolve host ${JSON.stringify(host)}: ${(e as Error).message}`, { cause: e });
  }
}

export function rdParams(s: ResolvedSettings, attr: DeviceAttr): { responderResources: number; initiatorDepth: number; retryCount: number; rnrRetryCount: number } {
  return {
    responderResources: Math.min(s.maxRdAtomic, attr.maxQpRdAtom, 255),
    initiatorDepth: Math.min(s.maxRdAtomic, attr.maxQpInitRdAtom, 255),
    retryCount: s.retryCount,
    rnrRetryCount: s.rnrRetry,
  };
}

/** RTR/RTS with the CM's path (dgid, sgid index, MTU) and this side's settings. */
export function connectQp(conn: Connection, id: CmId, peerQpn: number, peerPsn: number, s: ResolvedSettings): void {
  const a = id.initQpAttr(2);
  const mtu = a.pathMtu >= 256 ? Math.min(s.mtu, a.pathMtu) : s.mtu;
  conn.qp.connect(
    { provider: "verbs", qpNum: a.destQpNum || peerQpn, psn: peerPsn, lid: a.dlid, gid: a.dgid, port: 0, mtu },
    { ...connectAttr(s), portNum: a.portNum || s.port, gidIndex: a.sgidIndex, mtu },
  );
}

/** After establishment: DISCONNECTED fails the connection; its release disconnects and destroys the id. */
export function attach(rdma: Rdma, conn: Connection, id: CmId): void {
  id.onEvent = (e: CmEvent) => {
    // the DREQ can overtake the peer's last completions (its CLOSE among them): those are taken first
    if (e.type === T.DISCONNECTED) conn.failAfterDrain(new RdmaError("CONNECTION_CLOSED", "the peer disconnected (RDMA CM DISCONNECTED)"));
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
    if (r) return new RdmaError(r.code === REJECT_PROTOCOL ? "PROTOCOL" : r.code === REJECT_AUTH ? "AUTH_FAILED" : "CONNECTION_REFUSED", `${where} refused the connection: ${r.reason}`);
    return new RdmaError("CONNECTION_REFUSED", `connection to ${where} refused (RDMA CM REJECTED: ${mod.rejectReason(e.status)})${e.status === 8 ? ": is the server listening?" : ""}`);
  }
  const st = e.status < 0 ? id.errnoName(-e.status) : String(e.status);
  return new RdmaError("CONNECTION_REFUSED", `cannot reach ${where}: ${step} failed (RDMA CM ${e.name}, status ${st})`, e.status < 0 ? { errnoName: st } : {});
}

/** A CM call's synchronous failure (e.g. ENETUNREACH from rdma_resolve_addr) as CONNECTION_REFUSED naming the step. */
function step(where: string, what: string, fn: () => void): void {
  try {
    fn();
  } catch (e) {
    if (e instanceof RdmaError && (e.code === "INVALID_STATE" || e.code === "PROVIDER_UNAVAILABLE")) throw e;
    const errno = e instanceof RdmaError ? e.errnoName : undefined;
    throw new RdmaError("CONNECTION_REFUSED", `cannot reach ${where}: ${what} failed: ${(e as Error).message}`, errno === undefined ? { cause: e } : { errnoName: errno, cause: e });
  }
}

/**
 * The answer to an auth request: a REJ carrying the server's challenge. A
 * server that accepts it, or refuses it as an unknown kind of hello (it
 * predates authentication), does not authenticate: AUTH_FAILED.
 */
async function challenge(id: CmId, where: string, timeoutMs: number, signal: AbortSignal | undefined, mod: RdmaCm): Promise<Uint8Array> {
  let e: CmEvent;
  try {
    e = await id.next(`authentication challenge from ${where}`, timeoutMs, signal);
  } catch (err) {
    if (err instanceof RdmaError && err.code === "TIMEOUT") throw new RdmaError("TIMEOUT", `connect to ${where} timed out waiting for its authentication challenge`, { cause: err });
    throw err;
  }
  if (e.type === T.REJECTED) {
    const ns = decodeChallenge(e.privateData);
    if (ns) return ns;
  }
  if (e.type === T.CONNECT_RESPONSE) {
    try {
      id.reject(encodeReject(REJECT_AUTH, "this server did not authenticate"));
    } catch {
      /* gone */
    }
    throw new RdmaError("AUTH_FAILED", `the server at ${where} accepted the connection without authenticating itself: refusing it`);
  }
  e.child?.destroy();
  const err = stepError(e, id, "connection (rdma_connect)", where, mod);
  if (err.code === "PROTOCOL" && /unexpected RDMA CM hello kind/.test(err.message)) {
    throw new RdmaError("AUTH_FAILED", `the server at ${where} does not authenticate peers (it predates authentication): ${err.message}`);
  }
  throw err;
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
export async function dialCm(
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
    /** A new CM id resolved to `addr` (the dial's id from then on: the catch destroys it). */
    const resolved = async (): Promise<CmId> => {
      const cmId = mod.createId();
      id = cmId;
      step(where, "address resolution (rdma_resolve_addr)", () => cmId.resolveAddr(src, dst, addr.port, left()));
      await expect(cmId, T.ADDR_RESOLVED, "address resolution (rdma_resolve_addr)", where, left(), signal, mod);
      step(where, "route resolution (rdma_resolve_route)", () => cmId.resolveRoute(left()));
      await expect(cmId, T.ROUTE_RESOLVED, "route resolution (rdma_resolve_route)", where, left(), signal, mod);
      return cmId;
    };
    let cmId = await resolved();
    const info = cmId.info();
    if (!info.deviceName) throw new RdmaError("DEVICE", `RDMA CM resolved ${where} to no RDMA device`);
    if (ctx && ctx.device.name !== info.deviceName) {
      throw new RdmaError("INVALID_ARGUMENT", `the route to ${where} goes through RDMA device ${info.deviceName}, but this connection uses ${ctx.device.name}: set the device to ${info.deviceName} (or none)`);
    }
    if (!ctx) ctx = await local(() => Context.open("verbs", info.deviceName!));
    const dev = ctx.device;
    const s: ResolvedSettings = { ...resolve(dev.attr), port: info.portNum || base.port, cm: "rdmacm" };
    conn = makeConnection(ctx, s, { recvDepth: 0, eagerMax: 0 }, holder);
    const psn = conn.qp.localEndpoint({ portNum: s.port }).psn;
    const qpNum = conn.qp.qpNum;
    const mine: CmHello = { psn, recvDepth: s.recvDepth, eagerMax: s.eagerMax };
    let cred: { key: Buffer; identity: string; signed: Uint8Array } | null = null;
    let pdata: Uint8Array;
    if (s.auth) {
      // 1. ask for a challenge (no hello, nothing for the server to allocate); 2. redial with the proof
      const key = s.auth.clientKey();
      const identity = s.auth.identity;
      const first = cmId;
      step(where, "connection (rdma_connect)", () => first.connect(qpNum, encodeAuthRequest(identity), rdParams(s, dev.attr)));
      const ns = await challenge(first, where, left(), signal, mod);
      first.destroy();
      cmId = await resolved();
      if (cmId.info().deviceName !== dev.name) throw new RdmaError("CONNECTION_REFUSED", `the route to ${where} moved to another RDMA device during the connection`);
      pdata = encodeAuthConnect(mine, ns, nonce(CM_NONCE_BYTES), key, identity, qpNum);
      cred = { key, identity, signed: pdata.subarray(0, AUTH_SIGNED) };
    } else {
      pdata = encodeHello(KIND_CONNECT, mine);
    }
    const last = cmId;
    step(where, "connection (rdma_connect)", () => last.connect(qpNum, pdata, rdParams(s, dev.attr)));
    const ev = await expect(last, T.CONNECT_RESPONSE, "connection (rdma_connect)", where, left(), signal, mod);
    responded = true;
    const peer = decodeHello(ev.privateData, KIND_ACCEPT);
    if (cred) {
      const pd = ev.privateData!;
      const mac = pd.length >= HELLO_BYTES + CM_MAC_BYTES ? pd.subarray(HELLO_BYTES, HELLO_BYTES + CM_MAC_BYTES) : null;
      if (!mac || !macEqual(mac, acceptMac(cred.key, cred.identity, cred.signed, pd, ev.conn?.qpNum ?? 0, qpNum))) {
        throw new RdmaError("AUTH_FAILED", `the server at ${where} did not prove it has the key (its accept ${mac ? "fails its MAC: altered in transit?" : "carries no proof: it does not authenticate"}): refusing it`);
      }
    }
    conn.setPeer({ recvDepth: peer.recvDepth, eagerMax: peer.eagerMax });
    connectQp(conn, last, ev.conn?.qpNum ?? 0, peer.psn, s);
    last.establish();
    const pi = last.info();
    // Siblings (newConnection) dial the address this connection reached, not the name again.
    const reached = { host: pi.peerAddr || dst, port: addr.port };
    const rdma = new Rdma(conn, ctx, s, { addr, redial: (again) => dialCm(s, () => s, reached, undefined, again) }, { address: canonicalIp(pi.peerAddr || dst), port: pi.peerPort || addr.port, identity: cred ? cred.identity : null });
    attach(rdma, conn, last);
    cmIdOf.set(rdma, last);
    // From here on the connection owns the id, QP, CQ and context: its teardown releases them.
    const started = conn;
    conn = null;
    ctx = null;
    id = null;
    startConnection(started, rdma, holder);
    return rdma;
  } catch (e) {
    // assigned in resolved(), which TypeScript's narrowing does not see
    const last = id as CmId | null;
    if (last) {
      if (responded) {
        try {
          last.reject(encodeReject(e instanceof RdmaError ? rejectCode(e) : REJECT_REFUSED, e instanceof Error ? e.message : String(e)));
        } catch {
          /* best effort */
        }
      }
      last.destroy();
    }
    abandon(conn, ctx);
    if (signal?.aborted && !(e instanceof RdmaError && e.code === "ABORTED")) throw new RdmaError("ABORTED", `connect to ${where} aborted`, { cause: e });
    throw e instanceof RdmaError ? e : new RdmaError("DEVICE", `connect to ${where} failed: ${(e as Error)?.message ?? String(e)}`, { cause: e });
  }
}
