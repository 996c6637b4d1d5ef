/**
 * The TCP side channel that exchanges QP endpoints, then closes. Messages are
 * JSON lines, at most 16 KiB each, validated field by field:
 *
 *   client → server  {"asyncRdma":1,"provider":…,"endpoint":…,"recvDepth":…,"eagerMax":…}
 *   server → client  the same fields, or {"asyncRdma":1,"error":"…"}
 *   client → server  {"ready":true}   (after the client's QP reached RTS, so the
 *                                      server never sends to a QP that cannot receive)
 *
 * With authentication (setAuth) a challenge and a proof come between the
 * hellos (sidechannel.ts, docs/wire-format.md); an error line refusing
 * authentication carries "code":"AUTH_FAILED".
 */
import * as net from "node:net";
import { RdmaError } from "../../errors.js";
import type { Endpoint, ProviderName } from "../../transport/types.js";
import type { Connection } from "../../agent/connection.js";
import type { Context } from "../context.js";
import type { ResolvedSettings } from "../settings.js";
import { PROTOCOL_VERSION, canonicalIp } from "./protocol.js";

const MAX_LINE = 16 * 1024;
/** Bytes of each side's nonce (authenticated handshake). */
export const NONCE_BYTES = 16;
/** Bytes of a proof or MAC (HMAC-SHA256, whole). */
export const MAC_BYTES = 32;

export interface Hello {
  asyncRdma: number;
  provider: ProviderName;
  endpoint: Endpoint;
  recvDepth: number;
  eagerMax: number;
  /** Largest message the side accepts (absent from older peers). */
  maxMessageSize?: number;
  /** READs and atomics the side accepts in flight as responder (absent from older peers). */
  maxRdAtomic?: number;
}

/**
 * Reads JSON lines from a socket, one at a time. What it holds is bounded
 * whatever the peer sends: a line is at most MAX_LINE characters (a longer
 * one, with or without its newline, fails the reader), the socket is paused
 * while read lines wait for their reader (TCP flow control holds the peer
 * back), and a reader that failed or was stopped reads nothing more. Partial
 * lines are kept as a list of chunks, joined once per line, so a line that
 * arrives a byte at a time costs linear work.
 */
export class LineReader {
  private parts: string[] = [];
  private partLen = 0;
  private lines: string[] = [];
  private waiter: { resolve: (l: string) => void; reject: (e: unknown) => void } | null = null;
  private error: RdmaError | null = null;
  private readonly onData = (d: string): void => this.take(d);

  constructor(private readonly sock: net.Socket) {
    sock.setEncoding("utf8");
    sock.on("data", this.onData);
    sock.on("error", (e: NodeJS.ErrnoException) => this.failWith(new RdmaError("CONNECTION_CLOSED", `handshake connection failed: ${e.message}`, { errnoName: e.code ?? "EIO", ...(e.syscall === undefined ? {} : { syscall: e.syscall }), cause: e })));
    sock.on("close", () => this.failWith(new RdmaError("CONNECTION_CLOSED", "the peer closed the handshake connection")));
  }

  private take(d: string): void {
    if (this.error) return;
    let from = 0;
    let i: number;
    while ((i = d.indexOf("\n", from)) >= 0) {
      // every line is bounded, however it arrives (one read or many)
      if (this.partLen + (i - from) > MAX_LINE) return this.failWith(new RdmaError("PROTOCOL", "handshake message too long"));
      this.parts.push(d.slice(from, i));
      this.lines.push(this.parts.length === 1 ? this.parts[0]! : this.parts.join(""));
      this.parts = [];
      this.partLen = 0;
      from = i + 1;
    }
    if (from < d.length) {
      if (this.partLen + (d.length - from) > MAX_LINE) return this.failWith(new RdmaError("PROTOCOL", "handshake message too long"));
      this.parts.push(from === 0 ? d : d.slice(from));
      this.partLen += d.length - from;
    }
    this.pump();
    // lines nobody asked for yet: read no more until they are taken
    if (this.lines.length > 0 && !this.waiter) this.sock.pause();
  }

  /**
   * Stops reading (the handshake is over, or failed): nothing more is read
   * from the socket or kept, whatever the peer sends. The caller closes it.
   */
  stop(): void {
    if (!this.error) this.error = new RdmaError("CONNECTION_CLOSED", "the handshake connection is closed");
    this.detach();
  }

  private detach(): void {
    this.sock.off("data", this.onData);
    this.sock.pause();
    this.parts = [];
    this.partLen = 0;
  }

  private failWith(e: RdmaError): void {
    if (!this.error) {
      this.error = e;
      this.detach();
    }
    this.pump();
  }

  private pump(): void {
    const w = this.waiter;
    if (!w) return;
    if (this.lines.length > 0) {
      this.waiter = null;
      w.resolve(this.lines.shift()!);
    } else if (this.error) {
      this.waiter = null;
      w.reject(this.error);
    }
  }

  next(): Promise<string> {
    return new Promise((resolve, reject) => {
      this.waiter = { resolve, reject };
      this.pump();
      if (this.waiter && !this.error) this.sock.resume();
    });
  }

  async nextJson(): Promise<Record<string, unknown>> {
    const line = await this.next();
    let v: unknown;
    try {
      v = JSON.parse(line);
    } catch {
      throw new RdmaError("PROTOCOL", "handshake message is not JSON: is the other side an async-rdma endpoint?");
    }
    if (typeof v !== "object" || v === null || Array.isArray(v)) throw new RdmaError("PROTOCOL", "handshake message is not an object");
    return v as Record<string, unknown>;
  }
}

/**
 * A hello's content in one canonical form (what the authentication MACs
 * cover): provider, every endpoint field as sent, depths and limits. Both
 * sides compute it from the validated hello, so JSON spelling does not matter.
 */
/** This side's hello: its endpoint and what it accepts (the fields parseHello checks on the other side). */
export function localHello(ctx: Context, conn: Connection, s: ResolvedSettings): Record<string, unknown> {
  return {
    asyncRdma: PROTOCOL_VERSION,
    provider: ctx.provider.name,
    endpoint: conn.qp.localEndpoint({ portNum: s.port, gidIndex: s.gidIndex }),
    recvDepth: s.recvDepth,
    eagerMax: s.eagerMax,
    maxMessageSize: s.maxMessageSize,
    maxRdAtomic: s.maxRdAtomic,
  };
}

export function helloBytes(h: Hello): Buffer {
  const e = h.endpoint;
  return Buffer.from(JSON.stringify([h.provider, e.qpNum, e.psn, e.lid, e.gid, e.port, e.mtu, h.recvDepth, h.eagerMax, h.maxMessageSize ?? null, h.maxRdAtomic ?? null]), "utf8");
}

export function sendLine(sock: net.Socket, v: unknown): void {
  sock.write(JSON.stringify(v) + "\n");
}

function int(v: unknown, name: string, min: number, max: number): number {
  if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > max) throw new RdmaError("PROTOCOL", `handshake field ${name} is invalid`);
  return v;
}

const MTUS = [256, 512, 1024, 2048, 4096];

/**
 * The endpoint's address, checked for its provider before anything is
 * allocated: tcp names an IP address (a hostname would make us resolve and
 * dial whatever the peer chose) and a port; verbs names a GID in IPv6 form,
 * neither unspecified nor multicast.
 */
function checkGid(provider: ProviderName, gid: unknown): string {
  if (typeof gid !== "string" || gid.length === 0 || gid.length >= 64) throw new RdmaError("PROTOCOL", "handshake endpoint has no gid");
  if (provider === "tcp") {
    if (net.isIP(gid) === 0) throw new RdmaError("PROTOCOL", `handshake endpoint address ${JSON.stringify(gid)} is not an IP address`);
  } else {
    if (!net.isIPv6(gid)) throw new RdmaError("PROTOCOL", `handshake endpoint GID ${JSON.stringify(gid)} is not in IPv6 form`);
    const c = canonicalIp(gid);
    if (c === "::" || /^ff/i.test(c)) throw new RdmaError("PROTOCOL", `handshake endpoint GID ${gid} is not a unicast GID`);
  }
  return gid;
}

/**
 * Validates a peer's hello (both directions): every field, before anything
 * is allocated for the connection.
 */
export function parseHello(v: Record<string, unknown>, expectProvider: ProviderName): Hello {
  if (v.asyncRdma !== PROTOCOL_VERSION) {
    throw new RdmaError("PROTOCOL", `protocol version mismatch: the peer speaks ${JSON.stringify(v.asyncRdma ?? "an unknown protocol")}, this side ${PROTOCOL_VERSION}; upgrade the older side`);
  }
  if (typeof v.error === "string") {
    if (v.code === "AUTH_FAILED") throw new RdmaError("AUTH_FAILED", `the peer refused the connection: ${v.error.slice(0, 500)}`);
    throw new RdmaError("CONNECTION_REFUSED", `the peer refused the connection: ${v.error.slice(0, 500)}`);
  }
  if (v.provider !== expectProvider) {
    throw new RdmaError("PROTOCOL", `provider mismatch: the peer uses ${JSON.stringify(v.provider)}, this side ${expectProvider}; choose the same provider on both ends`);
  }
  const e = v.endpoint as Record<string, unknown> | undefined;
  if (!e || typeof e !== "object" || Array.isArray(e)) throw new RdmaError("PROTOCOL", "handshake has no endpoint");
  if (e.provider !== undefined && e.provider !== expectProvider) throw new RdmaError("PROTOCOL", `handshake endpoint is for provider ${JSON.stringify(e.provider)}, this side ${expectProvider}`);
  const endpoint: Endpoint = {
    provider: expectProvider,
    qpNum: int(e.qpNum, "qpNum", 0, 0xffffff),
    psn: int(e.psn, "psn", 0, 0xffffff),
    lid: int(e.lid, "lid", 0, 0xffff),
    gid: checkGid(expectProvider, e.gid),
    // tcp: the device's TCP port, dialed by the QP; verbs: unused
    port: int(e.port, "port", expectProvider === "tcp" ? 1 : 0, 65535),
    mtu: int(e.mtu, "mtu", 256, 4096),
  };
  if (!MTUS.includes(endpoint.mtu)) throw new RdmaError("PROTOCOL", "handshake field mtu is invalid");
  return {
    asyncRdma: PROTOCOL_VERSION,
    provider: expectProvider,
    endpoint,
    recvDepth: int(v.recvDepth, "recvDepth", 8, 65536),
    eagerMax: int(v.eagerMax, "eagerMax", 0, 1 << 20),
    ...(v.maxMessageSize === undefined ? {} : { maxMessageSize: int(v.maxMessageSize, "maxMessageSize", 1, 2 ** 31) }),
    ...(v.maxRdAtomic === undefined ? {} : { maxRdAtomic: int(v.maxRdAtomic, "maxRdAtomic", 1, 255) }),
  };
}

const WILDCARDS = new Set(["0.0.0.0", "::"]);

/**
 * The endpoint to connect to, given the side channel it came over. The tcp
 * provider dials the endpoint's address: the only host it may dial is the
 * side channel's peer, so a wildcard address (a device listening on all
 * interfaces, what the API always opens) is replaced by the peer's address,
 * and any other address than the peer's is refused (PROTOCOL) before
 * anything is allocated. A verbs endpoint names the peer device's GID, which
 * may legitimately sit on another network than the side channel (a separate
 * RDMA fabric), so it is only checked for form (parseHello): verbs dials
 * nothing; an RC QP only ever answers packets of its connected peer QP.
 */
export function peerEndpoint(e: Endpoint, sock: net.Socket): Endpoint {
  if (e.provider !== "tcp") return e;
  const raw = sock.remoteAddress;
  if (!raw) throw new RdmaError("PROTOCOL", "the side channel has no peer address (closed?)");
  const peer = canonicalIp(raw);
  const named = canonicalIp(e.gid);
  if (WILDCARDS.has(named)) return { ...e, gid: peer };
  if (named !== peer) {
    throw new RdmaError("PROTOCOL", `the peer's endpoint names host ${e.gid}, but the side channel comes from ${peer}: only the side channel's peer is dialed`);
  }
  return { ...e, gid: peer };
}
