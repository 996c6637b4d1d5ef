/**
 * A key-value store on one shared region. The owner keeps the hash table
 * (table.ts) in its memory and shares it read-only; clients GET with one
 * one-sided READ of the key's bucket, and PUT / DELETE by message to the
 * owner, the table's only writer (README.md says why). GET by message
 * (getRpc) is there too, for comparison (bench/kv.mjs).
 */
import { RdmaError, type LocalMr, type Rdma, type RdmaListener, type RemoteMr, type SharedMr } from "../../src/index.js";
import { HEADER_BYTES, KvTable, TORN, bucketBytes, bucketOffset, findInBucket, readHeader, tableBytes, type Geometry } from "./table.js";

export { KvTable, type Geometry };

/** The name the table is shared under. */
export const SHARE_NAME = "kv";

// Requests: op u8 | keyLen u8 | valueLen u16 | key | value.   Replies: status u8 | 0 | valueLen u16 | value.
const GET = 1;
const PUT = 2;
const DELETE = 3;
const OK = 0;
const MISS = 1;
const FULL = 2;
const BAD = 3;

// ------------------------------------------------------------------ owner

/**
 * Allocates the table in the listener's memory, lays it out empty and shares
 * it, read-only, with every connection the listener accepts.
 */
export function createTable(listener: RdmaListener, geometry: Geometry, name = SHARE_NAME): { table: KvTable; memory: LocalMr; shared: SharedMr } {
  const memory = listener.allocLocalMr(tableBytes(geometry));
  const table = KvTable.format(memory.bytes, geometry);
  const shared = listener.share(name, memory, { access: "read" });
  return { table, memory, shared };
}

/** Answers one client's messages until it closes the connection (or dies); then closes it. */
export async function serveConnection(rdma: Rdma, table: KvTable): Promise<void> {
  using reply = rdma.allocLocalMr(4 + table.geometry.valueMax);
  try {
    for (;;) {
      using request = await rdma.receive();
      await rdma.send(reply.slice(0, handle(table, request.bytes, reply.bytes)));
    }
  } catch (e) {
    if (!(e instanceof RdmaError)) throw e; // an RdmaError here: the connection ended
  } finally {
    await rdma.close();
  }
}

/** Applies one request to the table, writes the reply into `out`; returns the reply's length. */
function handle(table: KvTable, req: Uint8Array, out: Uint8Array): number {
  const status = (s: number, value?: Uint8Array): number => {
    out[0] = s;
    out[1] = 0;
    new DataView(out.buffer, out.byteOffset).setUint16(2, value?.length ?? 0, true);
    if (value) out.set(value, 4);
    return 4 + (value?.length ?? 0);
  };
  if (req.length < 4) return status(BAD);
  const keyLen = req[1]!;
  const valueLen = new DataView(req.buffer, req.byteOffset).getUint16(2, true);
  if (req.length !== 4 + keyLen + valueLen) return status(BAD);
  const key = req.subarray(4, 4 + keyLen);
  const value = req.subarray(4 + keyLen);
  switch (req[0]) {
    case GET: {
      const v = table.get(key);
      return v === null ? status(MISS) : status(OK, v);
    }
    case PUT:
      return status(table.put(key, value) ? OK : FULL);
    case DELETE:
      return status(table.delete(key) ? OK : MISS);
    default:
      return status(BAD);
  }
}

// ----------------------------------------------------------------- client

export class KvClient {
  /** READs that caught a slot mid-write and were done again. */
  retries = 0;
  private rpcs: Promise<unknown> = Promise.resolve();
  /** Registered buffers, allocated once and reused: spare bucket copies, and the request buffer (one request at a time). */
  private readonly spareBuckets: LocalMr[] = [];
  private request: LocalMr | null = null;

  private constructor(
    readonly rdma: Rdma,
    private readonly table: RemoteMr,
    readonly geometry: Geometry,
  ) {}

  /** Opens the owner's table on `rdma` and reads its geometry from its header. */
  static async open(rdma: Rdma, name = SHARE_NAME): Promise<KvClient> {
    const table = await rdma.openSharedMr(name, { timeoutMs: 30_000 });
    using header = rdma.allocLocalMr(HEADER_BYTES);
    await rdma.read(header, table.slice(0, HEADER_BYTES));
    return new KvClient(rdma, table, readHeader(header.bytes));
  }

  /**
   * GET by one-sided READ of the key's bucket; a bucket caught mid-write is
   * read again (at most `maxReads` times). The owner's program takes no
   * part (on verbs; on the tcp provider its event loop serves the READ).
   */
  async get(key: string, maxReads = 1000): Promise<Uint8Array | null> {
    const k = this.key(key);
    const at = bucketOffset(this.geometry, k);
    const remote = this.table.slice(at, at + bucketBytes(this.geometry));
    const bucket = this.spareBuckets.pop() ?? this.rdma.allocLocalMr(remote.length);
    try {
      for (let i = 0; i < maxReads; i++) {
        await this.rdma.read(bucket, remote);
        const v = findInBucket(bucket.bytes, k, this.geometry);
        if (v !== TORN) return v === null ? null : v.slice();
        this.retries++;
      }
    } finally {
      this.spareBuckets.push(bucket);
    }
    throw new Error(`get(${key}): the bucket was being written during each of ${maxReads} reads`);
  }

  /** The same GET as a message to the owner. */
  async getRpc(key: string): Promise<Uint8Array | null> {
    const r = await this.call(GET, this.key(key));
    return r.status === OK ? r.value : null;
  }

  /** Inserts or replaces; throws when the key's bucket is full. */
  async put(key: string, value: Uint8Array): Promise<void> {
    if (value.length > this.geometry.valueMax) throw new RangeError(`values are at most ${this.geometry.valueMax} bytes`);
    const r = await this.call(PUT, this.key(key), value);
    if (r.status !== OK) throw new Error(r.status === FULL ? `put(${key}): its bucket is full` : `put(${key}): refused (${r.status})`);
  }

  /** Removes `key`; false when it was not there. */
  async delete(key: string): Promise<boolean> {
    return (await this.call(DELETE, this.key(key))).status === OK;
  }

  /** Closes this side's open of the table and frees its buffers (the connection stays). */
  close(): void {
    this.table.dispose();
    for (const b of this.spareBuckets.splice(0)) b.dispose();
    this.request?.dispose();
    this.request = null;
  }

  private key(key: string): Uint8Array {
    const k = new TextEncoder().encode(key);
    if (k.length === 0 || k.length > this.geometry.keyMax) throw new RangeError(`keys are 1..${this.geometry.keyMax} bytes`);
    return k;
  }

  /** One request and its reply; requests go one at a time (replies come in order). */
  private call(op: number, key: Uint8Array, value: Uint8Array = new Uint8Array(0)): Promise<{ status: number; value: Uint8Array }> {
    const next = this.rpcs.then(async () => {
      this.request ??= this.rdma.allocLocalMr(4 + this.geometry.keyMax + this.geometry.valueMax);
      const b = this.request.bytes;
      b[0] = op;
      b[1] = key.length;
      new DataView(b.buffer, b.byteOffset).setUint16(2, value.length, true);
      b.set(key, 4);
      b.set(value, 4 + key.length);
      await this.rdma.send(this.request.slice(0, 4 + key.length + value.length));
      using reply = await this.rdma.receive();
      const r = reply.bytes;
      const len = new DataView(r.buffer, r.byteOffset).getUint16(2, true);
      return { status: r[0]!, value: r.slice(4, 4 + len) };
    });
    this.rpcs = next.catch(() => {});
    return next;
  }
}
