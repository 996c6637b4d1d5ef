import { RdmaError } from "../errors.js";
import type { Provider } from "./types.js";
import { tcpProvider } from "./tcp/index.js";

/** "verbs" (libibverbs), "tcp" (RC semantics over TCP) or "auto" (verbs when a device with an active port exists, else tcp). */
export type ProviderChoice = "tcp" | "verbs" | "auto";

/**
 * Resolves a provider choice. `auto` picks verbs when the addon loads and a
 * device has an ACTIVE port, else tcp. `verbs` without a usable addon fails
 * with PROVIDER_UNAVAILABLE carrying the reason and the fix.
 */
export async function loadProvider(choice: ProviderChoice = "auto"): Promise<Provider> {
  if (choice === "tcp") return tcpProvider;
  if (choice !== "verbs" && choice !== "auto") throw new RdmaError("INVALID_ARGUMENT", `provider must be "tcp", "verbs" or "auto", got ${String(choice)}`);
  let verbs: Provider;
  try {
    const mod = (await import("./verbs/index.js")) as { loadVerbsProvider: () => Provider };
    verbs = mod.loadVerbsProvider();
  } catch (e) {
    if (choice === "auto") return tcpProvider;
    if (e instanceof RdmaError) throw e;
    throw new RdmaError("PROVIDER_UNAVAILABLE", `the verbs provider is not available: ${(e as Error).message}`, { cause: e });
  }
  if (choice === "verbs") return verbs;
  try {
    if (verbs.listDevices().length > 0) return verbs;
  } catch {
    /* fall through */
  }
  return tcpProvider;
}
