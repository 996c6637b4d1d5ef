/**
 * The cp/serve protocol: calls of async-rdma/rpc on one connection. Metadata
 * travels as JSON; the two hot calls are fixed binary layouts (big-endian).
 *
 *   hello   {version, chunk, depth}            → {version, chunk, depth, ring, readOnly}
 *           the server allocates depth × chunk bytes of registered memory for
 *           this connection and shares exactly that (name `ring`): "read"
 *           for a read-only server, else "write". Slot k is bytes
 *           [k·chunk, (k+1)·chunk); the client owns the slot numbers.
 *   stat    {path}                             → {type, size, mode, mtimeMs}
 *   list    {path, follow?}                    → {entries: Entry[], path} (the tree, never following
 *           links inside it; with `follow`, a link at `path` itself is followed to where it
 *           leads inside the served tree, and `path` is where that is)
 *   check   {files: [{path, size, mtimeMs}]}   → {same: boolean[]}   (resume's quick check)
 *   mkdirs  {dirs: [{path, mode, mtimeMs}], times} → {results}
 *   symlinks {links: [{path, target}]}         → {results}
 *   open    {path, size, mode, mtimeMs, resume} → {id, existing: crc[]}   (upload)
 *   accept  {id, chunks}                       → {}
 *   put     PUT (24 bytes): u32 id, u32 slot, f64 offset, u32 length, u32 crc  → empty
 *           the client has WRITTEN the chunk into slot `slot` (same QP, so
 *           it is in place before the call arrives)
 *   finish  {id, digest}                       → {}
 *   abort   {id}                               → {}
 *   putSmall {slot, files: SmallFile[]}       → {results}
 *           the client has WRITTEN the files' bytes into slot `slot`, each at its `off`
 *   openRead {path}                            → {id, size, mode, mtimeMs}   (download)
 *   sums    {id, count}                        → {crcs}
 *   get     GET (20 bytes): u32 id, u32 slot, f64 offset, u32 length → u32 crc
 *           the server has read the chunk into slot `slot`; the client READs it
 *   closeRead {id}                             → {changed, digest}
 *   getSmall {slot, paths}                     → {files: (SmallFile | {path, code, message})[]}
 *           the server has read the files into slot `slot`; the client READs them
 *
 * SmallFile: {path, size, mode, mtimeMs, crc, off}: `size` bytes at `off` in
 * the slot; a slot's files never overlap and stay inside it.
 */
import { posix } from "node:path";
import { checkRel, CopyError } from "./paths.js";

export const VERSION = 1;
export const PUT_BYTES = 24;
export const GET_BYTES = 20;

export type EntryType = "file" | "dir" | "symlink";
export interface Entry {
  path: string;
  type: EntryType;
  size: number;
  mode: number;
  mtimeMs: number;
  target?: string;
}

export interface SmallFile {
  path: string;
  size: number;
  mode: number;
  mtimeMs: number;
  crc: number;
  /** Where its bytes are in the slot. */
  off: number;
}
export type SmallResult = SmallFile | { path: string; code: string; message: string };
export type Result = { ok: true; skipped?: boolean } | { ok: false; code: string; message: string };

const enc = new TextEncoder();
const dec = new TextDecoder("utf-8", { fatal: true });

export function toJson(v: unknown): Uint8Array {
  return enc.encode(JSON.stringify(v));
}

export function fromJson(b: Uint8Array): Record<string, unknown> {
  let v: unknown;
  try {
    v = JSON.parse(dec.decode(b));
  } catch {
    throw new CopyError("PROTOCOL", "a message is not valid JSON");
  }
  if (v === null || typeof v !== "object" || Array.isArray(v)) throw new CopyError("PROTOCOL", "a message is not a JSON object");
  return v as Record<string, unknown>;
}

export function num(o: Record<string, unknown>, k: string, min = 0, max = Number.MAX_SAFE_INTEGER): number {
  const v = o[k];
  if (typeof v !== "number" || !Number.isFinite(v) || v < min || v > max) throw new CopyError("PROTOCOL", `field ${k} must be a number in [${min}, ${max}]`);
  return v;
}

export function int(o: Record<string, unknown>, k: string, min = 0, max = Number.MAX_SAFE_INTEGER): number {
  const v = num(o, k, min, max);
  if (!Number.isInteger(v)) throw new CopyError("PROTOCOL", `field ${k} must be an integer`);
  return v;
}

export function str(o: Record<string, unknown>, k: string): string {
  const v = o[k];
  if (typeof v !== "string") throw new CopyError("PROTOCOL", `field ${k} must be a string`);
  return v;
}

export function arr(o: Record<string, unknown>, k: string, max: number): Record<string, unknown>[] {
  const v = o[k];
  if (!Array.isArray(v) || v.length > max) throw new CopyError("PROTOCOL", `field ${k} must be a list of at most ${max}`);
  for (const x of v) if (x === null || typeof x !== "object") throw new CopyError("PROTOCOL", `field ${k} must hold objects`);
  return v as Record<string, unknown>[];
}

export function encodePut(id: number, slot: number, off: number, len: number, crc: number): Uint8Array {
  const b = new Uint8Array(PUT_BYTES);
  const v = new DataView(b.buffer);
  v.setUint32(0, id);
  v.setUint32(4, slot);
  v.setFloat64(8, off);
  v.setUint32(16, len);
  v.setUint32(20, crc >>> 0);
  return b;
}

export function decodePut(b: Uint8Array): { id: number; slot: number; off: number; len: number; crc: number } {
  if (b.length !== PUT_BYTES) throw new CopyError("PROTOCOL", `put: ${b.length} bytes, expected ${PUT_BYTES}`);
  const v = new DataView(b.buffer, b.byteOffset, b.byteLength);
  return { id: v.getUint32(0), slot: v.getUint32(4), off: v.getFloat64(8), len: v.getUint32(16), crc: v.getUint32(20) };
}

export function encodeGet(id: number, slot: number, off: number, len: number): Uint8Array {
  const b = new Uint8Array(GET_BYTES);
  const v = new DataView(b.buffer);
  v.setUint32(0, id);
  v.setUint32(4, slot);
  v.setFloat64(8, off);
  v.setUint32(16, len);
  return b;
}

export function decodeGet(b: Uint8Array): { id: number; slot: number; off: number; len: number } {
  if (b.length !== GET_BYTES) throw new CopyError("PROTOCOL", `get: ${b.length} bytes, expected ${GET_BYTES}`);
  const v = new DataView(b.buffer, b.byteOffset, b.byteLength);
  return { id: v.getUint32(0), slot: v.getUint32(4), off: v.getFloat64(8), len: v.getUint32(16) };
}

/**
 * A slot's list of small files (from the peer): every entry well-formed,
 * every ok file inside the slot's `slotBytes` and after the previous one.
 */
export function smallFiles(o: Record<string, unknown>, k: string, slotBytes: number, max: number): SmallResult[] {
  const out: SmallResult[] = [];
  let end = 0;
  for (const x of arr(o, k, max)) {
    const path = str(x, "path");
    if (typeof x.code === "string") {
      out.push({ path, code: x.code, message: str(x, "message") });
      continue;
    }
    const f: SmallFile = { path, size: int(x, "size", 0, slotBytes), mode: int(x, "mode", 0, 0o7777), mtimeMs: num(x, "mtimeMs", -1e15, 1e15), crc: int(x, "crc", 0, 0xffffffff), off: int(x, "off", 0, slotBytes) };
    if (f.off < end || f.off + f.size > slotBytes) throw new CopyError("PROTOCOL", `${k}: ${JSON.stringify(path)} at ${f.off}+${f.size} overlaps another file or leaves the slot`);
    end = f.off + f.size;
    out.push(f);
  }
  return out;
}

/**
 * A peer's listing (the answer to `list`), checked before anything is
 * created from it: well-formed entries, paths confined and normalised, the
 * listed path itself first, every other path once and after its parent
 * directory. (A listing that names `A/L` before `A`, or `A/L` twice, once as
 * a directory and once as a link, could otherwise make the receiver set a
 * directory's mode and times through a link it created.)
 */
export function checkListing(v: unknown, max: number): Entry[] {
  if (!Array.isArray(v) || v.length > max) throw new CopyError("PROTOCOL", `a listing must be a list of at most ${max} entries`);
  const seen = new Map<string, EntryType>();
  const out: Entry[] = [];
  for (const x of v as unknown[]) {
    if (x === null || typeof x !== "object") throw new CopyError("PROTOCOL", "a listing's entries must be objects");
    const o = x as Record<string, unknown>;
    const path = checkRel(o.path);
    const type = o.type;
    if (type !== "file" && type !== "dir" && type !== "symlink") throw new CopyError("PROTOCOL", `${JSON.stringify(path)}: unknown entry type ${JSON.stringify(type)}`);
    if (seen.has(path)) throw new CopyError("PROTOCOL", `the listing names ${JSON.stringify(path || ".")} twice`);
    if (out.length === 0 ? path !== "" : path === "") throw new CopyError("PROTOCOL", "a listing starts with the listed path itself, and only there");
    if (path !== "") {
      const parent = posix.dirname(path);
      if (seen.get(parent === "." ? "" : parent) !== "dir") throw new CopyError("PROTOCOL", `the listing names ${JSON.stringify(path)} before its parent directory`);
    }
    seen.set(path, type);
    const e: Entry = { path, type, size: type === "file" ? int(o, "size") : 0, mode: int(o, "mode", 0, 0o7777), mtimeMs: num(o, "mtimeMs", -1e15, 1e15) };
    if (type === "symlink") e.target = str(o, "target");
    out.push(e);
  }
  return out;
}

/** An error as a Result (for the per-file answers of batch calls). */
export function failure(e: unknown): { ok: false; code: string; message: string } {
  const code = typeof (e as { code?: unknown })?.code === "string" ? (e as { code: string }).code : "ERROR";
  return { ok: false, code, message: e instanceof Error ? e.message : String(e) };
}
