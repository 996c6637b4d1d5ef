/**
 * async-rdma cp and serve: a peer killed mid-copy (bounded failure, nothing
 * under the final name, --resume sends only the rest), a corrupted kept
 * prefix, a source changed during the copy. A cp stops itself at a known
 * byte count (ASYNC_RDMA_CP_STOP_AFTER) so the kill never races the copy.
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

describe(`async-rdma cp / serve: peers killed, resume, changed sources [${PROVIDER}]`, { timeout: 10 * DEADLINE }, () => {
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
    // 4 chunks were acknowledged with 2 in flight: chunks may complete out of order, so the
    // verified contiguous prefix is at least 3 of them
    assert.ok(Number(r2.result?.skipped) >= 3 * CHUNK, `skipped ${String(r2.result?.skipped)}`);
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

  it("issue 19 point 17: --resume into a destination that did not exist continues on the rerun, both ways (no nested copy)", async () => {
    const base = mk("p17-new-dest");
    const src = join(base, "tree");
    mkdirSync(join(src, "sub"), { recursive: true });
    writeFileSync(join(src, "a.txt"), "a\n");
    writeFileSync(join(src, "sub", "big"), randomBytes(40 * CHUNK + 3));
    const root = join(base, "served");
    mkdirSync(root);
    const s = await start(root);
    const rerun = async (args: string[], dest: string, name: string): Promise<void> => {
      const c = await cpStopped(args, 4 * CHUNK);
      c.proc.kill();
      await c.finish();
      assert.ok(existsSync(join(dest, "sub")), `${name}: the first run made the new destination the copy of the tree`);
      const r = await cp(args);
      assert.equal(r.code, 0, r.err + r.out);
      assert.equal(existsSync(join(dest, "tree")), false, `${name}: the rerun nested the copy`);
      assert.ok(Number(r.result?.skipped) >= 3 * CHUNK, `${name}: skipped ${String(r.result?.skipped)}`);
      assert.deepEqual(tree(dest), tree(src));
      noTemps(dest);
      const again = await cp(args);
      assert.equal(again.code, 0, again.err + again.out);
      assert.equal(again.result?.bytes, 0, `${name}: a finished copy sends nothing again`);
      assert.equal(existsSync(join(dest, "tree")), false);
    };
    const opts = ["--resume", "-r", "--chunk", String(CHUNK), "--depth", "2"];
    await rerun([...opts, src, s.at("dest")], join(root, "dest"), "upload");
    await rerun([...opts, s.at("dest"), join(base, "down")], join(base, "down"), "download");
    // a destination that existed (and holds something else) still gets the copy inside it
    mkdirSync(join(base, "existing"));
    writeFileSync(join(base, "existing", "mine"), "mine\n");
    const r = await cp([...opts, s.at("dest"), join(base, "existing")]);
    assert.equal(r.code, 0, r.err + r.out);
    assert.deepEqual(tree(join(base, "existing", "dest")), tree(src));
  });
});
