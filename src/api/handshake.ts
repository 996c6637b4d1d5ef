/**
 * The TCP side channel that exchanges QP endpoints, then closes. Messages are
 * JSON lines, at most 16 KiB each, validated field by field:
 *
 *   client → server  {"asyncRdma":1,"provider":…,"endpoint":…,"recvDepth":…,"eagerMax":…}
 *   server → client  the same fields, or {"asyncRdma":1,"error":"…"}
 *   client → server  {"ready":true}   (after the client's QP reached RTS, so the
 *                                      server never sends to a QP that cannot receive)
 */
import net from "node:net";
import { RdmaError } from "../errors.js";
import type { Endpoint, ProviderName } from "../transport/types.js";

export const PROTOCOL_VERSION = 1;
const MAX_LINE = 16 * 1024;

export interface Hello {
  asyncRdma: number;
  provider: ProviderName;
  endpoint: Endpoint;
  recvDepth: number;
  eagerMax: number;
  /** Largest message the side accepts (absent from older peers). */
  maxMessageSize?: number;
}

/** Reads JSON lines from a socket, one at a time, with a deadline. */
export class LineReader {
  private buf = "";
  private lines: string[] = [];
  private waiter: { resolve: (l: string) => void; reject: (e: unknown) => void } | null = null;
  private error: RdmaError | null = null;

  constructor(private readonly sock: net.Socket) {
    sock.setEncoding("utf8");
    sock.on("data", (d: string) => {
      this.buf += d;
      let i: number;
      while ((i = this.buf.indexOf("\n")) >= 0) {
        this.lines.push(this.buf.slice(0, i));
        this.buf = this.buf.slice(i + 1);
      }
      if (this.buf.length > MAX_LINE) this.failWith(new RdmaError("PROTOCOL", "handshake message too long"));
      this.pump();
    });
    sock.on("error", (e: NodeJS.ErrnoException) => this.failWith(new RdmaError("CONNECTION_CLOSED", `handshake connection failed: ${e.message}`, { errno: e.code ?? "EIO", cause: e })));
    sock.on("close", () => this.failWith(new RdmaError("CONNECTION_CLOSED", "the peer closed the handshake connection")));
  }

  private failWith(e: RdmaError): void {
    if (!this.error) this.error = e;
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

export function sendLine(sock: net.Socket, v: unknown): void {
  sock.write(JSON.stringify(v) + "\n");
}

function int(v: unknown, name: string, min: number, max: number): number {
  if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > max) throw new RdmaError("PROTOCOL", `handshake field ${name} is invalid`);
  return v;
}

/** Validates a peer's hello (both directions). */
export function parseHello(v: Record<string, unknown>, expectProvider: ProviderName): Hello {
  if (v.asyncRdma !== PROTOCOL_VERSION) {
    throw new RdmaError("PROTOCOL", `protocol version mismatch: the peer speaks ${JSON.stringify(v.asyncRdma ?? "an unknown protocol")}, this side ${PROTOCOL_VERSION}; upgrade the older side`);
  }
  if (typeof v.error === "string") throw new RdmaError("CONNECTION_REFUSED", `the peer refused the connection: ${v.error.slice(0, 500)}`);
  if (v.provider !== expectProvider) {
    throw new RdmaError("PROTOCOL", `provider mismatch: the peer uses ${JSON.stringify(v.provider)}, this side ${expectProvider}; choose the same provider on both ends`);
  }
  const e = v.endpoint as Record<string, unknown> | undefined;
  if (!e || typeof e !== "object") throw new RdmaError("PROTOCOL", "handshake has no endpoint");
  const endpoint: Endpoint = {
    provider: expectProvider,
    qpNum: int(e.qpNum, "qpNum", 0, 0xffffff),
    psn: int(e.psn, "psn", 0, 0xffffff),
    lid: int(e.lid, "lid", 0, 0xffff),
    gid: typeof e.gid === "string" && e.gid.length < 64 ? e.gid : "",
    port: int(e.port, "port", 0, 65535),
    mtu: int(e.mtu, "mtu", 256, 4096),
  };
  if (!endpoint.gid) throw new RdmaError("PROTOCOL", "handshake endpoint has no gid");
  return {
    asyncRdma: PROTOCOL_VERSION,
    provider: expectProvider,
    endpoint,
    recvDepth: int(v.recvDepth, "recvDepth", 8, 65536),
    eagerMax: int(v.eagerMax, "eagerMax", 0, 1 << 20),
    ...(v.maxMessageSize === undefined ? {} : { maxMessageSize: int(v.maxMessageSize, "maxMessageSize", 1, 2 ** 31) }),
  };
}

/** tcp endpoints listening on a wildcard address are reached at the side channel's peer address. */
export function fixupEndpoint(e: Endpoint, sock: net.Socket): Endpoint {
  if (e.provider === "tcp" && (e.gid === "0.0.0.0" || e.gid === "::")) {
    let host = sock.remoteAddress ?? "127.0.0.1";
    if (host.startsWith("::ffff:")) host = host.slice(7);
    return { ...e, gid: host };
  }
  return e;
}

export function parseAddr(addr: string | { host: string; port: number }): { host: string; port: number } {
  if (typeof addr === "object" && addr !== null) {
    if (typeof addr.host !== "string" || !Number.isInteger(addr.port) || addr.port < 0 || addr.port > 65535) throw new RdmaError("INVALID_ARGUMENT", "address must be { host, port }");
    return addr;
  }
  if (typeof addr !== "string") throw new RdmaError("INVALID_ARGUMENT", `address must be "host:port", got ${String(addr)}`);
  const m = /^\[?([^\]]*?)\]?:(\d+)$/.exec(addr);
  if (!m) throw new RdmaError("INVALID_ARGUMENT", `address must be "host:port", got ${JSON.stringify(addr)}`);
  const port = Number(m[2]);
  if (port > 65535) throw new RdmaError("INVALID_ARGUMENT", `port out of range in ${JSON.stringify(addr)}`);
  return { host: m[1] || "0.0.0.0", port };
}
