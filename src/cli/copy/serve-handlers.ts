/**
 * The server's answer to each call of one connection: every path a client
 * names is confined to the served tree (paths.ts), every change refused on
 * a read-only server, every slot and length checked against the ring, and
 * an fs error comes back with the client's path, never the server's.
 */
import { lstat, realpath } from "node:fs/promises";
import { dirname, relative } from "node:path";
import type { RpcHandler } from "../../rpc/index.js";
import { checkLinkTarget, checkRel, CopyError, inside, resolveInside, resolveInsideSync, withPath } from "./paths.js";
import { readSmallInto, writeBatch, type BatchFile } from "./batch.js";
import { chunkLen } from "./chunks.js";
import { allocRing } from "./direct-io.js";
import { FileSink, FileSource, sameSecond } from "./files.js";
import { makeDir, makeLink, mapLimit, peerMode, setTimes, walk } from "./tree.js";
import { arr, decodeGet, decodePut, failure, fromJson, int, num, smallFiles, str, toJson, VERSION, type Result, type SmallResult } from "./protocol.js";
import { makeRoom, MAX_CHUNK, MAX_DEPTH, MAX_RING, MAX_TOTAL_RING, MIN_CHUNK, ringShares, ringTotal } from "./serve-rings.js";
import type { Session } from "./serve-session.js";

const MAX_BATCH_FILES = 10_000;

async function where(s: Session, path: unknown): Promise<{ rel: string; abs: string }> {
  const rel = checkRel(path);
  return { rel, abs: await resolveInside(s.opts.root, rel) };
}

/** The handlers of the calls of the connection `s`. */
export function handlers(s: Session): Record<string, RpcHandler> {
  const { root } = s.opts;
  /** Runs a handler; fs errors come back with the client's path, never the server's. */
  const h =
    (fn: (p: Uint8Array) => Promise<Uint8Array | void>): RpcHandler =>
    async (p) => {
      s.calls++;
      try {
        return await fn(p);
      } catch (e) {
        throw withPath(e, "");
      } finally {
        s.calls--;
        s.lastCall = performance.now();
      }
    };
  const json =
    (fn: (o: Record<string, unknown>) => Promise<unknown>): RpcHandler =>
    h(async (p) => toJson(await fn(fromJson(p))));
  const sinkOf = (o: Record<string, unknown>) => {
    const e = s.sinks.get(int(o, "id"));
    if (!e) throw new CopyError("PROTOCOL", "no such open file");
    return e;
  };
  const each = async <T>(items: T[], fn: (t: T) => Promise<Result | void>): Promise<Result[]> =>
    mapLimit(items, 1, async (t) => {
      try {
        return (await fn(t)) ?? { ok: true };
      } catch (e) {
        return failure(withPath(e, String((t as { path?: unknown }).path ?? "")));
      }
    });
  return {
    hello: json(async (o) => {
      if (s.greeted || s.ended) throw new CopyError("PROTOCOL", "hello twice, or on an ended connection");
      s.greeted = true;
      const chunk = int(o, "chunk", MIN_CHUNK, MAX_CHUNK);
      const depth = Math.min(int(o, "depth", 1, 1024), MAX_DEPTH, Math.floor(MAX_RING / chunk));
      if (ringTotal.bytes + chunk * depth > MAX_TOTAL_RING || !ringShares.fits(s.rdma.peer.address, chunk * depth)) await makeRoom(chunk * depth, s);
      if (ringTotal.bytes + chunk * depth > MAX_TOTAL_RING) throw new CopyError("EBUSY", `the server is busy: its connections hold ${ringTotal.bytes >> 20} MiB of buffers (at most ${MAX_TOTAL_RING >> 20} MiB); retry later or ask for a smaller --chunk/--depth`);
      const from = s.rdma.peer.address;
      if (!ringShares.fits(from, chunk * depth)) throw new CopyError("EBUSY", `the server is busy for ${from}: connections from this address hold ${ringShares.heldBy(from) >> 20} MiB of buffers (one address may hold at most half of ${MAX_TOTAL_RING >> 20} MiB); retry later or ask for a smaller --chunk/--depth`);
      if (s.ended) throw new CopyError("PROTOCOL", "the connection ended");
      ringTotal.bytes += chunk * depth;
      ringShares.take(from, chunk * depth);
      s.counted = chunk * depth;
      s.chunk = chunk;
      s.depth = depth;
      s.verify = o.verify !== false;
      const r = allocRing(s.rdma, chunk * depth, chunk, s.opts.readOnly ? null : s.opts.root);
      s.ring = r.ring;
      s.direct = r.direct;
      s.bytes = s.ring.bytes;
      // exactly the ring, to this connection only; read-only servers never let a client write
      s.share = s.rdma.share("cp-ring", s.ring, { access: s.opts.readOnly ? "read" : "write" });
      if (o.pull === true) s.peerRing = await s.rdma.openSharedMr("cp-client-ring");
      return { version: VERSION, chunk, depth, ring: "cp-ring", readOnly: s.opts.readOnly };
    }),
    stat: json(async (o) => {
      const { rel, abs } = await where(s, o.path);
      try {
        const st = await lstat(abs);
        const type = st.isSymbolicLink() ? "symlink" : st.isDirectory() ? "dir" : st.isFile() ? "file" : "other";
        return { type, size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs };
      } catch (e) {
        if ((e as { code?: unknown }).code === "ENOENT") return { type: "none" };
        throw withPath(e, rel);
      }
    }),
    list: json(async (o) => {
      let { rel, abs } = await where(s, o.path);
      // follow: a link named on cp's command line is followed, to where it leads inside the tree
      if (o.follow === true && rel !== "" && (await lstat(abs).catch(() => null))?.isSymbolicLink() === true) {
        let real: string;
        try {
          real = await realpath(abs);
        } catch (e) {
          throw withPath(e, rel);
        }
        if (!inside(root, real)) throw new CopyError("ESCAPE", `${JSON.stringify(rel)} is a link that leads outside the served directory: refused`);
        abs = real;
        rel = relative(root, real);
      }
      try {
        return { entries: await walk(abs), path: rel };
      } catch (e) {
        throw withPath(e, rel);
      }
    }),
    check: json(async (o) => {
      const same: boolean[] = [];
      for (const f of arr(o, "files", 1_000_000)) {
        const { abs } = await where(s, f.path);
        const st = await lstat(abs).catch(() => null);
        same.push(st !== null && st.isFile() && st.size === num(f, "size") && sameSecond(st.mtimeMs, num(f, "mtimeMs", -1e15, 1e15)));
      }
      return { same };
    }),
    mkdirs: json(async (o) => {
      s.writable();
      const times = o.times === true;
      return {
        results: await each(arr(o, "dirs", 1_000_000), async (d) => {
          const { abs } = await where(s, d.path);
          const mode = peerMode(int(d, "mode", 0, 0o7777), s.opts.keepSetid);
          if (times) await setTimes(abs, mode, num(d, "mtimeMs", -1e15, 1e15));
          else await makeDir(abs, mode | 0o700);
        }),
      };
    }),
    symlinks: json(async (o) => {
      s.writable();
      return {
        results: await each(arr(o, "links", 1_000_000), async (l) => {
          const { rel, abs } = await where(s, l.path);
          const target = str(l, "target");
          // judged from the link's real directory (abs's parent is a realpath), as the kernel will resolve it
          checkLinkTarget(rel, target, root, dirname(abs));
          await makeLink(abs, target);
        }),
      };
    }),
    open: json(async (o) => {
      s.writable();
      const { rel, abs } = await where(s, o.path);
      if (rel === "") throw new CopyError("EISDIR", "the destination is the served directory, a file is expected");
      if (!s.bytes || s.ended) throw new CopyError("PROTOCOL", "hello first");
      const meta = { size: int(o, "size"), mode: peerMode(int(o, "mode", 0, 0o7777), s.opts.keepSetid), mtimeMs: num(o, "mtimeMs", -1e15, 1e15) };
      const id = s.id();
      try {
        const sink = await FileSink.open(abs, meta, s.chunk, o.resume === true, s.verify, s.direct, s.state);
        s.sinks.set(id, { sink, rel });
        return { id, existing: sink.existing };
      } catch (e) {
        throw withPath(e, rel);
      }
    }),
    accept: json(async (o) => {
      const { sink } = sinkOf(o);
      return { bytes: sink.accept(int(o, "chunks")) };
    }),
    put: h(async (p) => {
      const m = decodePut(p);
      const e = s.sinks.get(m.id);
      if (!e) throw new CopyError("PROTOCOL", "put: no such open file");
      await s.withSlot(m.slot, m.len, async (view) => {
        try {
          await e.sink.write(m.off, view, m.crc);
        } catch (err) {
          throw withPath(err, e.rel);
        }
      });
    }),
    // the alternative upload data path (measured against put: docs/performance.md):
    // the server RDMA READs the chunk from the client's slot into its own
    pull: h(async (p) => {
      const m = decodePut(p);
      const e = s.sinks.get(m.id);
      const peer = s.peerRing;
      if (!e || !peer || !s.ring) throw new CopyError("PROTOCOL", "pull: no such open file, or no client ring");
      await s.withSlot(m.slot, m.len, async (view) => {
        const at = m.slot * s.chunk;
        await s.rdma.read(s.ring!.slice(at, at + m.len), peer.slice(at, at + m.len));
        try {
          await e.sink.write(m.off, view, m.crc);
        } catch (err) {
          throw withPath(err, e.rel);
        }
      });
    }),
    finish: json(async (o) => {
      const e = sinkOf(o);
      s.sinks.delete(int(o, "id"));
      try {
        await e.sink.finish(str(o, "digest"));
      } catch (err) {
        await e.sink.abort();
        throw withPath(err, e.rel);
      }
      return {};
    }),
    abort: json(async (o) => {
      const e = s.sinks.get(int(o, "id"));
      s.sinks.delete(int(o, "id"));
      await e?.sink.abort();
      return {};
    }),
    putSmall: json(async (o) => {
      s.writable();
      const slot = int(o, "slot", 0, 0xffffffff);
      const files = smallFiles(o, "files", s.chunk, MAX_BATCH_FILES).map((f) => ("crc" in f ? { ...f, mode: peerMode(f.mode, s.opts.keepSetid) } : f));
      const parents = new Map<string, string>();
      const results: Result[] = files.map(() => ({ ok: true }));
      // the bytes are in our slot (the client WROTE them before this call, on the same QP)
      await s.withSlot(slot, s.chunk, async (view) => {
        const todo: { k: number; b: BatchFile }[] = [];
        files.forEach((f, k) => {
          try {
            if (!("crc" in f)) throw new CopyError("PROTOCOL", "an upload entry without data");
            const abs = resolveInsideSync(root, checkRel(f.path), parents);
            if (abs === root) throw new CopyError("EISDIR", "the destination is the served directory");
            todo.push({ k, b: { abs, f, data: view.subarray(f.off, f.off + f.size) } });
          } catch (e) {
            results[k] = failure(withPath(e, f.path));
          }
        });
        const errs = await writeBatch(
          todo.map((t) => t.b),
          s.verify,
        );
        errs.forEach((e, j) => {
          const t = todo[j]!;
          if (e !== null) results[t.k] = failure(withPath(e, t.b.f.path));
        });
      });
      return { results };
    }),
    openRead: json(async (o) => {
      const { rel, abs } = await where(s, o.path);
      const id = s.id();
      try {
        const src = await FileSource.open(abs);
        s.sources.set(id, { src, rel });
        return { id, ...src.meta };
      } catch (e) {
        throw withPath(e, rel);
      }
    }),
    sums: json(async (o) => {
      const e = s.sources.get(int(o, "id"));
      if (!e) throw new CopyError("PROTOCOL", "no such open file");
      return { crcs: await e.src.prefixCrcs(s.chunk, int(o, "count", 0, 1 << 30)) };
    }),
    get: h(async (p) => {
      const m = decodeGet(p);
      const e = s.sources.get(m.id);
      if (!e) throw new CopyError("PROTOCOL", "get: no such open file");
      const i = m.off / s.chunk;
      if (!Number.isInteger(i) || m.len !== chunkLen(e.src.st.size, s.chunk, i)) throw new CopyError("PROTOCOL", `get: offset ${m.off} length ${m.len} is not a chunk of the file`);
      const crc = await s.withSlot(m.slot, m.len, async (view) => {
        try {
          return await e.src.readChunk(i, s.chunk, view, s.verify);
        } catch (err) {
          throw withPath(err, e.rel);
        }
      });
      const out = new Uint8Array(4);
      new DataView(out.buffer).setUint32(0, crc);
      return out;
    }),
    closeRead: json(async (o) => {
      const id = int(o, "id");
      const e = s.sources.get(id);
      if (!e) throw new CopyError("PROTOCOL", "no such open file");
      s.sources.delete(id);
      try {
        return { changed: await e.src.changed(), digest: e.src.digest() };
      } finally {
        await e.src.close();
      }
    }),
    getSmall: json(async (o) => {
      const slot = int(o, "slot", 0, 0xffffffff);
      const paths = o.paths;
      if (!Array.isArray(paths) || paths.length > MAX_BATCH_FILES) throw new CopyError("PROTOCOL", `getSmall: at most ${MAX_BATCH_FILES} paths`);
      const parents = new Map<string, string>();
      const files: SmallResult[] = [];
      // read into our slot, back to back; the client READs them after the answer
      await s.withSlot(slot, s.chunk, async (view) => {
        let off = 0;
        for (const path of paths) {
          let rel = String(path);
          try {
            rel = checkRel(path);
            const r = readSmallInto(resolveInsideSync(root, rel, parents), false, view.subarray(off), s.verify);
            files.push({ path: rel, ...r.meta, crc: r.crc, off });
            off += r.meta.size;
          } catch (e) {
            const f = failure(withPath(e, rel));
            files.push({ path: rel, code: f.code, message: f.message });
          }
        }
      });
      return { files };
    }),
  };
}
