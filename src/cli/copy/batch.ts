/**
 * Small files, many at a time, on either end. Per file the rule is the one
 * of FileSink (CRC checked, temporary name, flushed before the rename, mode
 * and mtime set before it appears), but the costs are paid per batch:
 *
 * - the file operations are synchronous: for a 4 KiB file, a round trip
 *   through libuv's 4-thread pool per call (open, write, chmod, utimes,
 *   close, rename…) costs more than the call itself;
 * - the flush is one syncfs(2) per file system for the whole batch (through
 *   `sync -f`, coreutils, run by one long-lived shell), then the renames,
 *   then one more syncfs for the directory entries. Measured here: fsync costs ~0.7 ms per file at any
 *   concurrency, so 10,000 files spent ~7 s flushing one by one; two syncfs
 *   per 512 files cost a few ms. When `sync -f` is not available, every
 *   file is fsynced (and its directory) instead.
 */
import { spawn, type ChildProcess } from "node:child_process";
import type { Socket } from "node:net";
import { closeSync, constants, fchmodSync, fstatSync, futimesSync, lstatSync, openSync, readSync, renameSync, statSync, writeSync } from "node:fs";
import { open } from "node:fs/promises";
import { dirname } from "node:path";
import { crc32 } from "node:zlib";
import { CopyError } from "./paths.js";
import { syncDir, tempName, type FileMeta } from "./files.js";
import { mapLimit } from "./tree.js";
import type { SmallFile } from "./protocol.js";

export interface BatchFile {
  abs: string;
  f: SmallFile;
  data: Uint8Array;
}

/**
 * syncfs through one long-lived shell per process (`sync -f` per request):
 * spawning `sync` from node forks the whole node process, ~35 ms each here.
 * Paths go one per line; a path with a newline, or a shell that died, falls
 * back to fsync.
 */
class Flusher {
  private sh: ChildProcess | null = null;
  private broken = false;
  private readonly waiting: ((ok: boolean) => void)[] = [];
  private buf = "";

  private start(): ChildProcess {
    const sh = spawn("sh", ["-c", 'while IFS= read -r p; do if sync -f "$p" 2>/dev/null; then echo ok; else echo fail; fi; done'], { stdio: ["pipe", "pipe", "ignore"] });
    sh.on("error", () => this.fail());
    sh.on("exit", () => this.fail());
    sh.stdin!.on("error", () => this.fail());
    sh.stdout!.setEncoding("utf8");
    sh.stdout!.on("data", (d: string) => {
      this.buf += d;
      let n;
      while ((n = this.buf.indexOf("\n")) >= 0) {
        const line = this.buf.slice(0, n);
        this.buf = this.buf.slice(n + 1);
        this.waiting.shift()?.(line === "ok");
      }
      this.idle();
    });
    return sh;
  }

  /** Idle: the shell does not keep the process alive. */
  private idle(): void {
    if (this.waiting.length > 0 || !this.sh) return;
    this.sh.unref();
    (this.sh.stdout as Socket).unref();
    (this.sh.stdin as unknown as Socket).unref();
  }

  private fail(): void {
    this.broken = true;
    this.sh = null;
    for (const w of this.waiting.splice(0)) w(false);
  }

  syncfs(path: string): Promise<boolean> {
    if (this.broken || path.includes("\n")) return Promise.resolve(false);
    this.sh ??= this.start();
    this.sh.ref();
    (this.sh.stdout as Socket).ref();
    (this.sh.stdin as unknown as Socket).ref();
    return new Promise((resolve) => {
      this.waiting.push(resolve);
      this.sh!.stdin!.write(path + "\n");
    });
  }
}

const flusher = new Flusher();

/**
 * Group commit: while a syncfs of a file system runs, the requests for it
 * that arrive wait for the next one, which serves them all (a syncfs that
 * started before a file was written does not cover it).
 */
const groups = new Map<number, { running: boolean; next: ((ok: boolean) => void)[] }>();

/** syncfs of the file system `dev`, which holds `path`. */
function syncfs(dev: number, path: string): Promise<boolean> {
  let g = groups.get(dev);
  if (!g) groups.set(dev, (g = { running: false, next: [] }));
  const group = g;
  return new Promise((resolve) => {
    group.next.push(resolve);
    const run = (): void => {
      if (group.running || group.next.length === 0) return;
      const served = group.next.splice(0);
      group.running = true;
      void flusher.syncfs(path).then((ok) => {
        group.running = false;
        for (const r of served) r(ok);
        run();
      });
    };
    run();
  });
}

/** Flushes `files` (and with `dirs`, their directories): one syncfs per file system, else fsync each. */
async function flush(files: string[], dirs: boolean): Promise<void> {
  const byDev = new Map<number, string>();
  for (const d of new Set(files.map((f) => dirname(f)))) {
    try {
      const dev = statSync(d).dev;
      if (!byDev.has(dev)) byDev.set(dev, d);
    } catch {
      /* gone meanwhile: its rename fails and says so */
    }
  }
  let ok = true;
  for (const [dev, p] of byDev) ok = (await syncfs(dev, p)) && ok;
  if (ok) return;
  if (dirs) await mapLimit([...new Set(files.map((f) => dirname(f)))], 4, syncDir);
  else
    await mapLimit(files, 4, async (f) => {
      const fh = await open(f, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
      try {
        await fh.sync();
      } finally {
        await fh.close();
      }
    });
}

function writeTemp(b: BatchFile, verify: boolean): void {
  const got = verify ? crc32(b.data) >>> 0 : b.f.crc >>> 0;
  if (got !== b.f.crc >>> 0) throw new CopyError("CHECKSUM", `arrived with CRC-32 ${got.toString(16)}, the sender's is ${(b.f.crc >>> 0).toString(16)}`);
  let st;
  try {
    st = lstatSync(b.abs);
  } catch {
    st = null;
  }
  if (st?.isDirectory()) throw new CopyError("EISDIR", "the destination is a directory, a file is expected");
  // O_NONBLOCK: a FIFO left under the temporary name fails (ENXIO) or is refused below, never blocks
  const fd = openSync(tempName(b.abs), constants.O_WRONLY | constants.O_CREAT | constants.O_TRUNC | constants.O_NOFOLLOW | constants.O_NONBLOCK, 0o600);
  try {
    if (!fstatSync(fd).isFile()) throw new CopyError("EEXIST", "its temporary name is taken by something that is not a regular file");
    let done = 0;
    while (done < b.data.length) done += writeSync(fd, b.data, done, b.data.length - done, done);
    fchmodSync(fd, b.f.mode & 0o7777);
    futimesSync(fd, b.f.mtimeMs / 1000, b.f.mtimeMs / 1000);
  } finally {
    closeSync(fd);
  }
}

/** Writes a batch; per file null (done) or its error. */
export async function writeBatch(files: BatchFile[], verify: boolean): Promise<(unknown | null)[]> {
  const res: (unknown | null)[] = files.map(() => null);
  const written: number[] = [];
  files.forEach((b, k) => {
    try {
      writeTemp(b, verify);
      written.push(k);
    } catch (e) {
      res[k] = e;
    }
  });
  if (written.length === 0) return res;
  await flush(
    written.map((k) => tempName(files[k]!.abs)),
    false,
  );
  const renamed: string[] = [];
  for (const k of written) {
    const abs = files[k]!.abs;
    try {
      renameSync(tempName(abs), abs);
      renamed.push(abs);
    } catch (e) {
      res[k] = e;
    }
  }
  if (renamed.length > 0) await flush(renamed, true);
  return res;
}

/**
 * Reads a small regular file whole into `into` (the last component followed
 * only if `follow`); a file larger than `into` is E2BIG (or, when it was
 * planned smaller, SOURCE_CHANGED). Anything but a regular file is refused
 * without blocking: the open is non-blocking (a FIFO opened for reading
 * would otherwise wait for a writer, here on the main thread).
 */
export function readSmallInto(abs: string, follow: boolean, into: Uint8Array, verify: boolean): { meta: FileMeta; crc: number } {
  const fd = openSync(abs, constants.O_RDONLY | constants.O_NONBLOCK | (follow ? 0 : constants.O_NOFOLLOW));
  try {
    const st = fstatSync(fd);
    if (!st.isFile()) throw new CopyError(st.isDirectory() ? "EISDIR" : "EINVAL", st.isDirectory() ? "is a directory" : "is not a regular file");
    if (st.size > into.length) throw new CopyError("SOURCE_CHANGED", `grew to ${st.size} bytes since it was listed; rerun with --resume`);
    let got = 0;
    while (got < st.size) {
      const n = readSync(fd, into, got, st.size - got, got);
      if (n === 0) break;
      got += n;
    }
    const now = fstatSync(fd);
    if (got !== st.size || now.size !== st.size || now.mtimeMs !== st.mtimeMs) throw new CopyError("SOURCE_CHANGED", "changed while it was read; rerun with --resume");
    return { meta: { size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs }, crc: verify && st.size > 0 ? crc32(into.subarray(0, st.size)) >>> 0 : 0 };
  } finally {
    closeSync(fd);
  }
}
