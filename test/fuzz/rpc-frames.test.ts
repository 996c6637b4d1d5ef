/**
 * RPC frame fuzz (issue 19, "Tests"): fast-check-generated messages sent by
 * a raw connection to an RpcServer (src/rpc/index.ts): well-formed CALL and
 * CANCEL frames with random ids, methods (known, unknown, empty, not UTF-8,
 * up to the 1024-byte limit and past it) and payloads (eager and rendezvous
 * sizes), frames a client may not send (OK, ERROR, unknown kinds), random
 * bytes, and random mutations of all of these (bytes changed, messages cut
 * short or extended), one to three messages per connection.
 *
 * An independent model of the frame format (`judge` below, from the format
 * in the file's opening comment, not the decoder) predicts each
 * connection's outcome: every message valid → every CALL answered (OK with
 * the echo, ERROR with the handler's code and details, NOT_FOUND for an
 * unknown method) and serve() resolves when the client leaves; a message
 * that breaks the format → the server closes the connection and serve()
 * rejects PROTOCOL. Never a crash, a hang or an unhandled rejection; a
 * legitimate RpcClient on its own connection is answered after every case;
 * the server lets every connection go and the contexts return to the
 * baseline.
 *
 * Seeds are fixed (reproducible); ASYNC_RDMA_FUZZ_SEED / ASYNC_RDMA_FUZZ_RUNS
 * explore more (test/support/fuzz.ts). Provider- and CM-neutral; counts
 * scaled down on verbs (the guest is 4–7× slower).
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import fc from "fast-check";
import { RdmaError, type Rdma, type RdmaListener } from "../../src/index.js";
import { RpcClient, RpcServer } from "../../src/rpc/index.js";
import { contextStats } from "../../src/api/context.js";
import { CM, PROVIDER, at, builder, eventually, pattern } from "../support/api.js";
import { SLOW } from "../support/seam.js";
import { deadline, fcParams, hex, runs, settledRssMiB, watchUnhandled } from "../support/fuzz.js";

const STEP_MS = 30_000 * SLOW;
const MAGIC = 0x52;
const KIND = { CALL: 1, OK: 2, ERROR: 3, CANCEL: 4 } as const;

// ------------------------------------------------------------------ the model

interface ModelFrame {
  kind: number;
  id: number;
  method: Uint8Array;
  payload: Uint8Array;
}

const strictUtf8 = new TextDecoder("utf-8", { fatal: true });

/**
 * The frames of a message as the format defines them, or why the message
 * breaks it: each frame is magic 0x52, a kind 1–4, a method length (0 unless
 * CALL, at most 1024), an id, a payload length, then the method (UTF-8) and
 * the payload, all inside the message; a client sends only CALL and CANCEL.
 */
function isUtf8(b: Uint8Array): boolean {
  try {
    strictUtf8.decode(b);
    return true;
  } catch {
    return false;
  }
}

function judge(b: Uint8Array): { frames: ModelFrame[] } | { bad: string } {
  const frames: ModelFrame[] = [];
  let off = 0;
  while (off < b.length) {
    if (b.length - off < 12) return { bad: "truncated header" };
    if (b[off] !== MAGIC) return { bad: "magic" };
    const kind = b[off + 1]!;
    const mlen = (b[off + 2]! << 8) | b[off + 3]!;
    const id = ((b[off + 4]! << 24) | (b[off + 5]! << 16) | (b[off + 6]! << 8) | b[off + 7]!) >>> 0;
    const plen = ((b[off + 8]! << 24) | (b[off + 9]! << 16) | (b[off + 10]! << 8) | b[off + 11]!) >>> 0;
    if (kind < 1 || kind > 4) return { bad: `kind ${kind}` };
    if (kind !== KIND.CALL && mlen !== 0) return { bad: "method on a non-call" };
    if (mlen > 1024) return { bad: "method too long" };
    if (off + 12 + mlen + plen > b.length) return { bad: "longer than the message" };
    const method = b.slice(off + 12, off + 12 + mlen);
    try {
      strictUtf8.decode(method);
    } catch {
      return { bad: "method not UTF-8" };
    }
    frames.push({ kind, id, method, payload: b.slice(off + 12 + mlen, off + 12 + mlen + plen) });
    off += 12 + mlen + plen;
  }
  for (const f of frames) if (f.kind === KIND.OK || f.kind === KIND.ERROR) return { bad: `a client sent kind ${f.kind}` };
  return { frames };
}

/** What the server answers to a CALL of the fuzz server (below): "kind:id:payload". */
function expectedReply(f: ModelFrame): string {
  const method = strictUtf8.decode(f.method);
  if (method === "echo") return `${KIND.OK}:${f.id}:${Buffer.from(f.payload).toString("hex")}`;
  if (method === "empty") return `${KIND.OK}:${f.id}:`;
  if (method === "fail") return `${KIND.ERROR}:${f.id}:EFUZZ`;
  return `${KIND.ERROR}:${f.id}:NOT_FOUND`;
}

// ------------------------------------------------------------- the inputs

function encode(frames: ModelFrame[]): Uint8Array {
  const n = frames.reduce((s, f) => s + 12 + f.method.length + f.payload.length, 0);
  const out = new Uint8Array(n);
  const v = new DataView(out.buffer);
  let o = 0;
  for (const f of frames) {
    v.setUint8(o, MAGIC);
    v.setUint8(o + 1, f.kind);
    v.setUint16(o + 2, f.method.length);
    v.setUint32(o + 4, f.id);
    v.setUint32(o + 8, f.payload.length);
    out.set(f.method, o + 12);
    out.set(f.payload, o + 12 + f.method.length);
    o += 12 + f.method.length + f.payload.length;
  }
  return out;
}

const utf8 = (s: string): Uint8Array => new TextEncoder().encode(s);

const methodArb: fc.Arbitrary<Uint8Array> = fc.oneof(
  { weight: 8, arbitrary: fc.constantFrom("echo", "empty", "fail").map(utf8) },
  { weight: 2, arbitrary: fc.constantFrom("nope", "", "ECHO", "echo\0", "\uFEFFfail", "é", "x".repeat(1024)).map(utf8) },
  { weight: 1, arbitrary: fc.string({ maxLength: 12 }).map(utf8) },
  // often not UTF-8
  { weight: 1, arbitrary: fc.uint8Array({ minLength: 1, maxLength: 8 }) },
);

const idArb = fc.oneof(fc.integer({ min: 0, max: 8 }), fc.constantFrom(0xffffffff, 0x80000000), fc.integer({ min: 0, max: 0xffffffff }));

const payloadArb: fc.Arbitrary<Uint8Array> = fc.oneof(
  { weight: 6, arbitrary: fc.uint8Array({ maxLength: 64 }) },
  // across the eager threshold (4 KiB): the reply goes by rendezvous
  { weight: 1, arbitrary: fc.integer({ min: 4000, max: 9000 }).chain((n) => fc.integer().map((seed) => pattern(n, seed))) },
);

/** Frames a client may send (the methods UTF-8). */
const goodFrameArb: fc.Arbitrary<ModelFrame> = fc.oneof(
  { weight: 5, arbitrary: fc.record({ kind: fc.constant<number>(KIND.CALL), id: idArb, method: methodArb.filter(isUtf8), payload: payloadArb }) },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant<number>(KIND.CANCEL), id: idArb, method: fc.constant(new Uint8Array(0)), payload: fc.constant(new Uint8Array(0)) }) },
);

/** Any frame, well-formed as bytes. */
const frameArb: fc.Arbitrary<ModelFrame> = fc.oneof(
  { weight: 10, arbitrary: fc.record({ kind: fc.constant<number>(KIND.CALL), id: idArb, method: methodArb, payload: payloadArb }) },
  { weight: 2, arbitrary: fc.record({ kind: fc.constant<number>(KIND.CANCEL), id: idArb, method: fc.constant(new Uint8Array(0)), payload: fc.constant(new Uint8Array(0)) }) },
  { weight: 1, arbitrary: fc.record({ kind: fc.constantFrom<number>(KIND.OK, KIND.ERROR, 0, 5, 0x52, 255), id: idArb, method: fc.constant(new Uint8Array(0)), payload: fc.uint8Array({ maxLength: 16 }) }) },
);

type Mutation = { op: "set"; at: number; value: number } | { op: "cut"; at: number } | { op: "append"; bytes: Uint8Array };
const mutationArb: fc.Arbitrary<Mutation> = fc.oneof(
  fc.record({ op: fc.constant("set" as const), at: fc.nat(), value: fc.integer({ min: 0, max: 255 }) }),
  fc.record({ op: fc.constant("cut" as const), at: fc.nat() }),
  fc.record({ op: fc.constant("append" as const), bytes: fc.uint8Array({ minLength: 1, maxLength: 16 }) }),
);

function mutate(b: Uint8Array, ms: Mutation[]): Uint8Array {
  let out = b.slice();
  for (const m of ms) {
    if (m.op === "set" && out.length > 0) out[m.at % out.length] = m.value;
    else if (m.op === "cut" && out.length > 1) out = out.slice(0, 1 + (m.at % (out.length - 1)));
    else if (m.op === "append") out = new Uint8Array([...out, ...m.bytes]);
  }
  return out;
}

interface Message {
  bytes: Uint8Array;
  label: string;
}

const messageArb: fc.Arbitrary<Message> = fc.oneof(
  { weight: 6, arbitrary: fc.array(goodFrameArb, { minLength: 1, maxLength: 24 }).map((fs) => ({ bytes: encode(fs), label: "calls" })) },
  { weight: 2, arbitrary: fc.array(frameArb, { minLength: 1, maxLength: 24 }).map((fs) => ({ bytes: encode(fs), label: "frames" })) },
  {
    weight: 3,
    arbitrary: fc.tuple(fc.array(frameArb, { minLength: 1, maxLength: 8 }), fc.array(mutationArb, { minLength: 1, maxLength: 3 })).map(([fs, ms]) => ({ bytes: mutate(encode(fs), ms), label: "mutated frames" })),
  },
  { weight: 1, arbitrary: fc.uint8Array({ minLength: 1, maxLength: 200 }).map((b) => ({ bytes: b, label: "random bytes" })) },
  { weight: 1, arbitrary: fc.uint8Array({ minLength: 11, maxLength: 40 }).map((b) => ({ bytes: new Uint8Array([MAGIC, KIND.CALL, ...b]), label: "a header and noise" })) },
);

// ------------------------------------------------------------------ the test

describe(`rpc frames fuzz [${PROVIDER}, ${CM}]`, { timeout: 900_000 * SLOW }, () => {
  let listener: RdmaListener;
  let server: RpcServer;
  let legitClient: RpcClient;
  let legitServed: Promise<void>;
  let baseContexts = 0;
  let legitCalls = 0;
  const watch = watchUnhandled();

  const handlers = {
    echo: (b: Uint8Array) => b,
    empty: () => undefined,
    fail: () => {
      throw Object.assign(new Error("fuzzed"), { code: "EFUZZ", details: { n: 1 } });
    },
  };

  async function pair(): Promise<{ client: Rdma; server: Rdma }> {
    const [client, srv] = await deadline(Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: STEP_MS })]), STEP_MS, "a connection");
    return { client, server: srv };
  }

  async function legit(): Promise<void> {
    const n = legitCalls++;
    const back = await deadline(legitClient.call("echo", pattern(100, n)), STEP_MS, "the legitimate client's call");
    assert.deepEqual([...back], [...pattern(100, n)], "the legitimate client's reply");
  }

  before(async () => {
    // maxInFlight small, so replies past it make later frames of a message wait
    server = new RpcServer(handlers, { maxInFlight: 4, maxQueuedBytes: 16 * 1024 });
    listener = await builder("server").bind(at(0));
    baseContexts = contextStats().live;
    const p = await pair();
    legitServed = server.serve(p.server);
    legitClient = new RpcClient(p.client);
    await legit();
  });

  after(async () => {
    await legitClient?.close();
    await legitServed?.catch(() => {});
    await listener?.close();
    watch.stop();
  });

  it("random and mutated frames: every call answered as the format says, or the connection closed with PROTOCOL; the server lets go of everything; a legitimate client is answered after every case", async () => {
    const numRuns = runs(150, 25);
    let rss0 = 0;
    const outcomes = new Map<string, number>();
    await fc.assert(
      fc.asyncProperty(fc.array(messageArb, { minLength: 1, maxLength: 3 }), async (messages) => {
        const verdicts = messages.map((m) => judge(m.bytes));
        const firstBad = verdicts.findIndex((v) => "bad" in v);
        const what = messages.map((m, i) => `${m.label} ${hex(m.bytes)} → ${"bad" in verdicts[i]! ? (verdicts[i] as { bad: string }).bad : "valid"}`).join(" | ");
        const p = await pair();
        const served = server.serve(p.server);
        const outcome = served.then(
          () => "resolved",
          (e: unknown) => (e instanceof RdmaError ? e.code : `not an RdmaError: ${String(e)}`),
        );
        // Replies, read as they come ("kind:id:payload or code").
        const replies: string[] = [];
        const reading = (async () => {
          for (;;) {
            let msg;
            try {
              msg = await p.client.receive();
            } catch {
              return;
            }
            let b: Uint8Array;
            try {
              b = msg.bytes.slice();
            } catch {
              return; // the connection closed between the arrival and now (its memory is gone)
            } finally {
              msg[Symbol.dispose]();
            }
            const v = new DataView(b.buffer);
            for (let off = 0; off + 12 <= b.length; ) {
              const kind = b[off + 1]!;
              const mlen = v.getUint16(off + 2);
              const id = v.getUint32(off + 4);
              const plen = v.getUint32(off + 8);
              const payload = b.subarray(off + 12 + mlen, off + 12 + mlen + plen);
              if (kind === KIND.ERROR) {
                const j = JSON.parse(Buffer.from(payload).toString("utf8")) as { code: string; message: string; details?: unknown };
                assert.equal(typeof j.message, "string");
                if (j.code === "EFUZZ") assert.deepEqual(j.details, { n: 1 }, "the handler's details");
                replies.push(`${kind}:${id}:${j.code}`);
              } else replies.push(`${kind}:${id}:${Buffer.from(payload).toString("hex")}`);
              off += 12 + mlen + plen;
            }
          }
        })();
        try {
          for (const m of messages) {
            if (p.client.isClosed) break;
            const lmr = p.client.allocLocalMr(m.bytes.length);
            lmr.bytes.set(m.bytes);
            // A send may fail once the server closed the connection for an earlier message.
            await deadline(p.client.send(lmr), STEP_MS, `the send of ${m.label}`)
              .catch((e: unknown) => assert.ok(firstBad >= 0 && e instanceof RdmaError, `${what}: a send failed: ${String(e)}`))
              .finally(() => lmr[Symbol.dispose]());
          }
          if (firstBad >= 0) {
            assert.equal(await deadline(outcome, STEP_MS, `${what}: serve() to end`), "PROTOCOL", `${what}: serve() rejects PROTOCOL`);
            await eventually(() => p.client.isClosed, STEP_MS, `${what}: the connection to close`);
          } else {
            const want: string[] = [];
            for (const v of verdicts) for (const f of (v as { frames: ModelFrame[] }).frames) if (f.kind === KIND.CALL) want.push(expectedReply(f));
            await eventually(() => replies.length >= want.length, STEP_MS, `${what}: ${want.length} replies (got ${replies.length})`);
            assert.deepEqual([...replies].sort(), want.sort(), `${what}: the replies`);
            assert.equal(p.client.isClosed, false, `${what}: the connection lives`);
            await p.client.close();
            assert.equal(await deadline(outcome, STEP_MS, `${what}: serve() to end`), "resolved", `${what}: serve() resolves when the client leaves`);
          }
          outcomes.set(firstBad >= 0 ? "PROTOCOL" : "answered", (outcomes.get(firstBad >= 0 ? "PROTOCOL" : "answered") ?? 0) + 1);
        } finally {
          await Promise.allSettled([p.client.close(), p.server.close()]);
          await reading;
        }
        await eventually(() => server.stats().connections === 1, STEP_MS, `${what}: the server to let the connection go (${JSON.stringify(server.stats())})`);
        watch.check();
        await legit();
        if (rss0 === 0 && legitCalls >= 10) rss0 = await settledRssMiB();
      }),
      fcParams(0x2bc1, numRuns),
    );
    await eventually(() => contextStats().live === baseContexts + 2, STEP_MS, "only the legitimate connection's contexts to remain");
    const s = server.stats();
    assert.equal(s.connections, 1);
    assert.ok(s.peakInFlight <= 4, `calls in flight on one connection stayed within maxInFlight (peak ${s.peakInFlight})`);
    const rss = await settledRssMiB();
    console.log(`# ${numRuns} connections of fuzzed RPC frames: ${JSON.stringify(Object.fromEntries(outcomes))}; ${legitCalls} legitimate calls answered; RSS ${rss0.toFixed(0)} → ${rss.toFixed(0)} MiB`);
    assert.ok(outcomes.get("PROTOCOL") && outcomes.get("answered"), "both outcomes were exercised");
    assert.ok(rss0 === 0 || rss - rss0 < 100, `RSS grew by ${(rss - rss0).toFixed(0)} MiB`);
  });
});
