/**
 * The cp protocol's codecs and the receiver's rules, in-process: each binary
 * message kind round-trips and refuses what is malformed, a slot's list of
 * small files is checked; peer paths are
 * confined; a chunk with a wrong CRC, a digest that differs or a missing
 * chunk never reaches the final name.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, realpathSync, rmSync, statSync, symlinkSync, utimesSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { crc32 } from "node:zlib";
import { randomBytes } from "node:crypto";
import { checkLinkTarget, checkRel, resolveInsideSync } from "../../src/cli/copy/paths.js";
import { checkListing, decodeGet, decodePut, encodeGet, encodePut, smallFiles } from "../../src/cli/copy/protocol.js";
import { setTimes } from "../../src/cli/copy/tree.js";
import { chunkStateBytes, fileDigest, StateBudget } from "../../src/cli/copy/chunks.js";
import { directShift } from "../../src/cli/copy/direct-io.js";
import { FileSink, tempName } from "../../src/cli/copy/files.js";
import { parseRemote } from "../../src/cli/copy/cp.js";

describe("cp protocol and receiver rules", () => {
  it("a peer's claimed file size larger than the space free at the destination is refused (ENOSPC) before anything is held or created (issue 19 point 8)", async () => {
    const dir = mkdtempSync(join(tmpdir(), "ardma-cp-claim-"));
    try {
      const abs = join(dir, "huge");
      await assert.rejects(FileSink.open(abs, { size: 2 ** 52, mode: 0o644, mtimeMs: 0 }, 1 << 20, false), (e: Error & { code?: string }) => {
        assert.equal(e.code, "ENOSPC", e.message);
        assert.match(e.message, /does not fit in the space free at the destination/);
        return true;
      });
      assert.equal(existsSync(tempName(abs)), false, "no temporary file for a refused claim");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("issue 19 point 8: per-chunk state is charged to a connection's budget and the process's, and given back when the file ends", async () => {
    const dir = mkdtempSync(join(tmpdir(), "ardma-cp-budget-"));
    try {
      const all = new StateBudget(3000);
      const a = new StateBudget(2000, all);
      const b = new StateBudget(2000, all);
      const meta = { size: 400 * 4096, mode: 0o644, mtimeMs: 0 }; // 400 chunks: 1600 + 50 bytes
      assert.equal(chunkStateBytes(meta.size, 4096), 1650);
      const s1 = await FileSink.open(join(dir, "a1"), meta, 4096, false, true, false, a);
      assert.equal(a.used, 1650);
      await assert.rejects(FileSink.open(join(dir, "a2"), meta, 4096, false, true, false, a), { code: "EFBIG" });
      assert.equal(existsSync(tempName(join(dir, "a2"))), false, "nothing created for a refused claim");
      await assert.rejects(FileSink.open(join(dir, "b1"), meta, 4096, false, true, false, b), { code: "EBUSY" });
      assert.equal(b.used, 0);
      assert.equal(all.used, 1650);
      await s1.abort();
      assert.equal(all.used, 0);
      const s2 = await FileSink.open(join(dir, "b1"), meta, 4096, false, true, false, b);
      assert.equal(all.used, 1650);
      await s2.abort();
      assert.equal(all.used, 0);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("put and get round-trip and refuse a wrong length", () => {
    assert.deepEqual(decodePut(encodePut(7, 3, 2 ** 40, 65536, 0xdeadbeef)), { id: 7, slot: 3, off: 2 ** 40, len: 65536, crc: 0xdeadbeef });
    assert.deepEqual(decodeGet(encodeGet(9, 1, 4096, 100)), { id: 9, slot: 1, off: 4096, len: 100 });
    assert.throws(() => decodePut(new Uint8Array(23)), { code: "PROTOCOL" });
    assert.throws(() => decodeGet(new Uint8Array(21)), { code: "PROTOCOL" });
  });

  it("a slot's small files: inside the slot, in order, never overlapping; errors pass through", () => {
    const ok = { path: "a", size: 3, mode: 0o644, mtimeMs: 1000.5, crc: crc32("abc"), off: 0 };
    const list = smallFiles({ files: [ok, { path: "gone", code: "ENOENT", message: "no" }, { ...ok, path: "b", off: 3, size: 5 }] }, "files", 8, 10);
    assert.equal(list.length, 3);
    assert.deepEqual(list[0], ok);
    assert.deepEqual(list[1], { path: "gone", code: "ENOENT", message: "no" });
    assert.throws(() => smallFiles({ files: [{ ...ok, off: 6 }] }, "files", 8, 10), { code: "PROTOCOL" }); // leaves the slot
    assert.throws(() => smallFiles({ files: [ok, { ...ok, off: 2 }] }, "files", 8, 10), { code: "PROTOCOL" }); // overlaps
    assert.throws(() => smallFiles({ files: [ok, ok] }, "files", 8, 1), { code: "PROTOCOL" }); // too many
    assert.throws(() => smallFiles({ files: [{ ...ok, size: -1 }] }, "files", 8, 10), { code: "PROTOCOL" });
    assert.throws(() => smallFiles({ files: [{ ...ok, path: 5 }] }, "files", 8, 10), { code: "PROTOCOL" });
    assert.throws(() => smallFiles({ files: "x" }, "files", 8, 10), { code: "PROTOCOL" });
  });

  it("peer paths: relative, no '..', no absolute; link targets stay inside", () => {
    assert.equal(checkRel("a/./b//c/"), "a/b/c");
    assert.equal(checkRel(""), "");
    for (const bad of ["..", "a/../b", "/etc/passwd", "a/\0b", "../x"]) assert.throws(() => checkRel(bad), { code: "ESCAPE" }, bad);
    assert.throws(() => checkRel(5), { code: "PROTOCOL" });
    checkLinkTarget("d/l", "../x");
    checkLinkTarget("l", "d/e");
    assert.throws(() => checkLinkTarget("d/l", "../../x"), { code: "ESCAPE" });
    assert.throws(() => checkLinkTarget("l", "/etc"), { code: "ESCAPE" });
  });

  it("issue 19 point 1: a link target is judged where the kernel resolves it: no '..' after a name, climbs counted from the link's real directory", () => {
    // `up -> .` makes `up/../victim` leave the tree, though it reads as inside
    assert.throws(() => checkLinkTarget("esc", "up/../victim"), { code: "ESCAPE" });
    assert.throws(() => checkLinkTarget("d/l", "x/../../y"), { code: "ESCAPE" });
    // `up/esc2` whose real directory is the root (up -> .): one climb leaves the tree
    assert.throws(() => checkLinkTarget("up/esc2", "../victim", "/srv/t", "/srv/t"), { code: "ESCAPE" });
    checkLinkTarget("up/esc2", "../victim", "/srv/t", "/srv/t/a");
    checkLinkTarget("d/l", "../../d/x", "/srv/t", "/srv/t/a/b");
    checkLinkTarget("l", "./a/./b");
  });

  it("issue 19 points 1 and 2: a directory's mode and times are set through the directory itself, never through a link", async () => {
    const dir = mkdtempSync(join(tmpdir(), "ardma-settimes-"));
    try {
      const victim = join(dir, "victim");
      mkdirSync(victim, { mode: 0o700 });
      utimesSync(victim, 1_000_000, 1_000_000);
      symlinkSync(victim, join(dir, "link"));
      // O_NOFOLLOW | O_DIRECTORY on a link: Linux says ENOTDIR (ELOOP elsewhere)
      await assert.rejects(setTimes(join(dir, "link"), 0o6777, 0), (e: Error & { code?: string }) => (assert.match(String(e.code), /^(ELOOP|ENOTDIR)$/, e.message), true));
      const st = statSync(victim);
      assert.equal(st.mode & 0o7777, 0o700);
      assert.equal(st.mtimeMs, 1_000_000_000);
      await setTimes(victim, 0o750, 2_000_000_000);
      assert.equal(statSync(victim).mode & 0o7777, 0o750);
      assert.equal(statSync(victim).mtimeMs, 2_000_000_000);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("issue 19 point 2: a listing is refused when a path comes twice, before its parent, or under a non-directory", () => {
    const d = (path: string) => ({ path, type: "dir", size: 0, mode: 0o755, mtimeMs: 0 });
    const l = (path: string) => ({ path, type: "symlink", size: 0, mode: 0o777, mtimeMs: 0, target: "/x" });
    assert.equal(checkListing([d(""), d("A"), d("A/L"), l("A/M")], 10).length, 4);
    for (const bad of [
      [d(""), d("A/L"), d("A"), l("A/L")],
      [d(""), d("A"), d("A/L"), l("A/./L")],
      [d(""), l("A"), d("A/L")],
      [d("A")],
      [d(""), d("")],
      [d(""), { ...d("A"), type: "fifo" }],
      [d(""), { ...l("A"), target: 5 }],
      [d(""), d("../A")],
    ])
      assert.throws(() => checkListing(bad, 10), (e: Error & { code?: string }) => (assert.match(String(e.code), /^(PROTOCOL|ESCAPE)$/, e.message), true), JSON.stringify(bad));
    assert.throws(() => checkListing([d(""), d("a"), d("b")], 2), { code: "PROTOCOL" });
  });

  it("resolveInsideSync refuses a parent that leads outside through a symlink (a link left by an earlier copy)", () => {
    const dir = mkdtempSync(join(tmpdir(), "ardma-inside-"));
    try {
      mkdirSync(join(dir, "root", "d"), { recursive: true });
      mkdirSync(join(dir, "outside"));
      symlinkSync(join(dir, "outside"), join(dir, "root", "out"));
      symlinkSync("d", join(dir, "root", "in"));
      const root = realpathSync(join(dir, "root"));
      const cache = new Map<string, string>();
      assert.throws(() => resolveInsideSync(root, "out/passwd", cache), { code: "ESCAPE" });
      assert.equal(resolveInsideSync(root, "in/x", cache), join(root, "d", "x"));
      assert.equal(resolveInsideSync(root, "out", cache), join(root, "out"), "the last component is not followed");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("remote paths in scp syntax", () => {
    assert.deepEqual(parseRemote("host:a/b"), { host: "host", port: 7471, path: "a/b" });
    assert.deepEqual(parseRemote("host:9000:a"), { host: "host", port: 9000, path: "a" });
    assert.deepEqual(parseRemote("host:"), { host: "host", port: 7471, path: "" });
    assert.deepEqual(parseRemote("[::1]:9000:x"), { host: "::1", port: 9000, path: "x" });
    assert.equal(parseRemote("./a:b"), null);
    assert.equal(parseRemote("/abs:x"), null);
    assert.equal(parseRemote("plain"), null);
    assert.equal(parseRemote("dir/a:b"), null);
  });

  it("a FileSink writes nothing under the final name until verified, flushed and renamed", async () => {
    const dir = mkdtempSync(join(tmpdir(), "ardma-sink-"));
    try {
      const final = join(dir, "f");
      const data = new Uint8Array(randomBytes(10_000));
      const meta = { size: data.length, mode: 0o640, mtimeMs: 1_234_567_000 };
      const sink = await FileSink.open(final, meta, 4096, false);
      await assert.rejects(sink.write(0, data.subarray(0, 4096), crc32(data.subarray(0, 4096)) ^ 1), { code: "CHECKSUM" });
      await sink.write(0, data.subarray(0, 4096), crc32(data.subarray(0, 4096)));
      await sink.write(8192, data.subarray(8192), crc32(data.subarray(8192)));
      await assert.rejects(sink.write(100, data.subarray(100, 200), 0), { code: "PROTOCOL" }); // not a chunk boundary
      await assert.rejects(sink.finish("x"), { code: "PROTOCOL" }); // chunk 1 missing
      assert.equal(existsSync(final), false);
      await sink.write(4096, data.subarray(4096, 8192), crc32(data.subarray(4096, 8192)));
      const crcs = [0, 4096, 8192].map((o) => crc32(data.subarray(o, o + 4096)));
      await assert.rejects(sink.finish(fileDigest(meta.size, [crcs[1]!, crcs[0]!, crcs[2]!])), { code: "CHECKSUM" });
      assert.equal(existsSync(final), false);
      assert.ok(existsSync(tempName(final)), "the temporary file is kept");
      // resume: the kept file's chunks are offered, the agreed prefix accepted
      const again = await FileSink.open(final, meta, 4096, true);
      assert.deepEqual(again.existing, crcs);
      assert.equal(again.accept(3), data.length);
      await again.finish(fileDigest(meta.size, crcs));
      assert.deepEqual(new Uint8Array(readFileSync(final)), data);
      assert.equal(existsSync(tempName(final)), false);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("a FileSink with direct I/O: aligned chunks bypass the page cache, a tail or a misaligned buffer does not, the file is the same", async () => {
    const dir = mkdtempSync(join(tmpdir(), "ardma-direct-"));
    try {
      const chunk = 64 * 1024;
      // larger than glibc's largest mmap threshold (32 MiB): a mapping of its own, found by pageOffset
      const ring = new Uint8Array(new ArrayBuffer(33 * 1024 * 1024));
      const at = directShift(ring, dir);
      const data = new Uint8Array(randomBytes(3 * chunk + 1000));
      const final = join(dir, "f");
      const meta = { size: data.length, mode: 0o600, mtimeMs: 1_234_567_000 };
      const sink = await FileSink.open(final, meta, chunk, false, true, at !== null);
      const base = at ?? 0;
      const crcs: number[] = [];
      for (let k = 0; k < 4; k++) {
        const part = data.subarray(k * chunk, Math.min(data.length, (k + 1) * chunk));
        // chunk 2 from a buffer one byte off: refused by O_DIRECT, written through the page cache
        // (as is everything after it, and the tail, which is not a whole block)
        const slot = k === 2 ? base + chunk + 1 : base + k * chunk;
        ring.set(part, slot);
        crcs[k] = crc32(part);
        await sink.write(k * chunk, ring.subarray(slot, slot + part.length), crcs[k]!);
      }
      await sink.finish(fileDigest(meta.size, crcs));
      assert.deepEqual(new Uint8Array(readFileSync(final)), data);
      // where the file system takes O_DIRECT (not tmpfs before Linux 6.6), the aligned whole chunks went that way
      if (at !== null) assert.equal(sink.directBytes, 2 * chunk);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
