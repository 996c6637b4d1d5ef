/**
 * issue 22 point 5: typed RPC is checked by tsc. A consumer's program (below) marks with
 * `// @ts-expect-error` every line that must not compile: a wrong method name, a wrong payload,
 * a reply used as the wrong type, a handler of the wrong shape, a missing handler. The test
 * compiles it with the markers removed against the compiled declarations (dist/src/rpc) and
 * checks that tsc reports an error on exactly the marked lines: none missing (the typing
 * would be gone) and none elsewhere (untyped use keeps compiling, correct typed use compiles).
 * Provider-neutral (no connection, no provider): it runs in the tcp suite, and the verbs
 * suite (whose rpc/ filter takes it) skips it, saying so, instead of spending 80 s of
 * emulated tsc per layout on the same check.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const tsc = join(root, "node_modules", "typescript", "bin", "tsc");
const rpc = join(root, "dist", "src", "rpc", "index.js");

const fixture = `
import { RpcClient, RpcServer, jsonCodec, rawCodec } from ${JSON.stringify(rpc)};
import type { Rdma } from ${JSON.stringify(join(root, "dist", "src", "index.js"))};
export {};
declare const rdma: Rdma;
type Api = {
  add: { request: { a: number; b: number }; response: number };
  ping: { request: undefined; response: undefined };
  blob: { request: Uint8Array; response: Uint8Array };
};
const client = new RpcClient<Api>(rdma, { codec: jsonCodec, codecs: { blob: rawCodec } });
const n: number = await client.call("add", { a: 1, b: 2 });
await client.call("ping");
await client.call("blob");
await client.call("add", { a: 1, b: 2 }, { timeoutMs: 100 });
// @ts-expect-error a method the map does not have
await client.call("sub", { a: 1, b: 2 });
// @ts-expect-error a payload of the wrong type
await client.call("add", { a: 1, b: "2" });
// @ts-expect-error a payload missing
await client.call("add");
// @ts-expect-error the reply is a number, not a string
const s: string = await client.call("add", { a: 1, b: 2 });
// @ts-expect-error a codec for a method the map does not have
new RpcClient<Api>(rdma, { codecs: { sub: jsonCodec } });
new RpcServer<Api>({ add: ({ a, b }) => a + b, ping: () => undefined, blob: (b) => b }, { codec: jsonCodec });
// @ts-expect-error a handler that answers the wrong type
new RpcServer<Api>({ add: ({ a, b }) => String(a + b), ping: () => undefined, blob: (b) => b });
// @ts-expect-error a handler missing
new RpcServer<Api>({ add: ({ a, b }) => a + b, ping: () => undefined });
// untyped use, as before: any method name, bytes in and out
const raw = new RpcClient(rdma, { timeoutMs: 5 });
const bytes: Uint8Array = await raw.call("anything", new Uint8Array(1));
await raw.call("empty");
// @ts-expect-error an untyped client takes bytes only
await raw.call("anything", "text");
new RpcServer({ echo: (b) => b, len: (b) => new Uint8Array([b.length]), none: () => {} });
void n, s, bytes;
`;

const onVerbs = process.env.ASYNC_RDMA_PROVIDER === "verbs";

describe("rpc typed: compile checks", { timeout: 120_000, skip: onVerbs ? "provider-neutral: checked by the tcp suite (npm test)" : false }, () => {
  it("issue 22 point 5: a wrong method name or payload type fails tsc; untyped and correct typed use compile", () => {
    const dir = mkdtempSync(join(tmpdir(), "async-rdma-rpc-types-"));
    try {
      const lines = fixture.split("\n");
      const expected: number[] = [];
      const stripped = lines.map((l, i) => {
        if (!l.startsWith("// @ts-expect-error")) return l;
        expected.push(i + 2); // the line after the marker, 1-based
        return "//";
      });
      writeFileSync(join(dir, "consumer.ts"), stripped.join("\n"));
      writeFileSync(join(dir, "package.json"), JSON.stringify({ type: "module" }));
      const r = spawnSync(
        process.execPath,
        [tsc, "--noEmit", "--strict", "--exactOptionalPropertyTypes", "--target", "es2022", "--module", "nodenext", "--moduleResolution", "nodenext", "--skipLibCheck", "--types", "node", "--typeRoots", join(root, "node_modules", "@types"), join(dir, "consumer.ts")],
        { encoding: "utf8" },
      );
      const out = r.stdout + r.stderr;
      const errorLines = [...new Set([...out.matchAll(/consumer\.ts\((\d+),\d+\): error/g)].map((m) => Number(m[1])))].sort((a, b) => a - b);
      assert.ok(expected.length >= 8, "the fixture marks its lines");
      assert.deepEqual(errorLines, expected, `tsc must fail on exactly the marked lines:\n${out}`);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
