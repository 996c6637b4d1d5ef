/**
 * The settings a connection runs with (ResolvedSettings) and how it is established
 * (ConnectionManager): types only, imported by the builder that fills them in and by
 * everything that runs with them (rdma.ts, establish/). They live apart from builder.ts so
 * that nothing below the builder imports it (src/api/ has no import cycle, type-only
 * imports included: scripts/check-layers.mjs).
 */
import type { ProviderChoice } from "../transport/providers.js";
import type { AgentSettings } from "../agent/options.js";
import type { Auth } from "./establish/auth.js";

/** How connections are established: the TCP side channel ("tcp", every provider) or RDMA CM ("rdmacm", verbs only). */
export type ConnectionManager = "tcp" | "rdmacm";

/** The settings a connection runs with: the builder's, checked and completed against the device's limits (the agent's own are declared in agent/options.ts). */
export interface ResolvedSettings extends AgentSettings {
  provider: ProviderChoice;
  device: string | undefined;
  port: number;
  gidIndex: number;
  cqSize: number;
  maxSendWr: number;
  maxRecvWr: number;
  maxInlineData: number;
  mtu: number;
  ackTimeout: number;
  retryCount: number;
  rnrRetry: number;
  minRnrTimer: number;
  maxRdAtomic: number;
  qpAccess: number;
  connectTimeoutMs: number;
  closeTimeoutMs: number;
  /** Connections a listener sets up at once (holding a QP, before the client's ready). */
  maxHandshakes: number;
  /** Connections a listener holds at once (established, or set up past the hello). */
  maxConnections: number;
  /** How connections are established: the TCP side channel, or RDMA CM (verbs only; rdmacm.ts). */
  cm: ConnectionManager;
  /** @internal Peer authentication (setAuth); null: unauthenticated (trusted fabric). */
  auth: Auth | null;
}
