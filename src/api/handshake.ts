/**
 * Kept at this path for the independent test peer (test/support/agent-peer.ts), which issue 20
 * requires to stay unchanged: the side channel's wire lives in establish/sidechannel-wire.ts,
 * the protocol version and addresses in establish/protocol.ts. Nothing in src/ imports this file.
 */
export { LineReader, helloBytes, parseHello, peerEndpoint, sendLine, type Hello } from "./establish/sidechannel-wire.js";
export { PROTOCOL_VERSION, canonicalIp, parseAddr } from "./establish/protocol.js";
