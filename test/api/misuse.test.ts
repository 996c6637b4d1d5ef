/**
 * Misuse gets a typed error and kills nothing (issue 9, point 16): every call
 * below throws or rejects with an RdmaError — INVALID_ARGUMENT, or
 * INVALID_STATE for memory whose connection was closed — never a plain
 * TypeError, never silently accepted; the connection it was made on keeps
 * working.
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaBuilder, RdmaError, type LocalMr, type Rdma, type RdmaListener } from "../../src/index.js";
import { CM, PROVIDER, at, builder, pattern } from "../support/api.js";

type Expect = "INVALID_ARGUMENT" | "INVALID_STATE";

function typed(c: Expect, what: string) {
  return (e: unknown) => {
    assert.ok(e instanceof RdmaError, `${what}: expected RdmaError ${c}, got ${e instanceof Error ? `${e.constructor.name}: ${e.message}` : String(e)}`);
    assert.equal(e.code, c, `${what}: ${e.message}`);
    return true;
  };
}

/** Calls `f`; a synchronous throw and a rejection both count. Returns the error, or fails when it succeeded. */
async function outcome(f: () => unknown): Promise<unknown> {
  let r: unknown;
  try {
    r = f();
  } catch (e) {
    return e;
  }
  if (r instanceof Promise) {
    try {
      const v = await r;
      // something was accepted: undo it where it is a resource
      if (v && typeof v === "object" && "close" in v && typeof (v as { close: unknown }).close === "function") await (v as { close(): Promise<void> }).close();
    } catch (e) {
      return e;
    }
  }
  return undefined;
}

const any = <T>(v: unknown): T => v as T;

describe(`misuse gets a typed error [${PROVIDER}, ${CM}]`, { timeout: 300_000 }, () => {
  let listener: RdmaListener;
  let client: Rdma;
  let server: Rdma;

  before(async () => {
    listener = await builder("server").bind(at(0));
    [client, server] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
  });
  after(async () => {
    await Promise.allSettled([client.close(), server.close()]);
    await listener.close();
  });

  async function roundTrip(seed: number): Promise<void> {
    using m = client.allocLocalMr(8);
    m.bytes.set(pattern(8, seed));
    await client.send(m);
    using r = await server.receive();
    assert.deepEqual([...r.bytes], [...pattern(8, seed)]);
  }

  it("builder, connect, bind, listen and accept", async () => {
    const port = listener.port;
    const cases: [string, Expect, () => unknown][] = [
      ["setQpCaps(null)", "INVALID_ARGUMENT", () => new RdmaBuilder().setQpCaps(any(null))],
      ["setQpCaps(5)", "INVALID_ARGUMENT", () => new RdmaBuilder().setQpCaps(any(5))],
      ['setQpCaps("x")', "INVALID_ARGUMENT", () => new RdmaBuilder().setQpCaps(any("x"))],
      ["setQpCaps({ maxSendWr: 1.5 })", "INVALID_ARGUMENT", () => new RdmaBuilder().setQpCaps({ maxSendWr: 1.5 })],
      ["connect(addr, null)", "INVALID_ARGUMENT", () => builder().connect(at(port), any(null))],
      ["connect(addr, 5)", "INVALID_ARGUMENT", () => builder().connect(at(port), any(5))],
      ['connect(addr, { signal: "x" })', "INVALID_ARGUMENT", () => builder().connect(at(port), { signal: any("x") })],
      ["connect(addr, { signal: {} })", "INVALID_ARGUMENT", () => builder().connect(at(port), { signal: any({}) })],
      ['listen(addr, { signal: "x" })', "INVALID_ARGUMENT", () => builder("server").listen(at(0), { signal: any("x") })],
      ['accept({ signal: "x" })', "INVALID_ARGUMENT", () => listener.accept({ signal: any("x") })],
      ["accept(null)", "INVALID_ARGUMENT", () => listener.accept(any(null))],
      ['accept({ timeoutMs: "1" })', "INVALID_ARGUMENT", () => listener.accept({ timeoutMs: any("1") })],
      ['bind("[::1:5")', "INVALID_ARGUMENT", () => builder("server").bind("[::1:5")],
      ['bind("::1:5") (IPv6 needs brackets)', "INVALID_ARGUMENT", () => builder("server").bind("::1:5")],
      ['bind("[localhost]:5")', "INVALID_ARGUMENT", () => builder("server").bind("[localhost]:5")],
      ['bind({ host: "127.0.0.1", port: "5" })', "INVALID_ARGUMENT", () => builder("server").bind(any({ host: "127.0.0.1", port: "5" }))],
      ['connect("127.0.0.1:99999")', "INVALID_ARGUMENT", () => builder().connect("127.0.0.1:99999")],
      ["connect(null)", "INVALID_ARGUMENT", () => builder().connect(any(null))],
    ];
    for (const [what, c, f] of cases) typed(c, what)(await outcome(f));
    // nothing half-accepted on the listener: a real client still gets through
    const [c2, s2] = await Promise.all([builder("client").connect(at(port)), listener.accept({ timeoutMs: 60_000 })]);
    await Promise.all([c2.close(), s2.close()]);
  });

  it("connection operations; the connection lives on", async () => {
    const lmr = client.allocLocalMr(16);
    const rmr = await client.requestRemoteMr(16, { timeoutMs: 60_000 });
    const cases: [string, Expect, () => unknown][] = [
      ["requestRemoteMr(8, null)", "INVALID_ARGUMENT", () => client.requestRemoteMr(8, any(null))],
      ['requestRemoteMr(8, "x")', "INVALID_ARGUMENT", () => client.requestRemoteMr(8, any("x"))],
      ["requestRemoteMr(2 ** 32): the wire field is 32 bits", "INVALID_ARGUMENT", () => client.requestRemoteMr(2 ** 32)],
      ["requestRemoteMr(2 ** 40)", "INVALID_ARGUMENT", () => client.requestRemoteMr(2 ** 40)],
      ["requestRemoteMr(0)", "INVALID_ARGUMENT", () => client.requestRemoteMr(0)],
      ['requestRemoteMr(8, { signal: "x" })', "INVALID_ARGUMENT", () => client.requestRemoteMr(8, { signal: any("x") })],
      ["sendLocalMr(lmr, null)", "INVALID_ARGUMENT", () => client.sendLocalMr(lmr, any(null))],
      ["sendLocalMr(lmr, 5)", "INVALID_ARGUMENT", () => client.sendLocalMr(lmr, any(5))],
      ["sendLocalMr(null)", "INVALID_ARGUMENT", () => client.sendLocalMr(any(null))],
      ["send(lmr, null)", "INVALID_ARGUMENT", () => client.send(lmr, any(null))],
      ['send(lmr, { signal: "x" })', "INVALID_ARGUMENT", () => client.send(lmr, { signal: any("x") })],
      ["write(lmr, null)", "INVALID_ARGUMENT", () => client.write(lmr, any(null))],
      ["read(null, rmr)", "INVALID_ARGUMENT", () => client.read(any(null), rmr)],
      ['receive({ signal: "x" })', "INVALID_ARGUMENT", () => client.receive({ signal: any("x") })],
      ["receive(null)", "INVALID_ARGUMENT", () => client.receive(any(null))],
      ["fetchAndAdd(rmr, 1)", "INVALID_ARGUMENT", () => client.fetchAndAdd(rmr, any(1))],
      ["sendWithImm(lmr, -1)", "INVALID_ARGUMENT", () => client.sendWithImm(lmr, -1)],
      ["allocLocalMr(-1)", "INVALID_ARGUMENT", () => client.allocLocalMr(-1)],
      ['registerMr("x")', "INVALID_ARGUMENT", () => client.registerMr(any("x"))],
      ["LocalMr.view(undefined)", "INVALID_ARGUMENT", () => lmr.view(any(undefined))],
      ["LocalMr.view(null)", "INVALID_ARGUMENT", () => lmr.view(any(null))],
      ["LocalMr.view(Object)", "INVALID_ARGUMENT", () => lmr.view(any(Object))],
      ["LocalMr.view(DataView)", "INVALID_ARGUMENT", () => lmr.view(any(DataView))],
      ["LocalMr.view(() => 1)", "INVALID_ARGUMENT", () => lmr.view(any(() => 1))],
    ];
    for (const [what, c, f] of cases) typed(c, what)(await outcome(f));
    // a size the wire can carry reaches the peer intact (its quota refuses it: not INVALID_ARGUMENT, not a wrapped 0)
    const e = await outcome(() => client.requestRemoteMr(2 ** 32 - 1, { timeoutMs: 60_000 }));
    assert.ok(e instanceof RdmaError && e.code === "QUOTA_EXCEEDED", `requestRemoteMr(2 ** 32 - 1): ${String(e)}`);
    assert.deepEqual([...lmr.view(Uint8Array)], new Array(16).fill(0));
    assert.equal(lmr.view(Float64Array).length, 2);
    await roundTrip(1);
    await client.write(lmr, rmr);
    lmr.dispose();
  });

  it("memory of a closed connection: INVALID_STATE, not a TypeError; a received message stays readable", async () => {
    const [c, s] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 60_000 })]);
    const cm = c.allocLocalMr(64);
    const sm = s.allocLocalMr(64);
    const slice = cm.slice(8, 16);
    const received: LocalMr[] = [];
    cm.bytes.fill(1);
    await c.send(cm);
    received.push(await s.receive());
    await Promise.all([c.close(), s.close()]);
    // A received message outlives its connection (its bytes moved out of the registered memory)…
    assert.equal(received[0]!.disposed, false);
    assert.ok(received[0]!.bytes.every((b) => b === 1));
    // …and no connection takes it as an operand.
    typed("INVALID_ARGUMENT", "send(a received message kept past its connection)")(await outcome(() => client.send(received[0]!)));
    received[0]!.dispose();
    for (const [name, m] of [
      ["client allocation", cm],
      ["its slice", slice],
      ["server allocation", sm],
    ] as const) {
      assert.equal(m.disposed, true, `${name}.disposed after close`);
      const cases: [string, () => unknown][] = [
        ["bytes", () => m.bytes],
        ["view(Uint8Array)", () => m.view(Uint8Array)],
        ["slice(0, 1)", () => m.slice(0, 1)],
      ];
      for (const [what, f] of cases) typed("INVALID_STATE", `${name}.${what} after close`)(await outcome(f));
      // disposing it now is harmless
      m.dispose();
    }
    // used on another, open connection: refused without harm
    typed("INVALID_STATE", "send(memory of a closed connection)")(await outcome(() => client.send(cm)));
    await roundTrip(2);
  });

  it("memory of a closed newConnection() sibling stays usable while the family lives", async () => {
    const [c2, s2] = await Promise.all([client.newConnection(), listener.accept({ timeoutMs: 60_000 })]);
    const m = c2.allocLocalMr(8);
    await Promise.all([c2.close(), s2.close()]);
    m.bytes.set(pattern(8, 3));
    await client.send(m);
    using r = await server.receive();
    assert.deepEqual([...r.bytes], [...pattern(8, 3)]);
    m.dispose();
  });
});
