/**
 * The RDMA CM server: a listening CM id behind an RdmaListener (rdmacm.ts has the client and
 * what both sides share, rdmacm-wire.ts the private data). It owns:
 *
 * - the contexts, one per device an incoming request arrives on (one for an address bound to a
 *   device, opened at once so settings are checked at bind); every accepted connection gets a
 *   fork of its device's context (its own PD and pool), as on the side channel;
 * - admission before anything is allocated: the hello is decoded and checked, and with
 *   authentication (setAuth) the challenge nonce must be outstanding and the MAC right for the
 *   identity it was issued to (admit); auth requests are answered with a challenge at once
 *   (challengeOf), keeping nothing but the nonce;
 * - the listener's bounds, checked on CONNECT_REQUEST: connections held (`maxConnections`),
 *   handshakes under way (`maxHandshakes`), and at most half of those per source address;
 * - every failure of a request goes through abandon(); once started the connection's own
 *   teardown frees it (startConnection), and its CM id (attach).
 */
import { RdmaError } from "../../errors.js";
import { CmEventType as T, type CmEvent, type CmId, type DeviceAttr } from "../../transport/types.js";
import type { Connection } from "../../agent/connection.js";
import type { ResolvedSettings } from "../settings.js";
import { Context } from "../context.js";
import { Rdma } from "../rdma.js";
import { canonicalIp } from "./protocol.js";
import { AUTH_FAILED_WIRE, ChallengeTable, authRefusal, macEqual, wireMessage } from "./auth.js";
import { abandon, makeConnection, startConnection } from "./setup.js";
import type { ListenerSink, ListenerSource } from "./establisher.js";
import { attach, cmIdOf, connectQp, loadCm, rdParams, resolveHost } from "./rdmacm.js";
import { CM_MAC_BYTES, CM_NONCE_BYTES, HELLO_BYTES, KIND_ACCEPT, KIND_AUTH_CONNECT, KIND_AUTH_REQUEST, KIND_CONNECT, REJECT_AUTH, REJECT_PROTOCOL, REJECT_REFUSED, acceptMac, connectMac, decodeAuthConnect, decodeAuthRequest, decodeHello, decodeReject, encodeChallenge, encodeHello, encodeReject, kindOf, rejectCode, type CmHello } from "./rdmacm-wire.js";

const REQUIRED_WIRE = "this server requires authentication: set the key with setAuth({ key, identity })";
const NO_AUTH_WIRE = "this server does not authenticate peers (it has no key): the client's key cannot be checked";

type DeviceContext = { ctx: Context; s: ResolvedSettings };
/** What the accept's MAC needs of an authenticated request. */
type Authed = { key: Buffer; identity: string; signed: Uint8Array };

/**
 * Server side: an RDMA CM listening id behind an RdmaListener. Contexts are
 * opened per device an incoming request arrives on (one for an address bound
 * to a device, opened at once so settings are checked at bind); every
 * accepted connection gets a fork of its device's context (its own PD and
 * pool), as on the side channel. The hello is decoded and checked before
 * anything is allocated; every failure goes through abandon().
 */
export class CmListener implements ListenerSource {
  private readonly contexts = new Map<string, Promise<DeviceContext>>();
  private bound: Context | null = null;
  private readonly pending = new Set<CmId>();
  private closed = false;
  /** Outstanding challenges: each a fresh nonce, used once, expiring with the connect timeout; as many as pre-hello sockets on the side channel. */
  private readonly challenges: ChallengeTable;
  /** Connections that hold (or are about to take) a context fork: being set up, or established and not yet released. */
  private live = 0;
  /** Handshakes under way per source address: one address holds at most half of maxHandshakes. */
  private readonly pendingFrom = new Map<string, number>();
  private readonly slotShare: number;
  /** The listener's authentication (setAuth), as it was at bind. */
  private readonly auth: ResolvedSettings["auth"];
  private local: { host: string; port: number } = { host: "", port: 0 };

  private constructor(
    private readonly base: ResolvedSettings,
    private readonly resolve: (attr: DeviceAttr) => ResolvedSettings,
    private readonly sink: ListenerSink,
    private readonly id: CmId,
  ) {
    this.challenges = new ChallengeTable(16 * base.maxHandshakes, base.connectTimeoutMs, CM_NONCE_BYTES);
    this.slotShare = Math.max(1, Math.ceil(base.maxHandshakes / 2));
    this.auth = base.auth;
  }

  static async bind(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, sink: ListenerSink): Promise<CmListener> {
    const mod = await loadCm(base.provider);
    const host = await resolveHost(addr.host, true);
    const id = mod.createId();
    const l = new CmListener(base, resolve, sink, id);
    let info;
    try {
      try {
        id.bind(host, addr.port);
      } catch (e) {
        const errno = e instanceof RdmaError ? e.errnoName : undefined;
        const why = errno === "EADDRINUSE" ? "the address is in use (another server listens there): choose another port, or stop that server" : errno === "EADDRNOTAVAIL" || errno === "ENODEV" ? "no RDMA device has that address" : (e as Error).message;
        throw new RdmaError(errno === "EADDRINUSE" ? "ADDRESS_IN_USE" : "INVALID_ARGUMENT", `cannot listen on ${addr.host}:${addr.port} with RDMA CM: ${why}`, errno === undefined ? { cause: e } : { errnoName: errno, syscall: "rdma_bind_addr", cause: e });
      }
      info = id.info();
      if (info.deviceName) l.bound = (await l.contextFor(info.deviceName, info.portNum)).ctx;
      id.listen(128);
    } catch (e) {
      id.destroy();
      await l.releaseContexts();
      throw e;
    }
    id.onEvent = (e: CmEvent) => l.onEvent(e);
    l.local = { host: info.localAddr || addr.host, port: info.localPort };
    return l;
  }

  address(): { host: string; port: number } {
    return this.local;
  }

  handshakes(): number {
    return this.pending.size;
  }

  sockets(): number {
    return 0;
  }

  connections(): number {
    return this.live;
  }

  context(): Context | null {
    return this.closed ? null : this.bound;
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.id.destroy();
    this.challenges.clear();
    for (const c of [...this.pending]) c.destroy();
    await this.releaseContexts();
  }

  /** The context (and settings) of device `name`, opened on first use. */
  private contextFor(name: string, port: number): Promise<DeviceContext> {
    const { base, resolve, contexts } = this;
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
  }

  private async releaseContexts(): Promise<void> {
    const all = [...this.contexts.values()];
    this.contexts.clear();
    for (const r of await Promise.allSettled(all)) if (r.status === "fulfilled") r.value.ctx.release();
  }

  /**
   * Checks an incoming REQ's authentication before anything is allocated:
   * an auth connect's nonce must be outstanding, its MAC right for the
   * identity the challenge was issued to; the nonce is used up only then. Returns the hello
   * and, when authenticated, what the accept's MAC needs.
   */
  private admit(ev: CmEvent, who: string): { hello: CmHello; authed: Authed | null } {
    const { auth, challenges } = this;
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
  }

  /** An auth request: answered with a challenge (a REJ), synchronously; nothing else is kept than the nonce. */
  private challengeOf(child: CmId, ev: CmEvent): void {
    const { auth, challenges, sink } = this;
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
  }

  private async handle(child: CmId, ev: CmEvent, source: string): Promise<void> {
    const { pending, pendingFrom, sink } = this;
    pending.add(child);
    pendingFrom.set(source, (pendingFrom.get(source) ?? 0) + 1);
    // This request's place under maxConnections, taken now (onEvent checked it) and given back
    // once: by its fork's release (every way the connection ends), or here if it never forks.
    this.live++;
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
      const { hello, authed } = this.admit(ev, `${ci.peerAddr}:${ci.peerPort}`);
      if (!ci.deviceName) throw new RdmaError("DEVICE", "the connection request arrived on no RDMA device");
      if (this.closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      const entry = await this.contextFor(ci.deviceName, ci.portNum);
      const s = entry.s;
      if (this.closed) throw new RdmaError("CONNECTION_REFUSED", "the listener is closed");
      // A protection domain and pool of its own: no other connection can reach what it grants or lends.
      ctx = entry.ctx.fork(() => this.live--);
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
        if (!forked) this.live--;
      }
      sink.reject(err);
    }
  }

  private onEvent(e: CmEvent): void {
    const { base, pending, pendingFrom, slotShare } = this;
    if (e.type === T.CONNECT_REQUEST && e.child) {
      if (!this.closed && kindOf(e.privateData) === KIND_AUTH_REQUEST) return this.challengeOf(e.child, e);
      let source = "";
      try {
        source = canonicalIp(e.child.info().peerAddr);
      } catch {
        /* refused below as any other */
      }
      const mine = pendingFrom.get(source) ?? 0;
      const why = this.closed
        ? "the listener is closed"
        : this.live >= base.maxConnections
          ? `the server is full: it holds ${this.live} connections (its limit); retry later`
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
      void this.handle(e.child, e, source);
    } else {
      e.child?.destroy();
    }
  }
}
