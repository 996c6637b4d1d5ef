/**
 * What both ways of establishing a connection share (the side channel, sidechannel*.ts, and
 * RDMA CM, rdmacm*.ts): the protocol version both hellos carry, the one spelling of an IP
 * address that per-source bounds and peer records compare, and the parsing of the
 * "host:port" addresses the builder takes.
 */
import * as net from "node:net";
import { RdmaError } from "../../errors.js";

/** The version of the async-rdma establishment protocol (side-channel hello, RDMA CM private data). */
export const PROTOCOL_VERSION = 1;

/** One spelling per address: IPv4-mapped IPv6 as IPv4, IPv6 compressed and lower case. */
export function canonicalIp(ip: string): string {
  let a = ip.toLowerCase();
  if (a.startsWith("::ffff:") && net.isIPv4(a.slice(7))) a = a.slice(7);
  if (net.isIPv6(a)) {
    try {
      a = new URL(`http://[${a}]/`).hostname.slice(1, -1);
    } catch {
      /* keep as is */
    }
    const m = /^::ffff:([0-9a-f]{1,4}):([0-9a-f]{1,4})$/.exec(a);
    if (m) {
      const hi = parseInt(m[1]!, 16);
      const lo = parseInt(m[2]!, 16);
      a = `${hi >> 8}.${hi & 255}.${lo >> 8}.${lo & 255}`;
    }
  }
  return a;
}

/**
 * "host:port", "[IPv6]:port" or { host, port }. An IPv6 address needs its
 * brackets ("::1:5" is ambiguous); ":port" means all interfaces.
 */
export function parseAddr(addr: string | { host: string; port: number }): { host: string; port: number } {
  if (typeof addr === "object" && addr !== null) {
    const o = addr as { host?: unknown; port?: unknown };
    if (typeof o.host !== "string" || typeof o.port !== "number" || !Number.isInteger(o.port) || o.port < 0 || o.port > 65535) throw new RdmaError("INVALID_ARGUMENT", "address must be { host, port } with a port in [0, 65535]");
    return { host: o.host, port: o.port };
  }
  if (typeof addr !== "string") throw new RdmaError("INVALID_ARGUMENT", `address must be "host:port", got ${String(addr)}`);
  const m = /^(?:\[([^[\]]+)\]|([^[\]:]*)):(\d{1,5})$/.exec(addr);
  if (!m) throw new RdmaError("INVALID_ARGUMENT", `address must be "host:port" or "[IPv6]:port", got ${JSON.stringify(addr)}`);
  const port = Number(m[3]);
  if (port > 65535) throw new RdmaError("INVALID_ARGUMENT", `port out of range in ${JSON.stringify(addr)}`);
  if (m[1] !== undefined && !net.isIPv6(m[1])) throw new RdmaError("INVALID_ARGUMENT", `${JSON.stringify(m[1])} in brackets is not an IPv6 address in ${JSON.stringify(addr)}`);
  return { host: m[1] ?? (m[2] || "0.0.0.0"), port };
}
