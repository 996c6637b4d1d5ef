/**
 * One copy's connection to the server: the hello that fixes the chunk size
 * and depth, the client's ring (slot k here ↔ slot k of the ring the server
 * shares with this connection only) and its slot numbers from a free list,
 * every call counted and under the --timeout deadline, and the pipeline
 * that keeps `depth` chunks in flight and stops at the first failure. Also
 * what an error means to the user (its code, its message, whether the
 * connection is lost).
 */
import { RpcClient, RpcError } from "../../rpc/index.js";
import { RdmaError, type LocalMr, type Rdma, type RdmaBuilder, type RemoteMr } from "../../index.js";
import { CopyError } from "./paths.js";
import { chunkCount } from "./chunks.js";
import { allocRing } from "./direct-io.js";
import { fromJson, toJson } from "./protocol.js";
import type { Progress } from "./progress.js";
import type { Options, Remote } from "./cp-options.js";

/** Slot numbers of the ring, from a free list. */
class Slots {
  private readonly free: number[];
  private readonly waiting: ((k: number) => void)[] = [];
  constructor(n: number) {
    this.free = Array.from({ length: n }, (_, i) => n - 1 - i);
  }
  acquire(): Promise<number> {
    const k = this.free.pop();
    return k !== undefined ? Promise.resolve(k) : new Promise((r) => this.waiting.push(r));
  }
  release(k: number): void {
    const w = this.waiting.shift();
    if (w) w(k);
    else this.free.push(k);
  }
}

/** An error's code as the user sees it ("ERROR" when it has none). */
export function codeOf(e: unknown): string {
  return typeof (e as { code?: unknown })?.code === "string" ? (e as { code: string }).code : "ERROR";
}

/** An error's message as the user sees it. */
export function msgOf(e: unknown): string {
  const m = e instanceof Error ? e.message : String(e);
  // RpcError prefixes the method name: the user does not need it
  return e instanceof RpcError ? m.replace(/^[a-zA-Z]+: /, "") : m;
}

/** What a TIMEOUT means to the user. */
export function silentNote(e: unknown, opts: Options): string {
  return codeOf(e) === "TIMEOUT" ? ` (the server did not answer within --timeout ${opts.timeoutMs / 1000} s)` : "";
}

/** The connection died: nothing more can be copied on it. */
export function fatal(e: unknown): boolean {
  return e instanceof RdmaError || (e instanceof RpcError && e.code === "PROTOCOL");
}

/**
 * The error to report once the connection is gone: a chunk task that was
 * touching the ring when it was released fails with a TypeError (detached
 * memory); the cause is the lost connection.
 */
export function lost(rdma: Rdma, e: unknown): unknown {
  if (e instanceof RdmaError || !rdma.isClosed) return e;
  return new RdmaError("CONNECTION_CLOSED", "the connection to the server closed");
}

/** One copy's connection, ring and slots. */
export class Session {
  readonly slots: Slots;
  readonly local: Uint8Array;

  constructor(
    readonly rdma: Rdma,
    readonly rpc: RpcClient,
    readonly ring: LocalMr,
    readonly rmr: RemoteMr,
    readonly chunk: number,
    readonly depth: number,
    readonly readOnly: boolean,
    readonly opts: Options,
    readonly p: Progress,
    /** The ring is aligned for O_DIRECT writes (downloads' FileSink). */
    readonly direct: boolean,
  ) {
    this.slots = new Slots(depth);
    this.local = ring.bytes;
  }

  /** `directDir`: downloads write under this local directory (the ring is aligned for it). */
  static async open(r: Remote, b: RdmaBuilder, opts: Options, p: Progress, directDir: string | null, signal: AbortSignal | undefined): Promise<Session> {
    b.setPeerTimeout(10_000);
    const rdma = await b.connect({ host: r.host, port: r.port }, signal ? { signal } : undefined);
    try {
      const rpc = new RpcClient(rdma, opts.timeoutMs > 0 ? { timeoutMs: opts.timeoutMs } : {});
      // the server may grant fewer slots, never another chunk size: this ring is big enough
      const { ring, direct } = allocRing(rdma, opts.chunk * opts.depth, opts.chunk, directDir);
      if (opts.pull) rdma.share("cp-client-ring", ring, { access: "read" });
      const h = fromJson(await rpc.call("hello", toJson({ version: 1, chunk: opts.chunk, depth: opts.depth, verify: opts.verify, pull: opts.pull })));
      const chunk = Number(h.chunk);
      const depth = Number(h.depth);
      if (chunk !== opts.chunk || !(depth >= 1 && depth <= opts.depth)) throw new CopyError("PROTOCOL", `the server answered chunk ${chunk}, depth ${depth}`);
      const rmr = await rdma.openSharedMr(String(h.ring), opts.timeoutMs > 0 ? { timeoutMs: opts.timeoutMs } : {});
      return new Session(rdma, rpc, ring, rmr, chunk, depth, h.readOnly === true, opts, p, direct);
    } catch (e) {
      await rdma.close().catch(() => {});
      throw e;
    }
  }

  async call(method: string, o: unknown): Promise<Record<string, unknown>> {
    return fromJson(await this.rpcCall(method, toJson(o)));
  }

  /** Every call goes through here: the count (in --json's result) shows what batching saves. */
  rpcCall(method: string, payload: Uint8Array): Promise<Uint8Array> {
    this.p.calls++;
    return this.rpc.call(method, payload);
  }

  async close(): Promise<void> {
    await this.rdma.close().catch(() => {});
  }

  /** Runs one chunk task per chunk index from `first`, `depth` at once; the first failure stops new ones. */
  async pipeline(size: number, first: number, task: (i: number, slot: number) => Promise<void>): Promise<void> {
    const n = chunkCount(size, this.chunk);
    let failure: unknown = null;
    const running = new Set<Promise<void>>();
    for (let i = first; i < n && failure === null; i++) {
      const slot = await this.slots.acquire();
      if (failure !== null) {
        this.slots.release(slot);
        break;
      }
      const t: Promise<void> = task(i, slot)
        .catch((e: unknown) => void (failure ??= e))
        .finally(() => {
          this.slots.release(slot);
          running.delete(t);
        });
      running.add(t);
    }
    await Promise.all(running);
    if (failure !== null) throw failure;
  }
}
