/**
 * One client connection of the server: its ring and slots (a slot is used
 * by one call at a time), the files it has open (at most MAX_OPEN), its
 * share of the per-chunk upload state, and the one end that releases all of
 * it, however the connection ends.
 */
import type { LocalMr, Rdma, RemoteMr, SharedMr } from "../../index.js";
import { CopyError } from "./paths.js";
import { StateBudget } from "./chunks.js";
import type { FileSink, FileSource } from "./files.js";
import { ringShares, ringTotal, sessions, type RingHolder } from "./serve-rings.js";

const MAX_OPEN = 256;
/**
 * Per-chunk state of uploads in progress (a CRC and a bit per chunk: 4.1
 * bytes per chunk; with 1 MiB chunks 64 MiB covers 16 TiB of files, with
 * the smallest chunks 64 GiB), per connection and for all together.
 */
const MAX_STATE = 64 * 1024 * 1024;
const MAX_TOTAL_STATE = 256 * 1024 * 1024;
const stateBudget = new StateBudget(MAX_TOTAL_STATE);

export interface Options {
  root: string;
  readOnly: boolean;
  /** Uploaded modes keep their setuid/setgid bits (--keep-setid). */
  keepSetid: boolean;
}

/** One client's state: its ring and the files it has open. */
export class Session implements RingHolder {
  ring: LocalMr | null = null;
  /** The client's ring, when it asked the server to pull uploads with RDMA READ. */
  peerRing: RemoteMr | null = null;
  bytes: Uint8Array | null = null;
  share: SharedMr | null = null;
  chunk = 0;
  depth = 0;
  verify = true;
  /** The ring is aligned for O_DIRECT writes (FileSink). */
  direct = false;
  /** Calls in flight, and when the last one ended (performance.now()). */
  calls = 0;
  lastCall = performance.now();
  ended = false;
  greeted = false;
  /** Ring bytes this session counts in the ring budget (serve-rings.ts). */
  counted = 0;
  private readonly busy = new Set<number>();
  /** Per-chunk state of this connection's uploads. */
  readonly state = new StateBudget(MAX_STATE, stateBudget);
  readonly sinks = new Map<number, { sink: FileSink; rel: string }>();
  readonly sources = new Map<number, { src: FileSource; rel: string }>();
  private nextId = 1;

  constructor(
    readonly rdma: Rdma,
    readonly opts: Options,
  ) {}

  id(): number {
    if (this.sinks.size + this.sources.size >= MAX_OPEN) throw new CopyError("EMFILE", `at most ${MAX_OPEN} files open per connection`);
    const id = this.nextId;
    this.nextId = (this.nextId % 0x7fffffff) + 1;
    return id;
  }

  writable(): void {
    if (this.opts.readOnly) throw new CopyError("EROFS", "the server is read-only (--read-only)");
  }

  /** Slot `slot` for the length of one call; a slot in use by another call is refused. */
  async withSlot<T>(slot: number, len: number, fn: (view: Uint8Array) => Promise<T>): Promise<T> {
    if (!this.bytes) throw new CopyError("PROTOCOL", "hello first");
    if (slot >= this.depth || len > this.chunk || len === 0) throw new CopyError("PROTOCOL", `slot ${slot} length ${len} is outside the ring (${this.depth} × ${this.chunk})`);
    if (this.busy.has(slot)) throw new CopyError("PROTOCOL", `slot ${slot} is in use`);
    this.busy.add(slot);
    try {
      return await fn(this.bytes.subarray(slot * this.chunk, slot * this.chunk + len));
    } finally {
      this.busy.delete(slot);
    }
  }

  /** Ended to make room for another connection's ring (it was idle). */
  async evict(): Promise<void> {
    console.error(`async-rdma serve: ended an idle connection from ${this.rdma.peer.address} to make room for another`);
    void this.rdma.close().catch(() => {});
    await this.end();
  }

  async end(): Promise<void> {
    if (this.ended) return;
    this.ended = true;
    sessions.delete(this);
    for (const { sink } of this.sinks.values()) await sink.abort();
    for (const { src } of this.sources.values()) await src.close();
    this.sinks.clear();
    this.sources.clear();
    // The session is over: no opener is left to wait for (and the ring is freed next).
    void this.share?.revoke({ timeoutMs: 0 });
    ringTotal.bytes -= this.counted;
    ringShares.give(this.rdma.peer.address, this.counted);
    this.counted = 0;
    try {
      this.ring?.dispose();
    } catch {
      /* released with the connection */
    }
  }
}
