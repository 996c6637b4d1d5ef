/**
 * The TCP side channel's client: how connections are established by default, on every
 * provider (dialSideChannel). The server's half is sidechannel-listener.ts, the lines both
 * send sidechannel-wire.ts. One JSON line each way (hello, hello), then the client's "ready";
 * the socket then closes and the connection lives on its QP alone.
 *
 *   client: TCP connect → hello(endpoint, depths, limits) → hello ← → ready →
 *   server: hello → validate → allocate (fork of the listener's context, QP)
 *           → hello → ready ← → hand out
 *
 * The client's side channel ends with the handshake: once its "ready" has left (at most
 * FINAL_LINE_MS) the socket is destroyed. Nothing a peer sends after the handshake is read or
 * kept. Every failure before the connection starts goes through abandon().
 *
 * Authenticated (both sides set a key; auth.ts has the primitives):
 *
 *   client: hello + auth{identity, nonce Nc} →
 *   server:   ← challenge{nonce Ns, proof Ps}      Ps = MAC(K, "server proof", identity, Nc, Ns, client hello)
 *   client: checks Ps, then proof{Pc} →            Pc = MAC(K, "client proof", identity, Nc, Ns, client hello)
 *   server: checks Pc → allocate → hello + auth{mac} ←   mac = MAC(K, "server hello", …, server hello)
 *   client: checks mac → ready →
 */
import * as net from "node:net";
import { RdmaError } from "../../errors.js";
import type { DeviceAttr } from "../../transport/types.js";
import type { Connection } from "../../agent/connection.js";
import type { Context } from "../context.js";
import { LineReader, MAC_BYTES, NONCE_BYTES, helloBytes, localHello, parseHello, peerEndpoint, sendLine, type Hello } from "./sidechannel-wire.js";
import { PROTOCOL_VERSION, canonicalIp } from "./protocol.js";
import { authMac, b64Field, macEqual, nonce } from "./auth.js";
import { Rdma } from "../rdma.js";
import { abandon, connectAttr, makeConnection, openContext, startConnection } from "./setup.js";
import type { ResolvedSettings } from "../settings.js";

/** How long the client's last line ("ready") may take to leave before its side-channel socket is destroyed anyway. */
const FINAL_LINE_MS = 1000;

/**
 * The client's end of the side channel once its last line is written:
 * nothing more is read, and the socket is destroyed once the line has left
 * (or after FINAL_LINE_MS, if the peer does not take it).
 */
function closeAfterLastLine(sock: net.Socket, reader: LineReader): void {
  reader.stop();
  const t = setTimeout(() => sock.destroy(), FINAL_LINE_MS);
  t.unref();
  sock.once("close", () => clearTimeout(t));
  sock.end(() => sock.destroy());
}

/** Client side of the handshake on a context (opened here unless `existing`, a retained one, is given). */
export async function dialSideChannel(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, signal: AbortSignal | undefined, existing?: Context): Promise<Rdma> {
  let ctx: Context | null = existing ?? null;
  let s = base;
  let sock: net.Socket | null = null;
  let conn: Connection | null = null;
  const holder: { rdma: Rdma | null } = { rdma: null };
  let timer: NodeJS.Timeout | null = null;
  const onAbort = (): void => {
    sock?.destroy(new Error("aborted"));
  };
  try {
    if (signal?.aborted) throw new RdmaError("ABORTED", "connect aborted");
    if (!ctx) ({ ctx, s } = await openContext(base, resolve));
    const c = ctx;
    if (signal?.aborted) throw new RdmaError("ABORTED", "connect aborted");
    signal?.addEventListener("abort", onAbort, { once: true });
    sock = net.connect({ host: addr.host, port: addr.port, noDelay: true });
    const s0 = sock;
    timer = setTimeout(() => s0.destroy(new Error("timeout")), s.connectTimeoutMs);
    await new Promise<void>((res, reject) => {
      s0.once("connect", res);
      s0.once("error", (e: NodeJS.ErrnoException) => {
        if (signal?.aborted) reject(new RdmaError("ABORTED", "connect aborted"));
        else if (e.message === "timeout") reject(new RdmaError("TIMEOUT", `connect to ${addr.host}:${addr.port} timed out after ${s.connectTimeoutMs} ms`));
        else if (e.code === "ECONNREFUSED") reject(new RdmaError("CONNECTION_REFUSED", `connection to ${addr.host}:${addr.port} refused: is the server listening?`, { errnoName: e.code, ...(e.syscall === undefined ? {} : { syscall: e.syscall }), cause: e }));
        else reject(new RdmaError("CONNECTION_REFUSED", `cannot reach ${addr.host}:${addr.port}: ${e.message}`, { errnoName: e.code ?? "EIO", ...(e.syscall === undefined ? {} : { syscall: e.syscall }), cause: e }));
      });
    });
    const reader = new LineReader(sock);
    const where = `${addr.host}:${addr.port}`;
    const peerAddr = { raw: sock.remoteAddress ?? addr.host, address: canonicalIp(sock.remoteAddress ?? addr.host), port: sock.remotePort ?? addr.port };
    conn = makeConnection(c, s, { recvDepth: 0, eagerMax: 0 }, holder);
    const mine = localHello(c, conn, s);
    const cred = s.auth ? { key: s.auth.clientKey(), identity: s.auth.identity, nc: nonce(NONCE_BYTES), ns: Buffer.alloc(0) as Buffer, mine: helloBytes(parseHello(mine, c.provider.name)) } : null;
    if (cred) mine.auth = { identity: cred.identity, nonce: cred.nc.toString("base64") };
    sendLine(sock, mine);
    let msg = await reader.nextJson().catch(rethrowTimeout(s, addr));
    if (cred) {
      cred.ns = clientProve(sock, msg, cred, c.provider.name, where);
      msg = await reader.nextJson().catch(rethrowTimeout(s, addr));
    }
    const reply = parseHello(msg, c.provider.name);
    if (cred) {
      const a = msg.auth as { mac?: unknown } | undefined;
      let mac: Buffer | null = null;
      try {
        mac = b64Field(typeof a === "object" && a !== null ? a.mac : undefined, "auth.mac", MAC_BYTES);
      } catch {
        /* refused below */
      }
      if (!mac || !macEqual(mac, authMac(cred.key, "side-channel server hello", cred.identity, cred.nc, cred.ns, cred.mine, helloBytes(reply)))) {
        throw new RdmaError("AUTH_FAILED", `the hello of the server at ${where} failed its authentication (altered in transit?): refusing it`);
      }
    }
    const endpoint = peerEndpoint(reply.endpoint, sock);
    conn.setPeer({ recvDepth: reply.recvDepth, eagerMax: reply.eagerMax, ...(reply.maxMessageSize === undefined ? {} : { maxMessageSize: reply.maxMessageSize }) });
    conn.qp.connect(endpoint, connectAttr(s, reply.maxRdAtomic));
    sendLine(sock, { ready: true });
    closeAfterLastLine(sock, reader);
    sock = null;
    const settings = s;
    // Siblings (newConnection) dial the address this connection reached, not the name again:
    // a name may resolve to another server, which would not share this protection domain.
    const reached = { host: peerAddr.raw, port: peerAddr.port };
    const rdma = new Rdma(conn, c, s, { addr, redial: (again) => dialSideChannel(settings, () => settings, reached, undefined, again) }, { address: peerAddr.address, port: peerAddr.port, identity: cred ? cred.identity : null });
    const started = conn;
    conn = null;
    ctx = null;
    startConnection(started, rdma, holder);
    return rdma;
  } catch (e) {
    sock?.destroy();
    abandon(conn, ctx);
    if (signal?.aborted && !(e instanceof RdmaError && e.code === "ABORTED")) throw new RdmaError("ABORTED", `connect to ${addr.host}:${addr.port} aborted`, { cause: e });
    throw e;
  } finally {
    if (timer) clearTimeout(timer);
    signal?.removeEventListener("abort", onAbort);
  }
}

/**
 * The client's side of the challenge: `msg` is the server's first answer.
 * Checks the server's proof (mutual authentication: a server without the
 * key, or that does not authenticate at all, is refused), then sends the
 * client's proof. Returns the server's nonce.
 */
function clientProve(sock: net.Socket, msg: Record<string, unknown>, cred: { key: Buffer; identity: string; nc: Buffer; mine: Buffer }, provider: Hello["provider"], where: string): Buffer {
  // another version, or a refusal (AUTH_FAILED when the server refused to authenticate): parseHello says which
  if (msg.asyncRdma !== PROTOCOL_VERSION || typeof msg.error === "string") parseHello(msg, provider);
  const ch = msg.challenge;
  if (ch === undefined) {
    throw new RdmaError("AUTH_FAILED", `the server at ${where} did not authenticate itself (it has no key set, or predates authentication): refusing it`);
  }
  if (typeof ch !== "object" || ch === null || Array.isArray(ch)) throw new RdmaError("PROTOCOL", "handshake field challenge is invalid");
  const c = ch as { nonce?: unknown; proof?: unknown };
  const ns = b64Field(c.nonce, "challenge.nonce", NONCE_BYTES);
  const ps = b64Field(c.proof, "challenge.proof", MAC_BYTES);
  if (!macEqual(ps, authMac(cred.key, "side-channel server proof", cred.identity, cred.nc, ns, cred.mine))) {
    sendLine(sock, { asyncRdma: PROTOCOL_VERSION, error: "the server's proof is wrong", code: "AUTH_FAILED" });
    throw new RdmaError("AUTH_FAILED", `the server at ${where} did not prove it has the key: the keys differ, or the server does not know identity ${JSON.stringify(cred.identity)}`);
  }
  sendLine(sock, { proof: authMac(cred.key, "side-channel client proof", cred.identity, cred.nc, ns, cred.mine).toString("base64") });
  return ns;
}

function rethrowTimeout(s: ResolvedSettings, addr: { host: string; port: number }) {
  return (e: unknown): never => {
    if (e instanceof RdmaError && e.code === "CONNECTION_CLOSED" && (e.cause as Error | undefined)?.message === "timeout") {
      throw new RdmaError("TIMEOUT", `handshake with ${addr.host}:${addr.port} timed out after ${s.connectTimeoutMs} ms`);
    }
    throw e;
  };
}

