/**
 * async-rdma cp and serve: what is refused and what a failure leaves behind
 * (escapes from the served tree, a read-only server, a wrong key,
 * permissions, a full disk).
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { execFileSync } from "node:child_process";
import { appendFileSync, chmodSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, readlinkSync, rmSync, statSync, symlinkSync, utimesSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cp, cpStopped, DEADLINE, HOST, PROVIDER, run, serve, type Server } from "../support/cp.js";

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

describe(`async-rdma cp / serve: safety [${PROVIDER}]`, { timeout: 10 * DEADLINE }, () => {
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
    chmodSync(join(base, "good"), 0o600);
    chmodSync(join(base, "bad"), 0o600);
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
      // The disk fills during the copy: a file that fits (192 KiB of 256 KiB) when it starts,
      // then something else takes most of the space (160 KiB) after its first chunk.
      writeFileSync(join(base, "big"), randomBytes(192 * 1024));
      const s = await start(root);
      const c = await cpStopped(["--chunk", String(CHUNK), "--depth", "1", join(base, "big"), s.at("big")], CHUNK);
      writeFileSync(join(root, "filler"), randomBytes(160 * 1024));
      process.kill(c.proc.pid, "SIGCONT");
      const r = await c.finish();
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

  it("issue 19 point 18: serve without options serves read-only, on this machine only, and says what it exposes", async () => {
    const base = mk("p18");
    const root = join(base, "served");
    mkdirSync(root);
    writeFileSync(join(root, "f"), "f\n");
    writeFileSync(join(base, "up"), "up\n");
    const p = run(["serve", root, "-p", "0"], { side: 0 });
    try {
      const m = await p.waitFor(/ on (\S+):(\d+)\n(.*)\n/);
      assert.equal(m[1], "127.0.0.1", "bound to the loopback address");
      assert.match(m[3]!, /read-only/);
      assert.match(m[3]!, /authentication off/);
      assert.match(m[3]!, /this machine only/);
      if (HOST === "127.0.0.1") {
        const at = `127.0.0.1:${m[2]}:`;
        const up = await cp([join(base, "up"), `${at}g`]);
        assert.notEqual(up.code, 0);
        assert.equal(up.errors[0]?.code, "EROFS", JSON.stringify(up.errors));
        assert.equal(existsSync(join(root, "g")), false);
        const down = await cp([`${at}f`, join(base, "got")]);
        assert.equal(down.code, 0, down.err + down.out);
      }
    } finally {
      p.kill();
    }
    const w = run(["serve", root, "-p", "0", "--writable"], { side: 0 });
    try {
      const m = await w.waitFor(/ on (\S+):(\d+)\n(.*)\n/);
      assert.match(m[3]!, /^  writable/);
    } finally {
      w.kill();
    }
  });

  it("issue 19 point 13: a key file others can read is refused by cp and serve, as ssh does", async () => {
    const base = mk("p13-key");
    const root = join(base, "served");
    mkdirSync(root);
    const key = join(base, "key");
    writeFileSync(key, randomBytes(24).toString("hex") + "\n");
    writeFileSync(join(base, "f"), "f\n");
    for (const mode of [0o644, 0o640, 0o604]) {
      chmodSync(key, mode);
      const sv = run(["serve", root, "-p", "0", "--auth-key-file", key], { side: 0 });
      assert.equal(await sv.exited(), 2, sv.out() + sv.err());
      assert.match(sv.err(), /accessible by others.*chmod 600/);
      const c = run(["cp", "--auth-key-file", key, join(base, "f"), "127.0.0.1:1:x"]);
      assert.equal(await c.exited(), 2, c.out() + c.err());
      assert.match(c.err(), /accessible by others.*chmod 600/);
    }
    chmodSync(key, 0o600);
    const s = await start(root, ["--auth-key-file", key]);
    const good = await cp(["--auth-key-file", key, join(base, "f"), s.at()]);
    assert.equal(good.code, 0, good.err + good.out);
  });
});
