/**
 * Transport layer entry: the seam's types and the providers behind it.
 */
export * from "./types.js";
export { tcpProvider } from "./tcp/index.js";
export { loadProvider, type ProviderChoice } from "./providers.js";
