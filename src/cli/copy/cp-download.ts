/**
 * Downloads: the plan (a link named on the command line is followed, the
 * server answers the path it resolved to; a malformed listing is refused
 * whole) and the transfer. The server reads a chunk into its slot k and
 * answers its CRC to `get`; we RDMA READ the slot, check and write. Every
 * local target is resolved when written, its parents through symlinks and
 * checked to stay inside the destination; modes lose setuid/setgid unless
 * asked. `-` as the destination writes the one file in order (stream.ts).
 */
import { lstat, readdir, stat } from "node:fs/promises";
import { realpathSync } from "node:fs";
import { basename, join, posix } from "node:path";
import type { Writable } from "node:stream";
import { checkRel, CopyError, resolveInsideSync, withPath } from "./paths.js";
import { chunkLen } from "./chunks.js";
import { FileSink, sameSecond } from "./files.js";
import { writeBatch, type BatchFile } from "./batch.js";
import { makeDir, makeLink, mapLimit, MAX_ENTRIES, peerMode, setTimes } from "./tree.js";
import { checkListing, encodeGet, smallFiles, type Result } from "./protocol.js";
import { StreamSink } from "./stream.js";
import { codeOf, fatal, msgOf, type Session } from "./cp-session.js";
import { agree, done, earlierCopy, topLevel, transferTree, type Item } from "./cp-transfer.js";

/**
 * Where a download writes `i`: its path below the destination, with the
 * parent directories resolved through symlinks and checked to stay inside
 * the destination, so a link left by an earlier copy from a hostile server
 * cannot lead a later write out of it.
 */
function localTarget(i: Item, parents: Map<string, string>): string {
  if (i.base === undefined || i.rel === undefined || i.rel === "") return i.to;
  let root = parents.get("\0" + i.base);
  if (root === undefined) {
    root = realpathSync(i.base);
    parents.set("\0" + i.base, root);
  }
  return resolveInsideSync(root, i.rel, parents);
}

/** topLevel() of a local directory. */
async function localTopLevel(dir: string): Promise<Map<string, string>> {
  const out = new Map<string, string>();
  for (const n of await readdir(dir)) {
    if (n.startsWith(".") && n.endsWith(".rdma-part")) continue;
    const st = await lstat(join(dir, n)).catch(() => null);
    out.set(n, st?.isSymbolicLink() ? "symlink" : st?.isDirectory() ? "dir" : st?.isFile() ? "file" : "other");
  }
  return out;
}

export async function planDownload(s: Session, srcs: string[], dest: string): Promise<Item[]> {
  const p = s.p;
  const dst = await lstat(dest).catch(() => null);
  const isDir = dst?.isDirectory() === true || (dst?.isSymbolicLink() === true && (await stat(dest).catch(() => null))?.isDirectory() === true);
  if (srcs.length > 1 && !isDir) throw new CopyError("ENOTDIR", `${dest}: ${dst ? "is a file, a directory is expected" : "no such directory"} (several sources)`);
  const items: Item[] = [];
  for (const src of srcs) {
    let answer: Record<string, unknown>;
    try {
      // a link named on the command line is followed (as for uploads, and as scp does); the
      // server answers the path it resolved to, inside the served tree
      answer = await s.call("list", { path: src, follow: true });
    } catch (e) {
      if (fatal(e)) throw e;
      p.fail(src, codeOf(e), msgOf(e));
      continue;
    }
    // the whole listing is refused when any of it is malformed (PROTOCOL: the server is broken or hostile)
    const entries = checkListing(answer.entries, MAX_ENTRIES);
    const top = entries[0];
    if (!top) {
      p.fail(src, "EINVAL", "not a regular file, directory or link (sockets, FIFOs and devices are not copied)");
      continue;
    }
    if (top.type === "symlink") {
      // a server that does not follow links (older than this cp) lists the link itself
      p.fail(src, "ELOOP", "is a symlink on the server, which did not follow it (a newer async-rdma serve does)");
      continue;
    }
    const from = typeof answer.path === "string" ? checkRel(answer.path) : src;
    let base = isDir ? join(dest, basename(src) || ".") : dest;
    if (top.type === "dir") {
      if (!s.opts.recursive) {
        p.fail(src, "EISDIR", "is a directory (use -r)");
        continue;
      }
      if (dst && !isDir && srcs.length === 1) {
        p.fail(dest, "ENOTDIR", "the destination is a file, a directory is expected");
        continue;
      }
      if (s.opts.resume && isDir && srcs.length === 1 && basename(src) !== "" && (await lstat(base).catch(() => null)) === null && earlierCopy(await localTopLevel(dest), topLevel(entries))) base = dest;
    } else if (!isDir && dest.endsWith("/")) {
      // a trailing slash names a directory, as with cp and scp
      p.fail(dest, dst ? "ENOTDIR" : "ENOENT", dst ? "not a directory" : "no such directory");
      continue;
    }
    for (const e of entries) {
      const rel = e.path;
      items.push({ from: rel === "" ? from : posix.join(from, rel), to: rel === "" ? base : join(base, rel), entry: e, base, rel });
    }
  }
  return items;
}

export async function download(s: Session, items: Item[]): Promise<void> {
  const p = s.p;
  // targets are resolved when written (the directories of this copy are created first)
  const parents = new Map<string, string>();
  const at_ = (i: Item): string => localTarget(i, parents);
  // the server chooses modes: setuid/setgid only when the user asked for them
  const mode = (m: number): number => peerMode(m, s.opts.keepSetid);
  const each = async (list: Item[], fn: (i: Item) => Promise<void>): Promise<Result[]> =>
    mapLimit(list, 1, async (i) => {
      try {
        await fn(i);
        return { ok: true } as Result;
      } catch (e) {
        return { ok: false, code: codeOf(e), message: msgOf(withPath(e, i.to)) };
      }
    });
  await transferTree(s, items, {
    mkdirs: (dirs, times) => each(dirs, async (i) => (times ? setTimes(at_(i), mode(i.entry.mode), i.entry.mtimeMs) : makeDir(at_(i), mode(i.entry.mode) | 0o700))),
    links: (links) => each(links, async (i) => makeLink(at_(i), i.entry.target ?? "")),
    same: (files) =>
      mapLimit(files, 16, async (i) => {
        const st = await lstat(at_(i)).catch(() => null);
        return st !== null && st.isFile() && st.size === i.entry.size && sameSecond(st.mtimeMs, i.entry.mtimeMs);
      }),
    small: async (batch) => {
      const slot = await s.slots.acquire();
      try {
        const byPath = new Map(batch.map((i) => [checkRel(i.from), i]));
        const files = smallFiles(await s.call("getSmall", { slot, paths: [...byPath.keys()] }), "files", s.chunk, batch.length);
        const at = slot * s.chunk;
        let end = 0;
        for (const f of files) if ("crc" in f) end = f.off + f.size;
        if (end > 0) await s.rdma.read(s.ring.slice(at, at + end), s.rmr.slice(at, at + end));
        const todo: { i: Item; b: BatchFile }[] = [];
        for (const f of files) {
          const i = byPath.get(f.path);
          if (!i) throw new CopyError("PROTOCOL", `the server sent ${JSON.stringify(f.path)}, which was not asked for`);
          if (!("crc" in f)) p.fail(i.from, f.code, f.message);
          else {
            try {
              todo.push({ i, b: { abs: at_(i), f: { ...f, mode: mode(f.mode) }, data: s.local.subarray(at + f.off, at + f.off + f.size) } });
            } catch (e) {
              p.fail(i.to, codeOf(e), msgOf(withPath(e, i.to)));
            }
          }
        }
        if (todo.length > 0) p.file = todo[todo.length - 1]!.i.from;
        const errs = await writeBatch(
          todo.map((t) => t.b),
          s.opts.verify,
        );
        errs.forEach((e, k) => {
          const { i } = todo[k]!;
          if (e === null) done(p, i);
          else p.fail(i.to, codeOf(e), msgOf(withPath(e, i.to)));
        });
      } finally {
        s.slots.release(slot);
      }
    },
    big: async (i) => {
      p.file = i.from;
      const o = await s.call("openRead", { path: i.from });
      const id = Number(o.id);
      let open = true;
      let sink: FileSink | null = null;
      try {
        const meta = { size: Number(o.size), mode: mode(Number(o.mode)), mtimeMs: Number(o.mtimeMs) };
        sink = await FileSink.open(at_(i), meta, s.chunk, s.opts.resume, s.opts.verify, s.direct);
        let first = 0;
        if (sink.existing.length > 0) {
          const theirs = (await s.call("sums", { id, count: sink.existing.length })).crcs as number[];
          first = agree(sink.existing, theirs);
          p.skipped += sink.accept(first);
        }
        const k0 = sink;
        await s.pipeline(meta.size, first, async (k, slot) => {
          const off = k * s.chunk;
          const n = chunkLen(meta.size, s.chunk, k);
          const r = await s.rpcCall("get", encodeGet(id, slot, off, n));
          const crc = new DataView(r.buffer, r.byteOffset, r.byteLength).getUint32(0);
          const at = slot * s.chunk;
          await s.rdma.read(s.ring.slice(at, at + n), s.rmr.slice(at, at + n));
          await k0.write(off, s.local.subarray(at, at + n), crc);
          p.add(n);
        });
        const c = await s.call("closeRead", { id });
        open = false;
        if (c.changed === true) throw new CopyError("SOURCE_CHANGED", "the source changed during the copy; rerun with --resume");
        await sink.finish(String(c.digest));
        sink = null;
        p.files++;
      } finally {
        await sink?.abort();
        if (open) await s.call("closeRead", { id }).catch(() => {});
      }
    },
  });
}

/** One remote file written to `out` in order (stream.ts). */
export async function downloadTo(s: Session, src: string, out: Writable): Promise<void> {
  const p = s.p;
  const answer = await s.call("list", { path: src, follow: true });
  const top = checkListing(answer.entries, MAX_ENTRIES)[0];
  if (!top || top.type !== "file") throw new CopyError(top?.type === "dir" ? "EISDIR" : "EINVAL", `${src}: ${top?.type === "dir" ? "is a directory" : "is not a regular file"}; - (stdout) takes one file`);
  const from = typeof answer.path === "string" ? checkRel(answer.path) : src;
  p.file = from;
  const o = await s.call("openRead", { path: from });
  const id = Number(o.id);
  let open = true;
  try {
    const size = Number(o.size);
    p.total = size;
    const sink = new StreamSink(out, size, s.chunk, s.opts.verify);
    await s.pipeline(size, 0, async (k, slot) => {
      const off = k * s.chunk;
      const n = chunkLen(size, s.chunk, k);
      try {
        const r = await s.rpcCall("get", encodeGet(id, slot, off, n));
        const crc = new DataView(r.buffer, r.byteOffset, r.byteLength).getUint32(0);
        const at = slot * s.chunk;
        await s.rdma.read(s.ring.slice(at, at + n), s.rmr.slice(at, at + n));
        await sink.write(off, s.local.subarray(at, at + n), crc);
      } catch (e) {
        // the chunks after this one wait for it: they fail with it
        sink.fail(e);
        throw e;
      }
      p.add(n);
    });
    const c = await s.call("closeRead", { id });
    open = false;
    if (c.changed === true) throw new CopyError("SOURCE_CHANGED", "the source changed during the copy");
    sink.finish(String(c.digest));
    p.files++;
    p.tick(true);
  } finally {
    if (open) await s.call("closeRead", { id }).catch(() => {});
  }
}
