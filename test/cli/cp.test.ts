/**
 * async-rdma cp and serve as two processes: usage, copies both ways (tree,
 * modes, mtimes, links, no temporary files left), small files in batches,
 * destination kinds. Small files only: speed is for bench/cp-vs-rsync.sh.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { execFileSync } from "node:child_process";
import { appendFileSync, chmodSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, readlinkSync, rmSync, statSync, symlinkSync, utimesSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cp, cpStopped, DEADLINE, PROVIDER, run, serve, type Server } from "../support/cp.js";

const CHUNK = 64 * 1024;
const isRoot = process.getuid?.() === 0;
/** Tests that need root tricks or only repeat tcp-side logic run on tcp only. */
const tcpOnly = PROVIDER === "tcp" ? false : "checked on tcp (file-system logic, same on every provider)";

function tmp(name: string): string {
  return mkdtempSync(join(tmpdir(), `ardma-cp-${name}-`));
}

function tree(dir: string): Record<string, string> {
  const out: Record<string, string> = {};
  const walk = (d: string, rel: string): void => {
    for (const n of readdirSync(d).sort()) {
      const p = join(d, n);
      const r = rel ? `${rel}/${n}` : n;
      const st = lstatSync(p);
      if (st.isSymbolicLink()) out[r] = `link:${readlinkSync(p)}`;
      else if (st.isDirectory()) (out[r] = `dir:${(st.mode & 0o777).toString(8)}`), walk(p, r);
      else out[r] = `file:${(st.mode & 0o777).toString(8)}:${Math.trunc(st.mtimeMs / 1000)}:${readFileSync(p).toString("base64")}`;
    }
  };
  walk(dir, "");
  return out;
}

function noTemps(dir: string): void {
  const t = Object.keys(tree(dir)).filter((k) => k.endsWith(".rdma-part"));
  assert.deepEqual(t, [], "no temporary files are left behind");
}

function makeSource(root: string): string {
  const src = join(root, "data");
  mkdirSync(join(src, "sub", "deeper"), { recursive: true });
  writeFileSync(join(src, "empty"), "");
  writeFileSync(join(src, "small.txt"), "hello\n");
  writeFileSync(join(src, "sub", "three-chunks.bin"), randomBytes(3 * CHUNK + 123)); // a short last chunk
  writeFileSync(join(src, "sub", "deeper", "exact.bin"), randomBytes(2 * CHUNK));
  writeFileSync(join(src, "sub", "mid.bin"), randomBytes(100_000));
  chmodSync(join(src, "small.txt"), 0o640);
  chmodSync(join(src, "sub", "mid.bin"), 0o755);
  utimesSync(join(src, "small.txt"), 1_000_000, 1_000_000);
  symlinkSync("sub/mid.bin", join(src, "link-in"));
  return src;
}

describe(`async-rdma cp / serve: copies [${PROVIDER}]`, { timeout: 10 * DEADLINE }, () => {
  const servers: Server[] = [];
  const dirs: string[] = [];
  const start = async (dir: string, args: string[] = []): Promise<Server> => {
    const s = await serve(dir, args);
    servers.push(s);
    return s;
  };
  const mk = (n: string): string => {
    const d = tmp(n);
    dirs.push(d);
    return d;
  };
  after(() => {
    for (const s of servers) s.kill();
    for (const d of dirs) rmSync(d, { recursive: true, force: true });
  });

  it("--help prints usage on stdout and exits 0; a bad option is an error on stderr, exit 2", { skip: tcpOnly }, async () => {
    for (const cmd of ["cp", "serve"]) {
      const h = run([cmd, "--help"]);
      assert.equal(await h.exited(), 0);
      assert.match(h.out(), new RegExp(`^usage: async-rdma ${cmd}`));
      assert.equal(h.err(), "");
      const b = run([cmd, "--bogus"]);
      assert.equal(await b.exited(), 2);
      assert.equal(b.out(), "");
      assert.match(b.err(), /unknown option --bogus/);
    }
    const one = run(["cp", "only-one"]);
    assert.equal(await one.exited(), 2);
    assert.match(one.err(), /at least one source and a destination/);
  });

  it("uploads and downloads a tree (-r): contents, modes, mtimes and links kept, no temporary files left", async () => {
    const base = mk("tree");
    const src = makeSource(base);
    const up = join(base, "served");
    mkdirSync(up);
    const s = await start(up);
    const r1 = await cp(["-r", "--chunk", String(CHUNK), "--depth", "3", src, s.at()]);
    assert.equal(r1.code, 0, r1.err + r1.out);
    assert.deepEqual(tree(join(up, "data")), tree(src));
    assert.equal(r1.result?.files, 5);
    noTemps(up);
    const down = join(base, "down");
    mkdirSync(down);
    const r2 = await cp(["-r", "--chunk", String(CHUNK), s.at("data"), down]);
    assert.equal(r2.code, 0, r2.err + r2.out);
    assert.deepEqual(tree(join(down, "data")), tree(src));
    noTemps(down);
    // a single file to a new name, and the summary a person reads
    const named = run(["cp", join(src, "sub", "mid.bin"), s.at("renamed.bin")]);
    assert.equal(await named.exited(), 0, named.err());
    assert.match(named.out(), /^1 files, 97\.7 KiB in [\d.]+ s, [\d.]+ MB\/s\n$/);
    assert.doesNotMatch(named.err(), /\x1b|\r/, "no control codes when stderr is not a terminal");
    assert.deepEqual(readFileSync(join(up, "renamed.bin")), readFileSync(join(src, "sub", "mid.bin")));
  });

  it("many small files travel in batches, not one round trip each", { skip: tcpOnly }, async () => {
    const base = mk("small");
    const src = join(base, "many");
    mkdirSync(src);
    for (let i = 0; i < 400; i++) writeFileSync(join(src, `f${i}`), randomBytes(i % 7 === 0 ? 0 : 4096));
    const up = join(base, "served");
    mkdirSync(up);
    const s = await start(up);
    const r = await cp(["-r", src, s.at()]);
    assert.equal(r.code, 0, r.err + r.out);
    assert.deepEqual(tree(join(up, "many")), tree(src));
    assert.ok(Number(r.result?.calls) < 20, `400 files took ${String(r.result?.calls)} calls`);
    const down = join(base, "down");
    const r2 = await cp(["-r", s.at("many"), down]);
    assert.equal(r2.code, 0, r2.err + r2.out);
    assert.deepEqual(tree(down), tree(src));
    assert.ok(Number(r2.result?.calls) < 20, `400 files took ${String(r2.result?.calls)} calls down`);
  });

  it("destination kinds: a file where a directory is expected, a directory without -r, several sources to a file", { skip: tcpOnly }, async () => {
    const base = mk("kinds");
    const src = makeSource(base);
    const root = join(base, "served");
    mkdirSync(root);
    writeFileSync(join(root, "a-file"), "keep me\n");
    const s = await start(root);
    const r1 = await cp(["-r", src, s.at("a-file")]);
    assert.notEqual(r1.code, 0);
    assert.equal(r1.errors[0]?.code, "ENOTDIR");
    assert.match(String(r1.errors[0]?.message), /a directory is expected/);
    const r2 = await cp([src, s.at()]);
    assert.notEqual(r2.code, 0);
    assert.match(String(r2.errors[0]?.message), /is a directory \(use -r\)/);
    const r3 = await cp([join(src, "small.txt"), join(src, "empty"), s.at("a-file")]);
    assert.notEqual(r3.code, 0);
    assert.equal(r3.errors[0]?.code, "ENOTDIR");
    assert.equal(readFileSync(join(root, "a-file"), "utf8"), "keep me\n");
    // download side: a local file where a directory is expected
    const r4 = await cp(["-r", s.at(), join(src, "small.txt")]);
    assert.notEqual(r4.code, 0);
    assert.equal(r4.errors[0]?.code, "ENOTDIR");
  });

  it("issue 19 point 17: a remote symlink named on the command line is followed inside the tree, never copied as a dangling link", async () => {
    const base = mk("p17-links");
    const root = join(base, "served");
    mkdirSync(join(root, "dir"), { recursive: true });
    writeFileSync(join(root, "dir", "file"), "content\n");
    writeFileSync(join(base, "outside"), "outside\n");
    symlinkSync("dir/file", join(root, "link-f"));
    symlinkSync("dir", join(root, "link-d"));
    symlinkSync(join(base, "outside"), join(root, "esc"));
    const s = await start(root);
    const f = await cp([s.at("link-f"), join(base, "got")]);
    assert.equal(f.code, 0, f.err + f.out);
    assert.ok(lstatSync(join(base, "got")).isFile());
    assert.equal(readFileSync(join(base, "got"), "utf8"), "content\n");
    const d = await cp(["-r", s.at("link-d"), join(base, "gotd")]);
    assert.equal(d.code, 0, d.err + d.out);
    assert.ok(lstatSync(join(base, "gotd")).isDirectory());
    assert.equal(readFileSync(join(base, "gotd", "file"), "utf8"), "content\n");
    const e = await cp([s.at("esc"), join(base, "gotesc")]);
    assert.notEqual(e.code, 0);
    assert.equal(e.errors[0]?.code, "ESCAPE", JSON.stringify(e.errors));
    assert.equal(existsSync(join(base, "gotesc")), false);
    // and uploads, as docs/cp.md says: a local link named on the command line is followed
    symlinkSync(join(base, "got"), join(base, "local-link"));
    symlinkSync(join(base, "gotd"), join(base, "local-dlink"));
    const u = await cp(["-r", join(base, "local-link"), join(base, "local-dlink"), s.at("dir")]);
    assert.equal(u.code, 0, u.err + u.out);
    assert.ok(lstatSync(join(root, "dir", "local-link")).isFile());
    assert.equal(readFileSync(join(root, "dir", "local-dlink", "file"), "utf8"), "content\n");
  });

  it("issue 19 point 17: a trailing slash names a directory: a file is never created under that name", async () => {
    const base = mk("p17-slash");
    const root = join(base, "served");
    mkdirSync(join(root, "d"), { recursive: true });
    writeFileSync(join(root, "afile"), "keep\n");
    writeFileSync(join(base, "f"), "f\n");
    const s = await start(root);
    const r1 = await cp([join(base, "f"), s.at("missing-dir/")]);
    assert.notEqual(r1.code, 0);
    assert.equal(r1.errors[0]?.code, "ENOENT", JSON.stringify(r1.errors));
    assert.equal(existsSync(join(root, "missing-dir")), false);
    const r2 = await cp([join(base, "f"), s.at("afile/")]);
    assert.notEqual(r2.code, 0);
    assert.equal(r2.errors[0]?.code, "ENOTDIR", JSON.stringify(r2.errors));
    assert.equal(readFileSync(join(root, "afile"), "utf8"), "keep\n");
    const r3 = await cp([s.at("afile"), join(base, "missing-local") + "/"]);
    assert.notEqual(r3.code, 0);
    assert.equal(r3.errors[0]?.code, "ENOENT", JSON.stringify(r3.errors));
    assert.equal(existsSync(join(base, "missing-local")), false);
    const ok = await cp([join(base, "f"), s.at("d/")]);
    assert.equal(ok.code, 0, ok.err + ok.out);
    assert.equal(readFileSync(join(root, "d", "f"), "utf8"), "f\n");
  });
});
