/**
 * The tcp provider: RC semantics over TCP, pure TypeScript. Always available.
 * Device names are free-form ("tcp0" by default); each opened device listens
 * on its own TCP port for its QPs' streams.
 */
import { RdmaError } from "../../errors.js";
import type { Device, DeviceInfo, Provider, TcpDeviceOptions } from "../types.js";
import { TcpDevice } from "./device.js";

export { TcpDevice } from "./device.js";
export { TcpQueuePair, type TcpQpStats } from "./qp.js";

/** The tcp provider: RC semantics over TCP streams, in TypeScript. */
export const tcpProvider: Provider = {
  name: "tcp",
  listDevices(): DeviceInfo[] {
    return [{ name: "tcp0", provider: "tcp", guid: "0000:0000:0000:0000" }];
  },
  async openDevice(name = "tcp0", options: TcpDeviceOptions = {}): Promise<Device> {
    if (typeof name !== "string" || name.length === 0) throw new RdmaError("INVALID_ARGUMENT", "device name must be a non-empty string");
    const dev = new TcpDevice(name, options.host ?? "0.0.0.0");
    await dev.listen(options.port ?? 0);
    return dev;
  },
};
