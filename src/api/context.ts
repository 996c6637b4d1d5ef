/**
 * Resources shared by connections: devices (process-wide, reference counted)
 * and a context (PD + MR pool) shared by the connections of one Rdma family
 * or one listener.
 */
import { RdmaError } from "../errors.js";
import { loadProvider, type ProviderChoice } from "../transport/providers.js";
import type { Device, ProtectionDomain, Provider } from "../transport/types.js";
import { MrPool } from "../memory/pool.js";

const devices = new Map<string, { dev: Promise<Device>; refs: number }>();

async function acquireDevice(provider: Provider, name: string | undefined): Promise<{ dev: Device; release: () => void }> {
  const key = `${provider.name}/${name ?? ""}`;
  let e = devices.get(key);
  if (!e) {
    e = { dev: provider.openDevice(name), refs: 0 };
    devices.set(key, e);
    e.dev.catch(() => devices.delete(key));
  }
  e.refs++;
  const entry = e;
  const dev = await entry.dev;
  let released = false;
  return {
    dev,
    release: () => {
      if (released) return;
      released = true;
      if (--entry.refs === 0) {
        devices.delete(key);
        dev.close();
      }
    },
  };
}

export class Context {
  refs = 1;
  private constructor(
    readonly provider: Provider,
    readonly device: Device,
    readonly pd: ProtectionDomain,
    readonly pool: MrPool,
    private readonly releaseDevice: () => void,
  ) {}

  static async open(choice: ProviderChoice, deviceName: string | undefined): Promise<Context> {
    const provider = await loadProvider(choice);
    const { dev, release } = await acquireDevice(provider, deviceName);
    try {
      const pd = dev.allocPd();
      return new Context(provider, dev, pd, new MrPool(pd), release);
    } catch (e) {
      release();
      throw e instanceof RdmaError ? e : new RdmaError("DEVICE", `cannot set up device ${dev.name}: ${(e as Error).message}`, { cause: e });
    }
  }

  retain(): this {
    this.refs++;
    return this;
  }

  release(): void {
    if (--this.refs > 0) return;
    this.pool.close();
    try {
      this.pd.dealloc();
    } catch {
      /* something still registered: the device close below reclaims it */
    }
    this.releaseDevice();
  }
}
