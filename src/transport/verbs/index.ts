import { RdmaError } from "../../errors.js";
import type { Provider } from "../types.js";

/** Placeholder until the native addon lands: reports why verbs is unavailable. */
export function loadVerbsProvider(): Provider {
  throw new RdmaError("PROVIDER_UNAVAILABLE", "the verbs provider (native addon) is not built in this version; use the tcp provider");
}
