/**
 * async-rdma: RDMA for Node.js with high-level abstractions and asynchronous APIs.
 *
 * @example
 * import { RdmaBuilder } from "async-rdma";
 * const rdma = await new RdmaBuilder().connect("127.0.0.1:5555");
 */
export { RdmaBuilder, type ResolvedSettings } from "./api/builder.js";
export { Rdma, type OpOptions, type SendData, type RdmaStats, type AgentStats, type CloseOptions, type MessagesOptions, type ConnectionOpenMessage, type ConnectionEndMessage, type OperationMessage } from "./api/rdma.js";
export { CHANNELS, type OperationName } from "./api/observe.js";
export type { AuthOptions, AuthKey, AuthKeyLookup, PeerInfo } from "./api/establish/auth.js";
export { RdmaListener, type ListenerStats } from "./api/listener.js";
export { LocalMr, RemoteMr, type RemoteAccess, type RemoteOrigin } from "./memory/mr.js";
export { SharedMr, type ShareOptions, type ShareAccess } from "./api/shared.js";
export type { PeerLimits } from "./agent/memory-protocol.js";
export { setPeerMemoryLimit, peerMemoryUsage } from "./memory/budget.js";
export { RdmaError, isRdmaError, type RdmaErrorCode } from "./errors.js";
export { Access } from "./transport/types.js";
export type { PollingMode } from "./agent/poller.js";
export type { ProviderChoice } from "./transport/providers.js";
export { RdmaStream, type OnRead, type StreamOptions, type StreamConnection } from "./api/stream.js";
export type { PoolStats } from "./memory/pool.js";
