/**
 * Kept at this path for the independent test peer (test/support/agent-peer.ts), which issue 20
 * requires to stay unchanged: authentication lives in establish/auth.ts. Nothing in src/
 * imports this file.
 */
export * from "./establish/auth.js";
