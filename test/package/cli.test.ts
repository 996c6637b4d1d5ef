/**
 * CLI conventions: help on stdout with status 0, --version, unknown commands
 * exit 2 with a hint on stderr, and progress for long runs only on a terminal.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { spawnNode } from "../support/procs.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const main = join(root, "dist", "src", "cli", "main.js");
const pkg = JSON.parse(readFileSync(join(root, "package.json"), "utf8")) as { version: string };
const cli = (...args: string[]) => spawnSync(process.execPath, [main, ...args], { encoding: "utf8", timeout: 30_000, env: { ...process.env, ASYNC_RDMA_PROVIDER: "tcp" } });

describe("async-rdma CLI conventions", () => {
  for (const h of ["--help", "-h", "help"]) {
    it(`${h} prints the commands on stdout and exits 0`, () => {
      const r = cli(h);
      assert.equal(r.status, 0, r.stderr);
      assert.equal(r.stderr, "");
      assert.match(r.stdout, /^usage: async-rdma <command>/);
      for (const c of ["devices", "lab", "perf"]) assert.match(r.stdout, new RegExp(`^  ${c} `, "m"));
    });
  }

  it("<command> --help and help <command> print that command's usage on stdout", () => {
    for (const args of [["devices", "--help"], ["perf", "--help"], ["help", "perf"], ["help", "devices"], ["lab", "-h"], ["help", "lab"]]) {
      const r = cli(...args);
      assert.equal(r.status, 0, `${args.join(" ")}: ${r.stderr}`);
      assert.equal(r.stderr, "", args.join(" "));
      assert.match(r.stdout, /^usage: async-rdma (devices|perf|lab) /, args.join(" "));
    }
  });

  it("--version prints the package's version", () => {
    const r = cli("--version");
    assert.equal(r.status, 0);
    assert.equal(r.stdout.trim(), pkg.version);
  });

  it("an unknown command, an unknown option or no command exits 2 with a hint on stderr", () => {
    for (const args of [["frobnicate"], ["--frobnicate"], [], ["devices", "--frobnicate"]]) {
      const r = cli(...args);
      assert.equal(r.status, 2, args.join(" "));
      assert.equal(r.stdout, "", args.join(" "));
      assert.match(r.stderr, /^async-rdma: /, args.join(" "));
      assert.match(r.stderr, /async-rdma --help|usage: async-rdma devices/, args.join(" "));
    }
    assert.match(cli("frobnicate").stderr, /unknown command "frobnicate"/);
    assert.equal(cli("help", "frobnicate").status, 2);
  });

  it("devices lists the tcp device", () => {
    const r = cli("devices", "--provider", "tcp", "--json");
    assert.equal(r.status, 0, r.stderr);
    const devs = JSON.parse(r.stdout) as { name: string }[];
    assert.ok(devs.length >= 1);
  });

  /** Runs a perf server and a 3-size client; `wrap` runs the client under a terminal or not. */
  async function perfRun(onTerminal: boolean): Promise<{ status: number | null; out: string; err: string }> {
    const server = spawnNode(main, ["perf", "write_bw", "-p", "0", "--provider", "tcp"], "perf server");
    try {
      const port = (await server.waitFor(/port (\d+)/, 20_000))[1]!;
      const client = [main, "perf", "write_bw", "127.0.0.1", "-p", port, "--sizes", "2,4,8", "-n", "100", "--provider", "tcp"];
      const r = onTerminal
        ? spawnSync("script", ["-qec", [process.execPath, ...client].map((a) => `'${a}'`).join(" "), "/dev/null"], { encoding: "utf8", timeout: 60_000 })
        : spawnSync(process.execPath, client, { encoding: "utf8", timeout: 60_000 });
      await server.exited(20_000);
      return { status: r.status, out: r.stdout, err: r.stderr };
    } finally {
      server.child.kill();
    }
  }

  it("perf over several sizes prints nothing extra when piped", async () => {
    const r = await perfRun(false);
    assert.equal(r.status, 0, r.err);
    assert.equal(r.err, "");
    assert.doesNotMatch(r.out, /[\r\x1b]/);
    assert.equal(r.out.match(/^ [248] +100 /gm)?.length, 3, r.out);
  });

  it("issue 21: perf -r sets each side's receive depth (perftest's -r, default 512); out of range is a usage error", async () => {
    const server = spawnNode(main, ["perf", "send_bw", "-p", "0", "--provider", "tcp", "-r", "64"], "perf server");
    try {
      const port = (await server.waitFor(/port (\d+)/, 20_000))[1]!;
      const r = spawnSync(process.execPath, [main, "perf", "send_bw", "127.0.0.1", "-p", port, "--sizes", "64,4096", "-n", "2000", "--provider", "tcp", "-r", "64"], { encoding: "utf8", timeout: 60_000 });
      await server.exited(20_000);
      assert.equal(r.status, 0, r.stderr);
      assert.match(r.stdout, /RX depth +: 64 /);
      assert.equal(r.stdout.match(/^ (64|4096) +2000 /gm)?.length, 2, r.stdout);
    } finally {
      server.child.kill();
    }
    const d = cli("perf", "send_bw", "-r", "4");
    assert.equal(d.status, 2);
    assert.match(d.stderr, /-r/);
    assert.match(cli("perf", "--help").stdout, /-r, --rx-depth N .*default 512/);
  });

  it("issue 21: perf --eager-threshold sets a side's eager threshold: the client's header shows the server's, 64 KiB sends run; out of range is a usage error", async () => {
    const server = spawnNode(main, ["perf", "send_bw", "-p", "0", "--provider", "tcp", "--eager-threshold", "65536"], "perf server");
    try {
      const port = (await server.waitFor(/port (\d+)/, 20_000))[1]!;
      const r = spawnSync(process.execPath, [main, "perf", "send_bw", "127.0.0.1", "-p", port, "--sizes", "65536", "-n", "200", "--provider", "tcp"], { encoding: "utf8", timeout: 60_000 });
      await server.exited(20_000);
      assert.equal(r.status, 0, r.stderr);
      assert.match(r.stdout, /Eager to peer +: 65536 B /);
      assert.match(r.stdout, /^ 65536 +200 /m);
    } finally {
      server.child.kill();
    }
    const d = cli("perf", "send_bw", "--eager-threshold", String(2 << 20));
    assert.equal(d.status, 2);
    assert.match(d.stderr, /--eager-threshold/);
    assert.match(cli("perf", "--help").stdout, /--eager-threshold BYTES/);
  });

  const hasScript = spawnSync("script", ["--version"], { encoding: "utf8" }).status === 0;
  it("perf over several sizes shows progress on a terminal, erased before each row", { skip: hasScript ? false : "no script(1) to give the client a terminal" }, async () => {
    const r = await perfRun(true);
    assert.equal(r.status, 0, r.out);
    assert.match(r.out, /\r\x1b\[Kperf write_bw: 4 bytes \(2\/3\)\r\x1b\[K 4 +100 /);
  });
});
