/**
 * Uploads: the plan (what each source becomes under the destination, as cp
 * and scp name it; --resume recognises the copy an earlier run made) and
 * the transfer. A chunk is read into slot k, RDMA WRITTEN into the
 * server's slot k and announced with `put` on the same QP, so the data is
 * in place when the call arrives; small files are read straight into a
 * slot, many per slot and per call. A source that changed during the copy
 * fails it (SOURCE_CHANGED), resumable.
 */
import { realpath, stat } from "node:fs/promises";
import { basename, join, posix } from "node:path";
import { CopyError, withPath } from "./paths.js";
import { chunkLen } from "./chunks.js";
import { FileSource } from "./files.js";
import { readSmallInto } from "./batch.js";
import { MAX_ENTRIES, walk } from "./tree.js";
import { checkListing, encodePut, fromJson, toJson, type SmallFile } from "./protocol.js";
import { codeOf, msgOf, type Session } from "./cp-session.js";
import { agree, done, earlierCopy, resultsOf, topLevel, transferTree, type Item } from "./cp-transfer.js";

export async function planUpload(s: Session, srcs: string[], dest: string): Promise<Item[]> {
  const p = s.p;
  const d = fromJson(await s.rpcCall("stat", toJson({ path: dest })));
  const dtype = String(d.type);
  if (srcs.length > 1 && dtype !== "dir") throw new CopyError("ENOTDIR", `${dest || "."}: ${dtype === "none" ? "no such directory" : "is a file, a directory is expected"} (several sources)`);
  const items: Item[] = [];
  for (const src of srcs) {
    let st;
    try {
      st = await stat(src);
    } catch (e) {
      p.fail(src, codeOf(e), msgOf(withPath(e, src)));
      continue;
    }
    let base = dtype === "dir" ? posix.join(dest, basename(src)) : dest;
    if (st.isDirectory()) {
      if (!s.opts.recursive) {
        p.fail(src, "EISDIR", "is a directory (use -r)");
        continue;
      }
      if (dtype === "file" || dtype === "symlink") {
        p.fail(src, "ENOTDIR", `${dest}: the destination is a file, a directory is expected`);
        continue;
      }
      const root = await realpath(src);
      const entries = await walk(root);
      if (s.opts.resume && dtype === "dir" && srcs.length === 1 && String((await s.call("stat", { path: base })).type) === "none") {
        const theirs = checkListing((await s.call("list", { path: dest })).entries, MAX_ENTRIES);
        if (earlierCopy(topLevel(theirs), topLevel(entries))) base = dest;
      }
      for (const e of entries) items.push({ from: e.path === "" ? root : join(root, e.path), to: e.path === "" ? base : posix.join(base, e.path), entry: e });
    } else if (st.isFile()) {
      // a trailing slash names a directory, as with cp and scp
      if (dtype !== "dir" && dest.endsWith("/")) {
        p.fail(src, dtype === "none" ? "ENOENT" : "ENOTDIR", `${dest}: ${dtype === "none" ? "no such directory" : "not a directory"}`);
        continue;
      }
      items.push({ from: src, to: base, entry: { path: "", type: "file", size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs } });
    } else p.fail(src, "EINVAL", "not a regular file or directory");
  }
  return items;
}

export async function upload(s: Session, items: Item[]): Promise<void> {
  const p = s.p;
  if (s.readOnly) throw new CopyError("EROFS", "the server is read-only");
  await transferTree(s, items, {
    mkdirs: async (dirs, times) => resultsOf(await s.call("mkdirs", { dirs: dirs.map((i) => ({ path: i.to, mode: i.entry.mode, mtimeMs: i.entry.mtimeMs })), times })),
    links: async (links) => resultsOf(await s.call("symlinks", { links: links.map((i) => ({ path: i.to, target: i.entry.target })) })),
    same: async (files) => (await s.call("check", { files: files.map((i) => ({ path: i.to, size: i.entry.size, mtimeMs: i.entry.mtimeMs })) })).same as boolean[],
    small: async (batch) => {
      const slot = await s.slots.acquire();
      try {
        const at = slot * s.chunk;
        const files: SmallFile[] = [];
        const ok: Item[] = [];
        let off = 0;
        for (const i of batch) {
          try {
            // read straight into the registered slot; a file named on the command line is
            // followed (as scp does), inside a tree links are copied as links
            const r = readSmallInto(i.from, i.entry.path === "", s.local.subarray(at + off, at + s.chunk), s.opts.verify);
            files.push({ path: i.to, ...r.meta, crc: r.crc, off });
            ok.push(i);
            off += r.meta.size;
          } catch (e) {
            p.fail(i.from, codeOf(e), msgOf(withPath(e, i.from)));
          }
        }
        if (files.length === 0) return;
        p.file = ok[ok.length - 1]!.to;
        // the WRITE is posted before the call: on one QP the bytes are in place when it arrives
        const wrote = off > 0 ? s.rdma.write(s.ring.slice(at, at + off), s.rmr.slice(at, at + off)) : Promise.resolve();
        const [, reply] = await Promise.all([wrote, s.call("putSmall", { slot, files })]);
        resultsOf(reply).forEach((x, k) => {
          const i = ok[k]!;
          if (x.ok) done(p, i);
          else p.fail(i.to, x.code, x.message);
        });
      } finally {
        s.slots.release(slot);
      }
    },
    big: async (i) => {
      const src = await FileSource.open(i.from, true);
      let id = -1;
      try {
        p.file = i.to;
        const o = await s.call("open", { path: i.to, ...src.meta, resume: s.opts.resume });
        id = Number(o.id);
        const theirs = (o.existing as number[]) ?? [];
        let first = 0;
        if (theirs.length > 0) {
          first = agree(await src.prefixCrcs(s.chunk, theirs.length), theirs);
          const r = await s.call("accept", { id, chunks: first });
          p.skipped += Number(r.bytes);
        }
        const size = src.st.size;
        await s.pipeline(size, first, async (k, slot) => {
          const off = k * s.chunk;
          const n = chunkLen(size, s.chunk, k);
          const view = s.local.subarray(slot * s.chunk, slot * s.chunk + n);
          const crc = await src.readChunk(k, s.chunk, view, s.opts.verify);
          const at = slot * s.chunk;
          if (s.opts.pull) await s.rpcCall("pull", encodePut(id, slot, off, n, crc));
          // WRITE then the call, on one QP: the data is in place when `put` arrives
          else await Promise.all([s.rdma.write(s.ring.slice(at, at + n), s.rmr.slice(at, at + n)), s.rpcCall("put", encodePut(id, slot, off, n, crc))]);
          p.add(n);
        });
        if (await src.changed()) throw new CopyError("SOURCE_CHANGED", "the source changed during the copy; rerun with --resume");
        await s.call("finish", { id, digest: src.digest() });
        id = -1;
        p.files++;
      } finally {
        if (id >= 0) await s.call("abort", { id }).catch(() => {});
        await src.close();
      }
    },
  });
}

/** The upload of a spooled stream: one file, to the path `dest` names (not a directory: a stream has no name). */
export async function planStdin(s: Session, path: string, dest: string): Promise<Item[]> {
  const d = await s.call("stat", { path: dest });
  if (dest === "" || dest.endsWith("/") || String(d.type) === "dir") throw new CopyError("EISDIR", `${dest || "."}: is a directory; - (stdin) needs a file name as the destination`);
  const st = await stat(path);
  return [{ from: path, to: dest, entry: { path: "", type: "file", size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs } }];
}
