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
 * Private data: rdmacm-wire.ts (the codec, every byte and MAC input).
 *
 * The CM id lives as long as the connection: a DISCONNECTED event (the peer
 * closed, or died and its kernel tore the id down) fails the connection with
 * CONNECTION_CLOSED; releasing the connection disconnects and destroys the id.
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
import { AUTH_FAILED_WIRE, ChallengeTable, authRefusal, macEqual, nonce, wireMessage } from "./auth.js";
import { Rdma } from "../rdma.js";
import { abandon, connectAttr, makeConnection, startConnection } from "./setup.js";
import type { Establisher, ListenerSink, ListenerSource } from "./establisher.js";
import { AUTH_SIGNED, CM_MAC_BYTES, CM_NONCE_BYTES, HELLO_BYTES, KIND_ACCEPT, KIND_AUTH_CONNECT, KIND_AUTH_REQUEST, KIND_CONNECT, REJECT_AUTH, REJECT_PROTOCOL, REJECT_REFUSED, acceptMac, connectMac, decodeAuthConnect, decodeAuthRequest, decodeChallenge, decodeHello, decodeReject, encodeAuthConnect, encodeAuthRequest, encodeChallenge, encodeHello, encodeReject, kindOf, rejectCode, type CmHello } from "./rdmacm-wire.js";

const REQUIRED_WIRE = "this server requires authentication: set the key with setAuth({ key, identity })";
const NO_AUTH_WIRE = "this server does not authenticate peers (it has no key): the client's key cannot be checked";

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
      const errno = e instanceof RdmaError ? e.errnoName : undefined;
      const why = errno === "EADDRINUSE" ? "the address is in use (another server listens there): choose another port, or stop that server" : errno === "EADDRNOTAVAIL" || errno === "ENODEV" ? "no RDMA device has that address" : (e as Error).message;
      throw new RdmaError(errno === "EADDRINUSE" ? "ADDRESS_IN_USE" : "INVALID_ARGUMENT", `cannot listen on ${addr.host}:${addr.port} with RDMA CM: ${why}`, errno === undefined ? { cause: e } : { errnoName: errno, syscall: "rdma_bind_addr", cause: e });
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

  const auth = base.auth;
  /** Outstanding challenges: each a fresh nonce, used once, expiring with the connect timeout; as many as pre-hello sockets on the side channel. */
  const challenges = new ChallengeTable(16 * base.maxHandshakes, base.connectTimeoutMs, CM_NONCE_BYTES);

  /**
   * Checks an incoming REQ's authentication before anything is allocated:
   * an auth connect's nonce must be outstanding, its MAC right for the
   * identity the challenge was issued to; the nonce is used up only then. Returns the hello
   * and, when authenticated, what the accept's MAC needs.
   */
  const admit = (ev: CmEvent, who: string): { hello: CmHello; authed: { key: Buffer; identity: string; signed: Uint8Array } | null } => {
    const pd = ev.privateData;
    if (kindOf(pd) === KIND_AUTH_CONNECT) {
      if (!auth) throw authRefusal(`client ${who} authenticates, but this listener has no key (setAuth)`, NO_AUTH_WIRE);
      const r = decodeAuthConnect(pd!);
      const identity = challenges.peek(r.ns);
      if (identity === null) throw authRefusal(`client ${who}: its challenge nonce is unknown, expired or already used (a replay?)`, "authentication failed: the challenge is unknown, expired or already used");
      const rk = auth.resolve(identity);
      const ok = macEqual(r.mac, connectMac(rk.key, identity, r.signed, ev.conn?.qpNum ?? 0));
      if (!ok || !rk.known) throw authRefusal(`client ${who} (identity ${JSON.stringify(identity)}) failed authentication: ${rk.known ? "wrong MAC (wrong key, or the request was altered)" : rk.why}`, AUTH_FAILED_WIRE);
      // Spent only now: a forged request (an eavesdropper's, with the nonce it saw) must not use up
      // the nonce of the client it was issued to.
      challenges.take(r.ns);
      return { hello: decodeHello(pd, KIND_AUTH_CONNECT), authed: { key: rk.key, identity, signed: r.signed } };
    }
    const hello = decodeHello(pd, KIND_CONNECT);
    if (auth) throw authRefusal(`client ${who} did not authenticate: this listener requires it (setAuth)`, REQUIRED_WIRE);
    return { hello, authed: null };
  };

  /** An auth request: answered with a challenge (a REJ), synchronously; nothing else is kept than the nonce. */
  const challengeOf = (child: CmId, ev: CmEvent): void => {
    let pdata: Uint8Array;
    try {
      const ci = child.info();
      const who = `${ci.peerAddr}:${ci.peerPort}`;
      if (!auth) throw authRefusal(`client ${who} asks to authenticate, but this listener has no key (setAuth)`, NO_AUTH_WIRE);
      const ns = challenges.issue(decodeAuthRequest(ev.privateData!));
      pdata = ns ? encodeChallenge(ns) : encodeReject(REJECT_REFUSED, `the server is busy: ${challenges.size} authentication challenges are outstanding (its limit); retry later`);
    } catch (e) {
      const err = e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e));
      pdata = encodeReject(rejectCode(err), wireMessage(err));
      sink.reject(err);
    }
    try {
      child.reject(pdata);
    } catch {
      /* the client is gone */
    }
    child.destroy();
  };

  /** Connections that hold (or are about to take) a context fork: being set up, or established and not yet released. */
  let live = 0;
  /** Handshakes under way per source address: one address holds at most half of maxHandshakes. */
  const pendingFrom = new Map<string, number>();
  const slotShare = Math.max(1, Math.ceil(base.maxHandshakes / 2));

  const handle = async (child: CmId, ev: CmEvent, source: string): Promise<void> => {
    pending.add(child);
    pendingFrom.set(source, (pendingFrom.get(source) ?? 0) + 1);
    // This request's place under maxConnections, taken now (onEvent checked it) and given back
    // once: by its fork's release (every way the connection ends), or here if it never forks.
    live++;
    let forked = false;
    const unpend = (): void => {
      if (!pending.delete(child)) return;
      const n = (pendingFrom.get(source) ?? 1) - 1;
      if (n > 0) pendingFrom.set(source, n);
      else pendingFrom.delete(source);
    };
    let conn: Connection | null = null;
    let ctx: Context | null = null;
    let accepted = false;
    let handedOver = false;
    const holder: { rdma: Rdma | null } = { rdma: null };
    try {
      const ci = child.info();
      const { hello, authed } = admit(ev, `${ci.peerAddr}:${ci.peerPort}`);
      if (!ci.deviceName) throw new RdmaError("DEVICE", "the connection request arrived on no RDMA device");
      if (closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      const entry = await contextFor(ci.deviceName, ci.portNum);
      const s = entry.s;
      if (closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      // A protection domain and pool of its own: no other connection can reach what it grants or lends.
      ctx = entry.ctx.fork(() => live--);
      forked = true;
      conn = makeConnection(ctx, s, { recvDepth: hello.recvDepth, eagerMax: hello.eagerMax }, holder);
      const clientQpn = ev.conn?.qpNum ?? 0;
      connectQp(conn, child, clientQpn, hello.psn, s);
      const psn = conn.qp.localEndpoint({ portNum: s.port }).psn;
      const rep = encodeHello(KIND_ACCEPT, { psn, recvDepth: s.recvDepth, eagerMax: s.eagerMax });
      let pdata = rep;
      if (authed) {
        pdata = new Uint8Array(HELLO_BYTES + CM_MAC_BYTES);
        pdata.set(rep);
        pdata.set(acceptMac(authed.key, authed.identity, authed.signed, rep, conn.qp.qpNum, clientQpn), HELLO_BYTES);
      }
      child.accept(conn.qp.qpNum, pdata, rdParams(s, ctx.device.attr));
      accepted = true;
      const est = await child.next("waiting for ESTABLISHED", s.connectTimeoutMs);
      if (est.type !== T.ESTABLISHED) {
        const r = est.type === T.REJECTED ? decodeReject(est.privateData) : null;
        const code = r?.code === REJECT_PROTOCOL ? "PROTOCOL" : r?.code === REJECT_AUTH ? "AUTH_FAILED" : "CONNECTION_CLOSED";
        throw new RdmaError(code, `the client ${ci.peerAddr}:${ci.peerPort} did not complete the connection (RDMA CM ${est.name}${r ? `: ${r.reason}` : ""})`);
      }
      // The Rdma, and so the peer's identity, exists before the connection processes any message.
      const rdma = new Rdma(conn, ctx, s, null, { address: canonicalIp(ci.peerAddr), port: ci.peerPort, identity: authed ? authed.identity : null });
      attach(rdma, conn, child);
      cmIdOf.set(rdma, child);
      unpend();
      // From here on the connection owns the id, QP, CQ and context: its teardown releases them.
      const started = conn;
      conn = null;
      ctx = null;
      handedOver = true;
      startConnection(started, rdma, holder);
      // A connection that failed as it started (a malformed message that came first) is never handed out.
      if (started.failure) throw started.failure;
      sink.push(rdma);
    } catch (e) {
      unpend();
      const err = e instanceof RdmaError ? e : new RdmaError("PROTOCOL", String(e));
      if (!handedOver) {
        if (!accepted && !child.isDestroyed) {
          try {
            child.reject(encodeReject(rejectCode(err), wireMessage(err)));
          } catch {
            /* the client is gone */
          }
        } else {
          child.disconnect();
        }
        child.destroy();
        abandon(conn, ctx);
        if (!forked) live--;
      }
      sink.reject(err);
    }
  };

  id.onEvent = (e: CmEvent) => {
    if (e.type === T.CONNECT_REQUEST && e.child) {
      if (!closed && kindOf(e.privateData) === KIND_AUTH_REQUEST) return challengeOf(e.child, e);
      let source = "";
      try {
        source = canonicalIp(e.child.info().peerAddr);
      } catch {
        /* refused below as any other */
      }
      const mine = pendingFrom.get(source) ?? 0;
      const why = closed
        ? "the listener is closed"
        : live >= base.maxConnections
          ? `the server is full: it holds ${live} connections (its limit); retry later`
          : pending.size >= base.maxHandshakes
            ? `the server is busy: ${pending.size} connections are being set up (its limit); retry later`
            : mine >= slotShare
              ? `the server is busy: ${mine} connections from ${source} are being set up (the most one address may have: half of ${base.maxHandshakes}); retry later`
              : null;
      if (why !== null) {
        try {
          e.child.reject(encodeReject(REJECT_REFUSED, why));
        } catch {
          /* gone */
        }
        e.child.destroy();
        return;
      }
      void handle(e.child, e, source);
    } else {
      e.child?.destroy();
    }
  };

  const local = { host: info.localAddr || addr.host, port: info.localPort };
  return {
    address: () => local,
    handshakes: () => pending.size,
    sockets: () => 0,
    connections: () => live,
    context: () => (closed ? null : bound),
    close: async () => {
      if (closed) return;
      closed = true;
      id.destroy();
      challenges.clear();
      for (const c of [...pending]) c.destroy();
      await releaseContexts();
    },
  };
}

export const rdmaCmEstablisher: Establisher = { name: "rdmacm", dial: dialCm, bind: bindCm };
