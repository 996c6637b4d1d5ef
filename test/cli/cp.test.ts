/**
 * async-rdma cp and serve as two processes: copies both ways, the safety
 * guarantees (temporary names, escapes refused, full disk, permissions, a
 * peer killed mid-copy, a changed source, a wrong key) and resume.
 * Small files only: speed is for bench/cp-vs-rsync.sh.
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

describe(`async-rdma cp / serve [${PROVIDER}]`, { timeout: 10 * DEADLINE }, () => {
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

  it("refuses '..', absolute paths and symlinks that leave the served tree; nothing outside is read or written", async () => {
    const base = mk("escape");
    const root = join(base, "served");
    const outside = join(base, "outside");
    mkdirSync(join(root, "d"), { recursive: true });
    mkdirSync(outside);
    writeFileSync(join(outside, "secret"), "secret\n");
    symlinkSync(outside, join(root, "d", "out-dir"));
    symlinkSync(join(outside, "secret"), join(root, "d", "out-file"));
    const s = await start(root);
    const local = join(base, "local");
    mkdirSync(local);
    writeFileSync(join(local, "x"), "x\n");
    for (const path of ["../outside/secret", "d/../../outside/secret", "/etc/passwd", "d/out-dir/secret"]) {
      const r = await cp([s.at(path), join(local, "got")]);
      assert.notEqual(r.code, 0, path);
      assert.equal(r.errors[0]?.code, "ESCAPE", `${path}: ${JSON.stringify(r.errors)}`);
      assert.equal(existsSync(join(local, "got")), false);
    }
    for (const path of ["../outside/planted", "/tmp/planted", "d/out-dir/planted"]) {
      const r = await cp([join(local, "x"), s.at(path)]);
      assert.notEqual(r.code, 0, path);
      assert.equal(r.errors[0]?.code, "ESCAPE", `${path}: ${JSON.stringify(r.errors)}`);
    }
    assert.deepEqual(readdirSync(outside), ["secret"]);
    // a link inside the tree is copied as a link, never followed
    const r = await cp(["-r", s.at("d"), join(local, "d")]);
    assert.equal(r.code, 0, r.err + r.out);
    assert.equal(readlinkSync(join(local, "d", "out-file")), join(outside, "secret"));
    assert.ok(lstatSync(join(local, "d", "out-dir")).isSymbolicLink());
    // an uploaded link whose target leaves the tree is refused
    const linkSrc = join(base, "links");
    mkdirSync(linkSrc);
    symlinkSync("../../outside/secret", join(linkSrc, "climb"));
    symlinkSync("ok-target", join(linkSrc, "fine"));
    const r3 = await cp(["-r", linkSrc, s.at()]);
    assert.notEqual(r3.code, 0);
    assert.deepEqual(r3.errors.map((e) => e.code), ["ESCAPE"]);
    assert.equal(existsSync(join(root, "links", "climb")), false);
    assert.equal(readlinkSync(join(root, "links", "fine")), "ok-target");
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

  it("a read-only server serves downloads and refuses uploads", { skip: tcpOnly }, async () => {
    const base = mk("ro");
    const root = join(base, "served");
    mkdirSync(root);
    writeFileSync(join(root, "f"), "f\n");
    const s = await start(root, ["--read-only"]);
    const r = await cp([s.at("f"), join(base, "f")]);
    assert.equal(r.code, 0, r.err);
    const r2 = await cp([join(base, "f"), s.at("g")]);
    assert.notEqual(r2.code, 0);
    assert.equal(r2.errors[0]?.code, "EROFS");
    assert.deepEqual(readdirSync(root), ["f"]);
  });

  it("a wrong auth key is refused; the right one works", { skip: tcpOnly }, async () => {
    const base = mk("auth");
    const root = join(base, "served");
    mkdirSync(root);
    writeFileSync(join(base, "good"), randomBytes(24).toString("hex") + "\n");
    writeFileSync(join(base, "bad"), randomBytes(24).toString("hex") + "\n");
    writeFileSync(join(base, "f"), "f\n");
    const s = await start(root, ["--auth-key-file", join(base, "good")]);
    const bad = await cp(["--auth-key-file", join(base, "bad"), join(base, "f"), s.at()]);
    assert.notEqual(bad.code, 0);
    assert.equal(bad.errors[0]?.code, "AUTH_FAILED");
    const none = await cp([join(base, "f"), s.at()]);
    assert.notEqual(none.code, 0);
    const good = await cp(["--auth-key-file", join(base, "good"), join(base, "f"), s.at()]);
    assert.equal(good.code, 0, good.err);
    assert.deepEqual(readdirSync(root), ["f"]);
  });

  it("permission denied: clear errors, nothing written (server runs as nobody)", { skip: tcpOnly || (isRoot ? false : "needs root to run the server as another user") }, async () => {
    const base = mk("perm");
    chmodSync(base, 0o755);
    const root = join(base, "served");
    mkdirSync(join(root, "locked"), { recursive: true });
    chmodSync(root, 0o755);
    chmodSync(join(root, "locked"), 0o755); // owned by root: nobody cannot write here
    writeFileSync(join(root, "private"), "private\n");
    chmodSync(join(root, "private"), 0o600);
    writeFileSync(join(base, "f"), "f\n");
    const s = await serve(root, [], { uid: 65534, gid: 65534 });
    servers.push(s);
    const up = await cp([join(base, "f"), s.at("locked/f")]);
    assert.notEqual(up.code, 0);
    assert.equal(up.errors[0]?.code, "EACCES", JSON.stringify(up.errors));
    assert.match(String(up.errors[0]?.message), /permission denied/);
    assert.deepEqual(readdirSync(join(root, "locked")), []);
    const down = await cp([s.at("private"), join(base, "got")]);
    assert.notEqual(down.code, 0);
    assert.equal(down.errors[0]?.code, "EACCES");
    assert.equal(existsSync(join(base, "got")), false);
  });

  it("a full disk fails the file with ENOSPC, keeps the temporary file for --resume, and nothing under the final name", { skip: tcpOnly || (isRoot ? false : "needs root to mount a small tmpfs") }, async (t) => {
    const base = mk("full");
    const root = join(base, "served");
    mkdirSync(root);
    try {
      execFileSync("mount", ["-t", "tmpfs", "-o", "size=256k", "tmpfs", root]);
    } catch (e) {
      t.skip(`cannot mount a tmpfs here: ${(e as Error).message}`);
      return;
    }
    try {
      writeFileSync(join(base, "big"), randomBytes(1024 * 1024));
      const s = await start(root);
      const r = await cp(["--chunk", String(CHUNK), join(base, "big"), s.at("big")]);
      assert.notEqual(r.code, 0);
      assert.equal(r.errors[0]?.code, "ENOSPC", JSON.stringify(r.errors));
      assert.match(String(r.errors[0]?.message), /no space left/);
      assert.equal(existsSync(join(root, "big")), false);
      assert.ok(existsSync(join(root, ".big.rdma-part")), "the temporary file is kept");
      s.kill();
      await s.exited();
    } finally {
      execFileSync("umount", ["-l", root]);
    }
  });

  it("the server killed mid-upload: cp fails within a bounded time, --resume transfers only the rest", async () => {
    const base = mk("kill-server");
    const root = join(base, "served");
    mkdirSync(root);
    const data = randomBytes(40 * CHUNK + 5);
    writeFileSync(join(base, "f"), data);
    const s1 = await start(root);
    const args = ["--chunk", String(CHUNK), "--depth", "2", join(base, "f"), s1.at("f")];
    const c = await cpStopped(args, 4 * CHUNK);
    s1.kill("SIGKILL");
    await s1.exited();
    process.kill(c.proc.pid, "SIGCONT");
    const r = await c.finish();
    assert.notEqual(r.code, 0, "cp fails when its server dies");
    assert.match(String(r.errors[0]?.message), /--resume/);
    assert.equal(existsSync(join(root, "f")), false, "nothing under the final name");
    assert.ok(statSync(join(root, ".f.rdma-part")).size >= 4 * CHUNK);
    const s2 = await start(root);
    const r2 = await cp(["--resume", ...args.slice(0, -1), s2.at("f")]);
    assert.equal(r2.code, 0, r2.err + r2.out);
    assert.ok(Number(r2.result?.skipped) >= 4 * CHUNK, `skipped ${String(r2.result?.skipped)}`);
    assert.equal(Number(r2.result?.skipped) + Number(r2.result?.bytes), data.length);
    assert.deepEqual(readFileSync(join(root, "f")), data);
    noTemps(root);
  });

  it("the client killed mid-download: --resume continues from the verified prefix (a corrupted chunk is sent again)", async () => {
    const base = mk("kill-client");
    const root = join(base, "served");
    mkdirSync(root);
    const data = randomBytes(40 * CHUNK + 77);
    writeFileSync(join(root, "f"), data);
    const s = await start(root);
    const args = ["--chunk", String(CHUNK), "--depth", "2", s.at("f"), join(base, "f")];
    const c = await cpStopped(args, 6 * CHUNK);
    c.proc.kill("SIGKILL");
    await c.finish();
    assert.equal(existsSync(join(base, "f")), false);
    const part = join(base, ".f.rdma-part");
    assert.ok(statSync(part).size >= 6 * CHUNK);
    // corrupt chunk 3 of the kept file: resume must trust only chunks 0..2
    const bytes = readFileSync(part);
    bytes[3 * CHUNK + 10] = bytes[3 * CHUNK + 10]! ^ 0xff;
    writeFileSync(part, bytes);
    const r = await cp(["--resume", ...args]);
    assert.equal(r.code, 0, r.err + r.out);
    assert.equal(r.result?.skipped, 3 * CHUNK);
    assert.deepEqual(readFileSync(join(base, "f")), data);
    // rerunning the finished copy transfers nothing
    const again = await cp(["--resume", ...args]);
    assert.equal(again.code, 0);
    assert.equal(again.result?.bytes, 0);
    assert.equal(again.result?.filesSkipped, 1);
  });

  it("a source that changes during the copy is detected and reported; nothing under the final name", { skip: tcpOnly }, async () => {
    const base = mk("changed");
    const root = join(base, "served");
    mkdirSync(root);
    writeFileSync(join(base, "f"), randomBytes(20 * CHUNK));
    const s = await start(root);
    const c = await cpStopped(["--chunk", String(CHUNK), "--depth", "2", join(base, "f"), s.at("f")], 2 * CHUNK);
    appendFileSync(join(base, "f"), "more");
    process.kill(c.proc.pid, "SIGCONT");
    const r = await c.finish();
    assert.notEqual(r.code, 0);
    assert.equal(r.errors[0]?.code, "SOURCE_CHANGED", JSON.stringify(r.errors));
    assert.equal(existsSync(join(root, "f")), false);
    // the download direction: the server's file changes
    writeFileSync(join(root, "g"), randomBytes(20 * CHUNK));
    const d = await cpStopped(["--chunk", String(CHUNK), "--depth", "2", s.at("g"), join(base, "g")], 2 * CHUNK);
    appendFileSync(join(root, "g"), "more");
    process.kill(d.proc.pid, "SIGCONT");
    const r2 = await d.finish();
    assert.notEqual(r2.code, 0);
    assert.equal(r2.errors[0]?.code, "SOURCE_CHANGED", JSON.stringify(r2.errors));
    assert.equal(existsSync(join(base, "g")), false);
  });
});
