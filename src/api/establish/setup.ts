/**
 * What every way of establishing a connection shares (the TCP side channel,
 * sidechannel.ts, and RDMA CM, rdmacm.ts): creating the QP, CQ and agent, the
 * QP's connect attributes, and abandon() for every failed setup path.
 */
import { RdmaError } from "../../errors.js";
import type { DeviceAttr, QpConnectAttr } from "../../transport/types.js";
import { Connection, type ConnectionOptions } from "../../agent/connection.js";
import { AGENT_SETTINGS, type AgentSettings } from "../../agent/options.js";
import { Context } from "../context.js";
import type { ResolvedSettings } from "../settings.js";
import type { Rdma } from "../rdma.js";

/** @internal */
/** Opens a context on the builder's provider and device, with the settings checked against that device (released if they do not fit). */
export async function openContext(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings): Promise<{ ctx: Context; s: ResolvedSettings }> {
  const ctx = await Context.open(base.provider, base.device);
  try {
    return { ctx, s: resolve(ctx.device.attr) };
  } catch (e) {
    ctx.release();
    throw e;
  }
}

/** @internal */
/** Creates CQ, QP and agent on `ctx`; the QP is in INIT with receives posted. */
export function makeConnection(ctx: Context, s: ResolvedSettings, peer: { recvDepth: number; eagerMax: number }, holder: { rdma: Rdma | null }): Connection {
  const dev = ctx.device;
  const cq = dev.createCq(s.cqSize);
  let qp;
  try {
    qp = ctx.pd.createQp({ sendCq: cq, recvCq: cq, maxSendWr: s.maxSendWr, maxRecvWr: s.maxRecvWr, maxSendSge: 2, maxRecvSge: 1, maxInlineData: s.maxInlineData, portNum: s.port, access: s.qpAccess });
  } catch (e) {
    cq.destroy();
    throw e;
  }
  const opts: ConnectionOptions = {
    ...agentSettings(s),
    sendDepth: s.maxSendWr,
    maxInline: qp.caps.maxInlineData,
    // allow(peer) callbacks see rdma.peer (address, port, proven identity). The Rdma exists before
    // the connection processes its first message (startConnection); were it missing, the open is
    // refused (the agent treats a throwing allow as a refusal): allow is never asked about nobody.
    shares: {
      find: (key) => ctx.shares.find(key),
      peer: () => {
        if (!holder.rdma) throw new RdmaError("INVALID_STATE", "the peer is not known yet");
        return holder.rdma.peer;
      },
    },
  };
  const conn = new Connection(qp, cq, ctx.pool, opts, peer, () => holder.rdma?.releaseResources());
  try {
    conn.postInitialReceives();
  } catch (e) {
    abandon(conn, null);
    throw e;
  }
  return conn;
}

/** @internal */
/**
 * Hands a set-up connection to its Rdma and starts it. The Rdma (so
 * `rdma.peer`, with the proven identity) exists before the connection
 * processes any message, and from here on the connection owns everything
 * (QP, CQ, buffers, context): any failure, even one start() itself finds (a
 * malformed message that arrived before the handshake ended), ends in the
 * connection's teardown, which releases it all through
 * `rdma.releaseResources()`. The caller must not abandon() it after this.
 */
export function startConnection(conn: Connection, rdma: Rdma, holder: { rdma: Rdma | null }): void {
  holder.rdma = rdma;
  try {
    conn.start();
  } catch (e) {
    conn.fail(e instanceof RdmaError ? e : new RdmaError("DEVICE", `cannot start the connection: ${(e as Error)?.message ?? String(e)}`, { cause: e }));
  }
}

/** @internal */
/**
 * Frees everything a connection set up before it was handed out (every
 * failed setup path: listener, dialWith, newConnection, both RDMA CM paths):
 * the QP and CQ first (the device stops using the posted buffers), then the
 * agent's own buffers, then the context — for a listener's connection its
 * own fork, whose release frees the pool (receive buffers included) and the
 * PD. A context shared with siblings (newConnection) outlives the call, so
 * the receive buffers posted from its pool are released through the agent's
 * abandon(). Safe to call with nulls and more than once per
 * object.
 */
export function abandon(conn: Connection | null, ctx: Context | null): void {
  if (conn) {
    // The agent destroys its QP and CQ, then frees its receive and control buffers (from a pool
    // that may be shared with siblings).
    conn.abandon(new RdmaError("CONNECTION_CLOSED", "the connection was abandoned during setup"));
  }
  ctx?.release();
}

/**
 * The QP's RTR/RTS attributes. `peerRdAtomic` is the peer's responder
 * resources (its maxDestRdAtomic, from its hello): this side never has more
 * READs and atomics outstanding than the peer accepts, whatever each side was
 * configured with. The tcp provider's liveness bound is the agent's peer
 * timeout (one setting for "the peer stopped answering").
 */
export function connectAttr(s: ResolvedSettings, peerRdAtomic?: number): QpConnectAttr {
  const initiator = peerRdAtomic === undefined ? s.maxRdAtomic : Math.min(s.maxRdAtomic, peerRdAtomic);
  return {
    portNum: s.port,
    gidIndex: s.gidIndex,
    mtu: s.mtu,
    timeout: s.ackTimeout,
    retryCnt: s.retryCount,
    rnrRetry: s.rnrRetry,
    minRnrTimer: s.minRnrTimer,
    maxRdAtomic: initiator,
    maxDestRdAtomic: s.maxRdAtomic,
    livenessMs: s.peerTimeoutMs === 0 ? 2 ** 31 - 1 : s.peerTimeoutMs,
  };
}

/** The agent's settings out of the resolved ones (agent/options.ts declares them once). */
function agentSettings(s: ResolvedSettings): AgentSettings {
  const o = {} as Record<keyof AgentSettings, unknown>;
  for (const k of AGENT_SETTINGS) o[k] = s[k];
  return o as AgentSettings;
}
