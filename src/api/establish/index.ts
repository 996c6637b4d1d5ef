/**
 * The ways of establishing a connection, as the builder picks them (setConnectionManager): each
 * an Establisher (establisher.ts) made of a client's dial and a listener's bind. Only the
 * builder imports this file; everything else in establish/ is below it.
 */
import type { Establisher } from "./establisher.js";
import { dialSideChannel } from "./sidechannel.js";
import { SideChannelListener } from "./sidechannel-listener.js";
import { dialCm } from "./rdmacm.js";
import { CmListener } from "./rdmacm-listener.js";

/** The TCP side channel: every provider (the default). */
export const sideChannel: Establisher = { name: "tcp", dial: dialSideChannel, bind: (base, resolve, addr, sink) => SideChannelListener.bind(base, resolve, addr, sink) };

/** RDMA CM: verbs only. */
export const rdmaCmEstablisher: Establisher = { name: "rdmacm", dial: dialCm, bind: (base, resolve, addr, sink) => CmListener.bind(base, resolve, addr, sink) };
