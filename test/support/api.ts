/**
 * API test support: builders for the provider under test and connected pairs.
 */
import assert from "node:assert/strict";
import { RdmaBuilder, type Rdma } from "../../src/index.js";
import { PROVIDER, deviceNames } from "./seam.js";

export { PROVIDER };

/**
 * The connection manager under test: ASYNC_RDMA_CM=rdmacm runs the API tests
 * over RDMA CM (verbs only), else the TCP side channel.
 */
export const CM: "tcp" | "rdmacm" = process.env.ASYNC_RDMA_CM === "rdmacm" ? "rdmacm" : "tcp";

/**
 * The address servers bind and clients dial: 127.0.0.1 for the side channel;
 * over RDMA CM the first rxe device's IP (RXE_IPS), since RDMA CM does not
 * work over `lo` on rxe.
 */
export const HOST: string = CM === "rdmacm" ? ((process.env.RXE_IPS ?? "").split(/\s+/).filter(Boolean)[0] ?? "10.77.0.1") : "127.0.0.1";

/** "HOST:port" */
export function at(port: number): string {
  return `${HOST}:${port}`;
}

export function builder(side: "server" | "client" = "client"): RdmaBuilder {
  const b = new RdmaBuilder().setProvider(PROVIDER).setConnectionManager(CM);
  const [a, c] = deviceNames();
  const dev = side === "server" ? a : c;
  if (PROVIDER === "verbs" && dev) b.setDevice(dev);
  return b;
}

export interface ApiPair {
  server: Rdma;
  client: Rdma;
  close(): Promise<void>;
}

export async function apiPair(configure: { server?: (b: RdmaBuilder) => RdmaBuilder; client?: (b: RdmaBuilder) => RdmaBuilder } = {}): Promise<ApiPair> {
  const sb = (configure.server ?? ((b) => b))(builder("server"));
  const cb = (configure.client ?? ((b) => b))(builder("client"));
  const listener = await sb.bind(at(0));
  const [client, server] = await Promise.all([cb.connect(at(listener.port)), listener.accept()]);
  await listener.close();
  return {
    server,
    client,
    async close() {
      await Promise.allSettled([client.close(), server.close()]);
    },
  };
}

export async function withApiPair(fn: (p: ApiPair) => Promise<void>, configure?: Parameters<typeof apiPair>[0]): Promise<void> {
  const p = await apiPair(configure);
  try {
    await fn(p);
  } finally {
    await p.close();
  }
}

/** Deterministic bytes for data checks. */
export function pattern(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    out[i] = x & 0xff;
  }
  return out;
}

/** Resolves at a monotonic deadline (a lease end): waiting for an event, not a guess. */
export function until(deadline: number): Promise<void> {
  return new Promise((r) => setTimeout(r, Math.max(0, Math.ceil(deadline - performance.now())) + 1));
}

/** Runs event-loop turns until `cond` holds or `ms` pass. */
export async function eventually(cond: () => boolean, ms: number, what: string): Promise<void> {
  const end = performance.now() + ms;
  while (!cond()) {
    if (performance.now() > end) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setImmediate(r));
  }
}

/**
 * A WRITE-with-immediate ping-pong of `n` rounds, one message in flight:
 * each side writes 8 bytes with the round's immediate into memory the other
 * granted, and the other checks the immediate before answering.
 */
export async function writeImmPingPong({ server, client }: ApiPair, n: number): Promise<void> {
  const [toServer, toClient] = await Promise.all([client.requestRemoteMr(8), server.requestRemoteMr(8)]);
  const [cl, sl] = [client.allocLocalMr(8), server.allocLocalMr(8)];
  for (let i = 0; i < n; i++) {
    cl.bytes.set(pattern(8, i));
    await client.writeWithImm(cl, toServer, i);
    assert.equal(await server.receiveWriteImm(), i);
    sl.bytes.set(pattern(8, i + 1));
    await server.writeWithImm(sl, toClient, i + 1);
    assert.equal(await client.receiveWriteImm(), i + 1);
  }
  toServer.dispose();
  toClient.dispose();
  cl.dispose();
  sl.dispose();
}
