/**
 * How connections are established. Two implementations: the TCP side channel
 * (sidechannel.ts, every provider) and RDMA CM (rdmacm.ts, verbs only). The
 * builder picks one (`setConnectionManager`); the listener and `Rdma` only
 * see this interface.
 */
import type { RdmaError } from "../../errors.js";
import type { DeviceAttr } from "../../transport/types.js";
import type { ConnectionManager, ResolvedSettings } from "../settings.js";
import type { Context } from "../context.js";
import type { Rdma } from "../rdma.js";

/** @internal */
/** What a listening source hands its connections and failed handshakes to. */
export interface ListenerSink {
  push(rdma: Rdma): void;
  reject(e: RdmaError): void;
}

/** @internal */
/** A listening endpoint behind an RdmaListener. */
export interface ListenerSource {
  address(): { host: string; port: number };
  /** Handshakes under way (accepted, not yet handed out). */
  handshakes(): number;
  /** Side-channel sockets open (0 on RDMA CM): they are closed as each handshake ends. */
  sockets(): number;
  /** Connections the listener holds (setMaxConnections): being set up past the hello, or established and not yet released. */
  connections(): number;
  /** The listener's own context (its memory and shares; every accepted connection's context is a fork of it), or null when it has none yet (RDMA CM bound to no device). */
  context(): Context | null;
  close(): Promise<void>;
}

/** @internal */
export interface Establisher {
  readonly name: ConnectionManager;
  /**
   * Client side. `base` holds the builder's settings, `resolve` checks them
   * against the device once it is known. `existing`, when given, is a
   * retained context to use (newConnection); failure releases it.
   */
  dial(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, signal: AbortSignal | undefined, existing?: Context): Promise<Rdma>;
  /** Server side: listens on `addr`, handing every connection (each with a context fork of its own) to `sink`. */
  bind(base: ResolvedSettings, resolve: (attr: DeviceAttr) => ResolvedSettings, addr: { host: string; port: number }, sink: ListenerSink): Promise<ListenerSource>;
}
