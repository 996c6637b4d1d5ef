/**
 * issue 22 point 6: cp for programs and pipes. The library's copy() ("async-rdma/cp") against a
 * real `async-rdma serve`: uploads and downloads with progress events and a result, an
 * AbortSignal that stops a copy (which `resume` then finishes), streams at either end; and the
 * command's `-` for stdin and stdout through real pipes.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { spawn } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable, Writable } from "node:stream";
import { RdmaBuilder } from "../../src/index.js";
import { copy, CopyError, type CopyProgress } from "../../src/cli/copy/api.js";
import { deviceNames } from "../support/seam.js";
import { DEADLINE, env, MAIN, PROVIDER, serve, type Server } from "../support/cp.js";

const CHUNK = 64 * 1024;

/** The builder cp's own process would use (provider and device of the client side). */
function builder(): RdmaBuilder {
  const b = new RdmaBuilder().setProvider(PROVIDER);
  const dev = deviceNames()[1];
  if (PROVIDER === "verbs" && dev) b.setDevice(dev);
  return b;
}

/** Runs the command with `input` on its stdin (a pipe); its stdout as bytes. */
function pipeRun(args: string[], input: Buffer | null): Promise<{ code: number | string; out: Buffer; err: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [MAIN, ...args], { stdio: ["pipe", "pipe", "pipe"], env: env(1) });
    const out: Buffer[] = [];
    let err = "";
    const timer = setTimeout(() => (child.kill("SIGKILL"), reject(new Error(`${args.join(" ")}: no exit within ${DEADLINE} ms\n${err}`))), DEADLINE);
    child.stdout.on("data", (d: Buffer) => out.push(d));
    child.stderr.on("data", (d: Buffer) => (err += d));
    child.on("exit", (c, sig) => (clearTimeout(timer), resolve({ code: c ?? sig ?? "?", out: Buffer.concat(out), err })));
    child.stdin.on("error", () => {}); // a cp that refuses its arguments exits without reading
    if (input !== null) {
      // in pieces, as a pipe delivers them
      for (let o = 0; o < input.length; o += 10_000) child.stdin.write(input.subarray(o, o + 10_000));
    }
    child.stdin.end();
  });
}

describe(`issue 22 point 6: cp for programs and pipes [${PROVIDER}]`, { timeout: 10 * DEADLINE }, () => {
  let dir = "";
  let served = "";
  let s: Server;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), "ardma-cp-api-"));
    served = join(dir, "served");
    mkdirSync(served);
    s = await serve(served);
  });

  after(async () => {
    s?.kill();
    await s?.exited().catch(() => {});
    rmSync(dir, { recursive: true, force: true });
  });

  it("issue 22 point 6: the package exports copy as async-rdma/cp", async () => {
    const spec = "async-rdma/cp"; // a self-reference through package.json's exports (not resolved by tsc)
    const m = (await import(spec)) as { copy?: unknown; CopyError?: unknown };
    assert.equal(m.copy, copy);
    assert.equal(m.CopyError, CopyError);
  });

  it("issue 22 point 6: copy() uploads and downloads a tree, with progress events and a result", async () => {
    const src = join(dir, "tree");
    mkdirSync(join(src, "sub"), { recursive: true });
    const big = randomBytes(5 * CHUNK + 7);
    writeFileSync(join(src, "sub", "big.bin"), big);
    writeFileSync(join(src, "small.txt"), "hello\n");
    // a failure: rejects with the first one's code, every one listed
    await assert.rejects(copy(src, s.at("up/"), { builder: builder() }).done, (e: unknown) => e instanceof CopyError && e.code === "EISDIR" && e.errors?.length === 1);
    mkdirSync(join(served, "up"));
    const events: CopyProgress[] = [];
    const job = copy(src, s.at("up/"), { recursive: true, chunk: CHUNK, depth: 3, builder: builder() });
    job.on("progress", (p) => events.push(p));
    const r = await job;
    assert.equal(r.files, 2);
    assert.equal(r.bytes, big.length + 6);
    assert.ok(readFileSync(join(served, "up", "tree", "sub", "big.bin")).equals(big));
    assert.ok(events.length >= 2, "a progress event per chunk or batch");
    for (let i = 1; i < events.length; i++) assert.ok(events[i]!.bytes >= events[i - 1]!.bytes, "progress only grows");
    assert.equal(events.at(-1)!.bytes, big.length + 6);
    assert.equal(events.at(-1)!.total, big.length + 6);

    const down = join(dir, "down");
    mkdirSync(down);
    const d = await copy(s.at("up/tree"), down, { recursive: true, chunk: CHUNK, builder: builder() });
    assert.equal(d.files, 2);
    assert.ok(readFileSync(join(down, "tree", "sub", "big.bin")).equals(big));
    assert.equal(readFileSync(join(down, "tree", "small.txt"), "utf8"), "hello\n");
  });

  it("issue 22 point 6: an AbortSignal stops a copy (ABORTED); resume: true finishes it", async () => {
    const data = randomBytes(64 * CHUNK);
    const f = join(dir, "abort.bin");
    writeFileSync(f, data);
    const ac = new AbortController();
    const job = copy(f, s.at("abort.bin"), { chunk: CHUNK, depth: 1, signal: ac.signal, builder: builder() });
    let seen = 0;
    job.on("progress", (p) => {
      seen = p.bytes;
      if (p.bytes >= 4 * CHUNK) ac.abort();
    });
    await assert.rejects(job.done, (e: unknown) => e instanceof CopyError && e.code === "ABORTED");
    assert.ok(seen >= 4 * CHUNK && seen < data.length, `stopped part way (${seen} bytes)`);
    const r = await copy(f, s.at("abort.bin"), { chunk: CHUNK, resume: true, builder: builder() });
    assert.ok(r.skipped >= 4 * CHUNK, `the resumed copy kept what was copied (${r.skipped} bytes skipped)`);
    assert.ok(readFileSync(join(served, "abort.bin")).equals(data));
    // already aborted: nothing is copied
    await assert.rejects(copy(f, s.at("never.bin"), { signal: AbortSignal.abort(), builder: builder() }).done, (e: unknown) => e instanceof CopyError && e.code === "ABORTED");
  });

  it("issue 22 point 6: copy() from a Readable and into a Writable (in order, every chunk checked)", async () => {
    const data = randomBytes(9 * CHUNK + 1000);
    const pieces = Array.from({ length: Math.ceil(data.length / 7777) }, (_, i) => data.subarray(i * 7777, (i + 1) * 7777));
    await copy(Readable.from(pieces), s.at("streamed.bin"), { chunk: CHUNK, builder: builder() });
    assert.ok(readFileSync(join(served, "streamed.bin")).equals(data));
    const got: Buffer[] = [];
    // a slow consumer: back-pressure holds the ring, the order stays
    const sink = new Writable({ highWaterMark: 1024, write: (c: Buffer, _e, cb) => (got.push(Buffer.from(c)), setImmediate(cb)) });
    const r = await copy(s.at("streamed.bin"), sink, { chunk: CHUNK, depth: 4, builder: builder() });
    assert.equal(r.bytes, data.length);
    assert.ok(Buffer.concat(got).equals(data));
    await assert.rejects(copy(s.at("up/"), new Writable({ write: (_c, _e, cb) => cb() }), { builder: builder() }).done, (e: unknown) => e instanceof CopyError && e.code === "EISDIR");
  });

  it("issue 22 point 6: async-rdma cp - reads stdin, cp remote - writes stdout (the summary on stderr)", async () => {
    const data = randomBytes(6 * CHUNK + 5);
    const up = await pipeRun(["cp", "--chunk", String(CHUNK), "-", s.at("piped.bin")], data);
    assert.equal(up.code, 0, up.err);
    assert.ok(readFileSync(join(served, "piped.bin")).equals(data));
    const down = await pipeRun(["cp", "--chunk", String(CHUNK), "--depth", "4", s.at("piped.bin"), "-"], null);
    assert.equal(down.code, 0, down.err);
    assert.ok(down.out.equals(data), `stdout is the file, byte for byte (${down.out.length} bytes)`);
    assert.match(down.err, /1 files/);
    // a directory cannot be either end of a stream
    const toDir = await pipeRun(["cp", "-", s.at("")], data);
    assert.equal(toDir.code, 1);
    assert.match(toDir.err, /EISDIR/);
    const fromDir = await pipeRun(["cp", s.at("up"), "-"], null);
    assert.equal(fromDir.code, 1);
    assert.match(fromDir.err, /EISDIR/);
    assert.equal(fromDir.out.length, 0);
    const two = await pipeRun(["cp", s.at("piped.bin"), s.at("streamed.bin"), "-"], null);
    assert.equal(two.code, 2, two.err);
  });
});
