/**
 * The order of a copy, the same both ways: directories, the --resume quick
 * check, small files in batches (a batch fills at most one slot of the
 * ring), large files, links last (no file of this copy is ever written
 * through a link it created), directory times. A file's failure is
 * recorded and the copy goes on; a lost connection ends it. Also what both
 * directions share: the items of a plan and --resume's comparisons.
 */
import { CopyError } from "./paths.js";
import { mapLimit } from "./tree.js";
import type { Entry, Result } from "./protocol.js";
import type { Progress } from "./progress.js";
import { codeOf, fatal, lost, msgOf, type Session } from "./cp-session.js";

/** Files up to this size travel inline in batches. */
const SMALL = 256 * 1024;
const BATCH_FILES = 1024;

/** First index where the two CRC lists differ (the verified prefix, in chunks). */
export function agree(a: readonly number[], b: readonly number[]): number {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return i;
}

export interface Item {
  /** Where the data is read: local absolute path (upload) or remote relative path (download). */
  from: string;
  /** Where it goes: remote relative path (upload) or local absolute path (download). */
  to: string;
  entry: Entry;
  /** Downloads: the local directory or file the server's tree lands in, and the entry's path below it. */
  base?: string;
  rel?: string;
}

/** The names and types at the top of a listing (its own entry and temporary files left out). */
export function topLevel(entries: readonly Entry[]): Map<string, string> {
  return new Map(entries.filter((e) => e.path !== "" && !e.path.includes("/")).map((e) => [e.path, e.type]));
}

/**
 * --resume with one directory source into an existing directory `dest`
 * that holds nothing named after the source: is `dest` the copy an earlier
 * run made when it did not exist yet (`cp -r tree dest` makes `dest` the
 * copy of `tree` when `dest` is new, `dest/tree` when it exists)? It is when
 * everything at its top is also at the source's top, with the same type.
 * An empty directory is not: the copy goes into it, as without --resume.
 */
export function earlierCopy(dest: Map<string, string>, src: Map<string, string>): boolean {
  if (dest.size === 0) return false;
  for (const [name, type] of dest) if (src.get(name) !== type) return false;
  return true;
}

/** A file copied whole. */
export function done(p: Progress, i: Item): void {
  p.files++;
  p.add(i.entry.size);
}

/** The per-item results of a reply (PROTOCOL when missing). */
export function resultsOf(o: Record<string, unknown>): Result[] {
  const r = o.results;
  if (!Array.isArray(r)) throw new CopyError("PROTOCOL", "results missing");
  return r as Result[];
}

/** What each direction does for each step of the copy. */
export interface Ends {
  mkdirs(dirs: Item[], times: boolean): Promise<Result[]>;
  links(links: Item[]): Promise<Result[]>;
  same(files: Item[]): Promise<boolean[]>;
  small(batch: Item[]): Promise<void>;
  big(i: Item): Promise<void>;
}

/** The order of a copy, the same both ways: directories, quick check, small files in batches, large files, links, directory times. */
export async function transferTree(s: Session, items: Item[], ends: Ends): Promise<void> {
  const p = s.p;
  const dirs = items.filter((i) => i.entry.type === "dir");
  const links = items.filter((i) => i.entry.type === "symlink");
  let files = items.filter((i) => i.entry.type === "file");
  p.total = files.reduce((a, i) => a + i.entry.size, 0);
  const report = (list: Item[], r: Result[]): void =>
    r.forEach((x, k) => {
      if (!x.ok) p.fail(list[k]!.to, x.code, x.message);
    });
  if (dirs.length > 0) report(dirs, await ends.mkdirs(dirs, false));
  if (s.opts.resume && files.length > 0) {
    const same = await ends.same(files);
    files = files.filter((i, k) => {
      if (!same[k]) return true;
      p.skipped += i.entry.size;
      p.filesSkipped++;
      return false;
    });
  }
  // a batch fills at most one slot of the ring
  const limit = Math.min(SMALL, s.chunk);
  const small = files.filter((i) => i.entry.size <= limit);
  const big = files.filter((i) => i.entry.size > limit);
  const batches: Item[][] = [];
  let cur: Item[] = [];
  let bytes = 0;
  for (const i of small) {
    if (cur.length >= BATCH_FILES || (cur.length > 0 && bytes + i.entry.size > s.chunk)) {
      batches.push(cur);
      cur = [];
      bytes = 0;
    }
    cur.push(i);
    bytes += i.entry.size;
  }
  if (cur.length > 0) batches.push(cur);
  await mapLimit(batches, s.depth, async (b) => {
    try {
      await ends.small(b);
    } catch (e) {
      if (fatal(e) || s.rdma.isClosed) throw lost(s.rdma, e);
      for (const i of b) p.fail(i.to, codeOf(e), msgOf(e));
    }
  });
  for (const i of big) {
    try {
      await ends.big(i);
    } catch (e) {
      if (fatal(e) || s.rdma.isClosed) throw lost(s.rdma, e);
      p.fail(i.to, codeOf(e), msgOf(e));
    }
  }
  // links last: no file of this copy is ever written through a link it created
  // (a hostile server listing `a -> /etc` and then `a/passwd`)
  if (links.length > 0) report(links, await ends.links(links));
  if (dirs.length > 0) report(dirs, await ends.mkdirs([...dirs].reverse(), true));
  p.tick(true);
}
