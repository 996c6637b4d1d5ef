/**
 * The verbs provider: libibverbs through the native addon (native/verbs.c,
 * built by `npm install` when the rdma-core headers are present).
 */
import { RdmaError } from "../../errors.js";
import type { Device, DeviceInfo, Provider } from "../types.js";
import { checkLayout } from "./codec.js";
import { VerbsDevice } from "./device.js";
import { nativeError } from "./errors.js";
import { loadAddon, type NativeAddon } from "./native.js";
import { rdmaCm } from "./cm.js";

export { VerbsDevice } from "./device.js";

/**
 * Loads the addon; throws RdmaError("PROVIDER_UNAVAILABLE") with the reason
 * and the fix when it is not built or libibverbs cannot be loaded.
 */
export function loadVerbsProvider(): Provider {
  const r = loadAddon();
  if (!r.ok) throw new RdmaError("PROVIDER_UNAVAILABLE", `the verbs provider is not available: ${r.reason}`);
  const bad = checkLayout(r.addon.layout);
  if (bad !== null) throw new RdmaError("PROVIDER_UNAVAILABLE", `the verbs provider is not available: ${bad}`);
  return makeProvider(r.addon);
}

function makeProvider(addon: NativeAddon): Provider {
  return {
    name: "verbs",
    rdmaCm,
    listDevices(): DeviceInfo[] {
      try {
        return addon.listDevices().map((d) => ({ name: d.name, provider: "verbs" as const, guid: d.guid }));
      } catch (e) {
        throw nativeError(e, "ibv_get_device_list");
      }
    },
    async openDevice(name?: string): Promise<Device> {
      if (name !== undefined && (typeof name !== "string" || name.length === 0)) throw new RdmaError("INVALID_ARGUMENT", "device name must be a non-empty string");
      return new VerbsDevice(addon, name);
    },
  };
}
