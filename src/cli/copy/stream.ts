/**
 * cp with a stream at one end (`-`: stdin or stdout; a Readable or Writable
 * given to the library's copy()).
 *
 * - To a stream: the chunks of one remote file are fetched `depth` at once
 *   as for a file, but written in file order: a chunk waits in its ring slot
 *   until the one before it has been handed to the stream (and the stream
 *   took it: back-pressure holds the slot, so at most `depth` chunks wait).
 *   Each chunk's CRC-32 and the file's digest are checked as a file sink
 *   checks them, before the chunk is written (a bad chunk is never output).
 * - From a stream: the protocol sends a file's size and metadata first, so
 *   the stream is first spooled into a private temporary file (mode 0600 in
 *   the system's temporary directory, removed afterwards), which is then
 *   uploaded as a file.
 */
import { createWriteStream } from "node:fs";
import { chmod, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { Readable, Writable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { crc32 } from "node:zlib";
import { chunkCount, chunkLen, fileDigest } from "./chunks.js";
import { CopyError } from "./paths.js";

/** Chunks of one file, checked and written to `out` in order. */
export class StreamSink {
  private next = 0;
  private readonly turn = new Map<number, () => void>();
  private readonly crcs: Uint32Array;
  private failure: unknown = null;

  constructor(
    private readonly out: Writable,
    private readonly size: number,
    private readonly chunk: number,
    private readonly verify: boolean,
  ) {
    this.crcs = new Uint32Array(chunkCount(size, chunk));
  }

  /** Writes chunk `off / chunk` once every chunk before it has been written; its CRC-32 is checked first. */
  async write(off: number, bytes: Uint8Array, crc: number): Promise<void> {
    const i = off / this.chunk;
    if (!Number.isInteger(i) || i < 0 || i >= this.crcs.length || bytes.length !== chunkLen(this.size, this.chunk, i)) throw new CopyError("PROTOCOL", `chunk at offset ${off} of ${bytes.length} bytes is not a chunk of the file`);
    const got = this.verify ? crc32(bytes) >>> 0 : 0;
    if (got !== crc >>> 0) throw new CopyError("CHECKSUM", `chunk ${i} (offset ${off}) arrived with CRC-32 ${got.toString(16)}, the sender's is ${(crc >>> 0).toString(16)}`);
    this.crcs[i] = got;
    if (this.failure !== null) throw this.failure;
    if (i !== this.next) await new Promise<void>((r) => this.turn.set(i, r));
    if (this.failure !== null) throw this.failure;
    try {
      // the callback runs once the stream has taken the bytes: the slot may be reused after it
      await new Promise<void>((resolve, reject) => this.out.write(bytes, (e) => (e ? reject(e) : resolve())));
    } catch (e) {
      this.fail(e);
      throw e;
    }
    this.next++;
    const w = this.turn.get(this.next);
    if (w !== undefined) {
      this.turn.delete(this.next);
      w();
    }
  }

  /** A chunk failed: the chunks waiting for their turn fail too (the copy stops). */
  fail(e: unknown): void {
    this.failure ??= e;
    for (const w of this.turn.values()) w();
    this.turn.clear();
  }

  /** Every chunk was written: checks the file's digest against the sender's. */
  finish(digest: string): void {
    if (this.next !== this.crcs.length) throw new CopyError("PROTOCOL", `${this.crcs.length - this.next} chunks were never received`);
    const mine = fileDigest(this.size, this.crcs);
    if (this.verify && mine !== digest) throw new CopyError("CHECKSUM", `the file's digest ${mine.slice(0, 16)}… differs from the sender's ${String(digest).slice(0, 16)}…`);
  }
}

/** A stream spooled into a private temporary file: its path, and how to remove it. */
export async function spool(input: Readable): Promise<{ path: string; remove(): Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), "async-rdma-cp-"));
  const path = join(dir, "stdin");
  const remove = (): Promise<void> => rm(dir, { recursive: true, force: true });
  try {
    await pipeline(input, createWriteStream(path, { mode: 0o600 }));
    // the copy gets the mode a new file gets here (the temporary file itself stays private until now)
    await chmod(path, 0o666 & ~process.umask());
  } catch (e) {
    await remove();
    throw e;
  }
  return { path, remove };
}
