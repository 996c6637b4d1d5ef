/**
 * issue 22 point 5: typed RPC on the provider under test. Payload codecs (raw bytes, JSON, a
 * user codec, per method) over the unchanged frames, codec failures as typed errors on the side
 * that made them, and a handler's structured error reaching the caller (a plain object thrown
 * keeps its message; `isRpcError` narrows the details). The compile-time checks (wrong method
 * name, wrong payload type) are in typed-compile.test.ts.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { RpcClient, RpcError, RpcServer, isRpcError, jsonCodec, rawCodec, type RpcCodec } from "../../src/rpc/index.js";
import { CM, PROVIDER, apiPair } from "../support/api.js";

const SLOW = PROVIDER === "verbs" ? 4 : 1;

type Api = {
  add: { request: { a: number; b: number }; response: number };
  greet: { request: string; response: string };
  ping: { request: undefined; response: undefined };
  blob: { request: Uint8Array; response: Uint8Array };
  fail: { request: { why: string }; response: never };
};

/** A user codec: a u32 list, big-endian, length-prefixed by nothing (4 bytes each). */
const u32s: RpcCodec<number[]> = {
  encode: (v) => {
    const b = new Uint8Array(v.length * 4);
    const d = new DataView(b.buffer);
    v.forEach((x, i) => d.setUint32(i * 4, x));
    return b;
  },
  decode: (b) => {
    if (b.length % 4 !== 0) throw new Error(`${b.length} bytes is not a list of u32`);
    const d = new DataView(b.buffer, b.byteOffset, b.byteLength);
    return Array.from({ length: b.length / 4 }, (_, i) => d.getUint32(i * 4));
  },
};

describe(`rpc typed [${PROVIDER}, ${CM}]`, { timeout: 120_000 * SLOW }, () => {
  it("issue 22 point 5: JSON codec, a user codec per method, raw bytes per method; the wire carries exactly the codec's bytes", async () => {
    const p = await apiPair();
    const server = new RpcServer<Api & { sum: { request: number[]; response: number[] } }>(
      {
        add: ({ a, b }) => a + b,
        greet: async (name) => `hello ${name}`,
        ping: () => undefined,
        blob: (b) => b.slice().reverse(),
        fail: ({ why }) => {
          throw Object.assign(new Error(why), { code: "EWHY", details: { why, n: 1 } });
        },
        sum: (list) => [list.reduce((x, y) => x + y, 0)],
      },
      { codec: jsonCodec, codecs: { blob: rawCodec, sum: u32s } },
    );
    const served = server.serve(p.server);
    const client = new RpcClient<Api & { sum: { request: number[]; response: number[] } }>(p.client, { codec: jsonCodec, codecs: { blob: rawCodec, sum: u32s } });
    try {
      assert.equal(await client.call("add", { a: 2, b: 40 }), 42);
      assert.equal(await client.call("greet", "rdma"), "hello rdma");
      assert.equal(await client.call("ping"), undefined);
      assert.deepEqual([...(await client.call("blob", new Uint8Array([1, 2, 3])))], [3, 2, 1]);
      assert.deepEqual(await client.call("sum", [1, 2, 3, 0xffff0000]), [0xffff0006]);
      const e = await client.call("fail", { why: "no" }).catch((x: unknown) => x);
      assert.ok(isRpcError<{ why: string; n: number }>(e, "EWHY"), String(e));
      assert.equal(e.details?.why, "no");
      assert.equal(e.method, "fail");
      assert.equal(isRpcError(e, "OTHER"), false);
      assert.equal(isRpcError(new Error("x")), false);
    } finally {
      await p.close();
    }
    await served;

    // The frames are the ones an untyped client sends: a raw server sees the JSON bytes, and its raw reply is decoded.
    const q = await apiPair();
    const seen: Uint8Array[] = [];
    const raw = new RpcServer({
      add: (b) => {
        seen.push(b);
        return new TextEncoder().encode("42");
      },
    });
    const served2 = raw.serve(q.server);
    const typed = new RpcClient<Api>(q.client, { codec: jsonCodec });
    try {
      assert.equal(await typed.call("add", { a: 2, b: 40 }), 42);
      assert.equal(new TextDecoder().decode(seen[0]), JSON.stringify({ a: 2, b: 40 }));
    } finally {
      await q.close();
    }
    await served2;
  });

  it("issue 22 point 5: codec failures are typed, on the side that made them, and the connection lives on", async () => {
    const p = await apiPair();
    // the server decodes JSON; a raw client sends it bytes that are not JSON
    const server = new RpcServer<{ add: { request: { a: number; b: number }; response: number }; bad: { request: undefined; response: bigint } }>(
      { add: ({ a, b }) => a + b, bad: () => 1n },
      { codec: jsonCodec },
    );
    const served = server.serve(p.server);
    const raw = new RpcClient(p.client);
    try {
      const e = await raw.call("add", new Uint8Array([0x7b, 0x7b])).catch((x: unknown) => x);
      assert.ok(e instanceof RpcError && e.code === "BAD_REQUEST", String(e));
      // a reply the server's codec cannot encode (a BigInt in JSON) answers as the error it threw
      const b = await raw.call("bad").catch((x: unknown) => x);
      assert.ok(b instanceof RpcError && b.code === "HANDLER_ERROR" && /BigInt/.test(b.message), String(b));
      // a codec without decode() is refused when the client is made
      assert.throws(() => new RpcClient(p.client, { codec: { encode: () => new Uint8Array(0) } as unknown as RpcCodec }), (x: unknown) => x instanceof RdmaError && x.code === "INVALID_ARGUMENT");
      assert.equal(new TextDecoder().decode(await raw.call("add", new TextEncoder().encode('{"a":1,"b":2}'))), "3");
    } finally {
      await p.close();
    }
    await served;

    const q = await apiPair();
    const echo = new RpcServer({ echo: (b) => b, odd: (b) => b });
    const served2 = echo.serve(q.server);
    const throwing: RpcCodec<number> = {
      encode: () => {
        throw new Error("cannot encode");
      },
      decode: () => 0,
    };
    type EchoApi = { echo: { request: number[]; response: number[] }; odd: { request: number[]; response: number[] }; boom: { request: number; response: number } };
    const client = new RpcClient<EchoApi>(q.client, { codec: u32s, codecs: { boom: throwing, odd: { encode: u32s.encode, decode: () => { throw new Error("not mine"); } } } });
    try {
      // the client's encode throws: INVALID_ARGUMENT, nothing sent
      await assert.rejects(client.call("boom", 1), (x: unknown) => x instanceof RdmaError && x.code === "INVALID_ARGUMENT" && /cannot encode/.test(x.message));
      // the client's decode throws: that call only, BAD_REPLY
      await assert.rejects(client.call("odd", [1]), (x: unknown) => x instanceof RpcError && x.code === "BAD_REPLY" && /not mine/.test(x.message));
      assert.deepEqual(await client.call("echo", [7, 8]), [7, 8]);
    } finally {
      await q.close();
    }
    await served2;
  });

  it("issue 22 point 5: a handler that throws a plain object { code, message, details } reaches the caller with its message", async () => {
    const p = await apiPair();
    const server = new RpcServer({
      quota: () => {
        throw { code: "EQUOTA", message: "over quota", details: { used: 5, limit: 4 } };
      },
      own: () => {
        throw new RpcError("ELIMIT", "limit reached", "own", [1, 2]);
      },
    });
    const served = server.serve(p.server);
    const client = new RpcClient(p.client);
    try {
      const e = await client.call("quota").catch((x: unknown) => x);
      assert.ok(isRpcError<{ used: number; limit: number }>(e, "EQUOTA"), String(e));
      assert.equal(e.message, "quota: over quota");
      assert.deepEqual(e.details, { used: 5, limit: 4 });
      const o = await client.call("own").catch((x: unknown) => x);
      assert.ok(isRpcError<number[]>(o, "ELIMIT"), String(o));
      assert.deepEqual(o.details, [1, 2]);
      assert.equal(o.message, "own: limit reached");
    } finally {
      await p.close();
    }
    await served;
  });
});
