/**
 * Resources shared by connections: devices (process-wide, reference counted)
 * and contexts (a protection domain + its MR pool; not an ibv_context, which
 * is the transport's Device: see the class comment).
 *
 * Isolation: a context is shared only by connections to one peer (an Rdma
 * and its newConnection() siblings). A listener keeps a root context (device,
 * settings) and gives every accepted connection a fork of it: same device, a
 * protection domain and pool of its own. Grants, lends and rendezvous
 * registrations are made in the connection's pool, so they land in its PD,
 * and the device/provider refuses any other connection's access to them
 * (rxe and the tcp provider check that an rkey's MR is in the QP's PD on
 * every remote access), even with a guessed or leaked rkey.
 */
import { RdmaError } from "../errors.js";
import { loadProvider, type ProviderChoice } from "../transport/providers.js";
import type { Device, ProtectionDomain, Provider } from "../transport/types.js";
import { MrPool } from "../memory/pool.js";
import { ShareTable } from "../agent/shares.js";

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

/** Contexts alive in this process (each one a PD and a pool); tests check that failed setups give theirs back. */
let liveContexts = 0;

/** @internal */
export function contextStats(): { live: number } {
  return { live: liveContexts };
}

/**
 * @internal
 * Not an `ibv_context`. A verbs programmer reading "context" expects the
 * opened device (`ibv_open_device`); here that is the transport's `Device`
 * (`this.device`, shared process-wide and reference counted). A `Context` is
 * one connection family's resources on it: a protection domain
 * (`ibv_alloc_pd`), the memory pool registered in it (`MrPool`) and the
 * table of regions shared by name. An `Rdma` and its newConnection()
 * siblings share one; a listener's is forked for every accepted connection
 * (`fork()`: same device, a PD and pool of its own). The name is internal
 * only: no public type or export shows it.
 */
export class Context {
  refs = 1;
  /** Regions shared by name from this context's memory (a fork's table falls through to its parent's: the listener's shares). */
  readonly shares: ShareTable;
  private constructor(
    readonly provider: Provider,
    readonly device: Device,
    readonly pd: ProtectionDomain,
    readonly pool: MrPool,
    private readonly releaseDevice: () => void,
    parentShares: ShareTable | null = null,
  ) {
    liveContexts++;
    this.shares = new ShareTable(parentShares);
  }

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

  /**
   * A context on the same device with a protection domain and memory pool of
   * its own, for one accepted connection. It holds a reference on this one
   * (so the device outlives it); releasing it frees its pool and PD, then
   * calls `onRelease` (a listener counts its connections this way: every
   * way a connection ends, setup failure included, releases its fork once).
   */
  fork(onRelease?: () => void): Context {
    let pd: ProtectionDomain;
    try {
      pd = this.device.allocPd();
    } catch (e) {
      throw e instanceof RdmaError ? e : new RdmaError("DEVICE", `cannot allocate a protection domain on ${this.device.name}: ${(e as Error).message}`, { cause: e });
    }
    this.retain();
    return new Context(
      this.provider,
      this.device,
      pd,
      new MrPool(pd),
      () => {
        this.release();
        onRelease?.();
      },
      this.shares,
    );
  }

  retain(): this {
    this.refs++;
    return this;
  }

  release(): void {
    if (this.refs <= 0) return;
    if (--this.refs > 0) return;
    liveContexts--;
    this.shares.close();
    this.pool.close();
    try {
      this.pd.dealloc();
    } catch {
      // Something is still registered in it (a registration the agent did not release): the PD
      // stays until the device closes, when the last context on it goes (a fork's parent is the listener's).
    }
    this.releaseDevice();
  }
}
