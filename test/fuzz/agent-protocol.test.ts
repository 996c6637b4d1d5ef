/**
 * Control-protocol fuzz (issue 9, "Tests"): a raw agent-protocol peer
 * (test/support/agent-peer.ts: its own QP, the side-channel handshake done
 * by hand) sends fast-check-generated control messages to a connection
 * accepted by an RdmaListener in this process: well-formed messages of every
 * type with random fields, lies (sizes, tokens, ids, credits, addresses),
 * floods, and random mutations of all of these.
 *
 * An independent model of docs/wire-format.md (`verdict` below, not the
 * codec) predicts each message's outcome: harmless (the connection stays
 * healthy: a PING of ours after the batch is answered), fatal with a given
 * error code, or unknown (a mutation the model cannot decide: then any typed
 * RdmaError, or health). Every case must end that way before a deadline —
 * never a crash, a hang or an unhandled rejection — and when a connection
 * ends, the process-wide peer memory budget is back to 0. Contexts, QPs and
 * registrations return to the baseline, RSS stays bounded.
 *
 * The server also asks a lying peer for memory: grants that lie about size,
 * address, key, lease or id end with the write landing exactly where a real
 * grant allows, or a typed error.
 *
 * Seeds are fixed (reproducible); ASYNC_RDMA_FUZZ_SEED / ASYNC_RDMA_FUZZ_RUNS
 * explore more (test/support/fuzz.ts). Side channel only (RDMA CM cannot
 * carry a hand-made handshake); on verbs the run counts are scaled down
 * (the guest is 4–7× slower).
 */
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import fc from "fast-check";
import { RdmaBuilder, RdmaError, peerMemoryUsage, type Rdma, type RdmaListener } from "../../src/index.js";
import { HDR, MsgType, encodeMsg, type Msg } from "../../src/agent/codec.js";
import type { Device } from "../../src/transport/types.js";
import { PROVIDER } from "../support/api.js";
import { SLOW, deviceNames, openDevice } from "../support/seam.js";
import { PROBE_TOKEN_BASE, RawAgentPeer, SEND_SLOT_BYTES } from "../support/agent-peer.js";
import { type Tables, type Waiter, deadline, fcParams, hex, runs, settledRssMiB, tables, watchUnhandled } from "../support/fuzz.js";

/** Our receive depth, announced in the hello: credits beyond it are a lie the server must catch. */
const PEER_DEPTH = 64;
const CASE_MS = 30_000 * SLOW;
const U32 = 0xffffffff;
const DESC_TYPES = new Set<number>([MsgType.RNDV, MsgType.MR_GRANT, MsgType.MR_LEND, MsgType.MR_SHARED, MsgType.LIMITS]);
/** Access flags a grant, lend or request may carry (docs/wire-format.md): read, read+write, read+write+atomic. */
const ACCESS_OK = new Set<number>([0x4, 0x6, 0xe]);

// ----------------------------------------------------------------- the model

type Verdict = { k: "ok" } | { k: "fatal"; codes: string[]; why: string } | { k: "unknown"; why: string };
const OK: Verdict = { k: "ok" };
const fatal = (why: string, ...codes: string[]): Verdict => ({ k: "fatal", codes: codes.length ? codes : ["PROTOCOL"], why });

/** What the model knows of one connection. */
interface Model {
  /** MR_REQUEST tokens used on this connection (a repeat is fatal when the first was granted and is still live). */
  requestTokens: Set<number>;
  /** Granted and not released, with a lease long enough to outlive the test. */
  liveTokens: Map<number, number>;
  /** A message left the model unsure of the server's state (credits it may now over-count): retire the connection after the case. */
  tainted: boolean;
  /** Rendezvous the server will READ, then answer with RNDV_DONE or fail on (it answers after the READ, so after later PONGs). */
  rndvExpected: number;
}

/** A peer region the server may READ (honest rendezvous), and the server's limits. */
interface Ctx {
  rndv: { addr: number; rkey: number; length: number };
  serverEagerMax: number;
  serverMaxMessage: number;
}

/**
 * A message longer than the receive buffer fails the receive (LOC_LEN_ERR; rxe: LOC_QP_OP_ERR, a
 * DEVICE error, see DEVICE_DEVIATIONS), or first the QP's async event (CONNECTION_CLOSED naming the reason).
 */
const TOO_LONG_CODES = PROVIDER === "verbs" ? ["LOCAL_LENGTH", "DEVICE", "CONNECTION_CLOSED"] : ["LOCAL_LENGTH", "CONNECTION_CLOSED"];

/**
 * The outcome docs/wire-format.md prescribes for one message, written from
 * the document (not from src/agent/codec.ts), given what the model knows.
 * `honest`: the credits field was filled in by the peer from what it owes.
 */
function verdict(b: Uint8Array, honest: boolean, m: Model, c: Ctx): Verdict {
  const len = b.length;
  if (len > HDR + c.serverEagerMax) return fatal(`${len} bytes overrun the ${HDR + c.serverEagerMax}-byte receive`, ...TOO_LONG_CODES);
  if (len < 24) return fatal(`${len} bytes: shorter than a header`);
  const dv = new DataView(b.buffer, b.byteOffset, len);
  if (b[0] !== 0xa7) return fatal("bad magic");
  if (b[1] !== 4) return fatal(`version ${b[1]}`);
  const type = b[2]!;
  const flags = b[3]!;
  if (type < 1 || type > 21) return fatal(`type ${type}`);
  if (flags & ~1) return fatal(`flags ${flags}`);
  if (type !== MsgType.DATA && flags & 1) return fatal("immediate flag on a control message");
  if (DESC_TYPES.has(type)) {
    if (len !== 40) return fatal(`descriptor message of ${len} bytes`);
    if (dv.getUint32(24) >= 0x200000) return fatal("address beyond 2^53");
  } else if (type === MsgType.MR_OPEN) {
    if (len !== 40) return fatal(`MR_OPEN of ${len} bytes`);
  } else if (type !== MsgType.DATA && len !== 24) return fatal(`type ${type} with ${len} bytes`);
  let unsure: Verdict | null = null;
  if (!honest) {
    const credits = dv.getUint32(4);
    if (credits > PEER_DEPTH) return fatal(`${credits} credits, more than our ${PEER_DEPTH} receives`);
    if (credits > 0) {
      // More than we owe, or not: depends on messages in flight. Either way the model loses track.
      m.tainted = true;
      unsure = { k: "unknown", why: `${credits} credits reported out of turn` };
    }
  }
  const token = dv.getUint32(12);
  const a = dv.getUint32(16);
  const v = ((): Verdict => {
    switch (type) {
      case MsgType.DATA:
        return a === len - HDR ? OK : fatal(`DATA claims ${a} bytes, carries ${len - HDR}`);
      case MsgType.RNDV: {
        if (a === 0) return fatal("rendezvous of 0 bytes");
        if (a > c.serverMaxMessage) return fatal(`rendezvous of ${a} bytes > maxMessageSize`);
        const addr = dv.getUint32(24) * 2 ** 32 + dv.getUint32(28);
        const rkey = dv.getUint32(32);
        const inside = rkey === c.rndv.rkey && addr >= c.rndv.addr && addr + a <= c.rndv.addr + c.rndv.length;
        // Either way the server READs: it answers RNDV_DONE, or the READ fails the connection.
        m.rndvExpected++;
        // REMOTE_ACCESS from the READ's completion; on tcp the peer's QP, in ERR after its NAK, closes
        // both its streams, and the one that does not carry the NAK may be seen first (CONNECTION_CLOSED).
        return inside ? OK : fatal("rendezvous READ outside the peer's readable region", "REMOTE_ACCESS", "CONNECTION_CLOSED");
      }
      case MsgType.RNDV_DONE:
        return fatal("RNDV_DONE for a rendezvous the server never announced");
      case MsgType.CLOSE:
        return fatal("CLOSE", "CONNECTION_CLOSED");
      case MsgType.MR_REQUEST: {
        if (!ACCESS_OK.has(dv.getUint32(8))) return fatal(`MR_REQUEST asks for access flags 0x${dv.getUint32(8).toString(16)}`);
        if (m.liveTokens.has(token)) return fatal(`MR_REQUEST reuses live token ${token}`);
        if (m.requestTokens.has(token)) {
          m.tainted = true;
          return { k: "unknown", why: `MR_REQUEST repeats token ${token} (granted and live or not)` };
        }
        m.requestTokens.add(token);
        return OK;
      }
      case MsgType.MR_LEND:
        return ACCESS_OK.has(dv.getUint32(8)) ? OK : fatal(`MR_LEND with access flags 0x${dv.getUint32(8).toString(16)}`);
      case MsgType.LIMITS:
        return fatal("LIMITS sent twice (the peer sent its own at the start)");
      case MsgType.MR_RELEASE:
        for (const [t, id] of m.liveTokens) if (id === token) m.liveTokens.delete(t);
        return OK;
      case MsgType.MR_GIVE_BACK:
        if (a !== 1) for (const [t, id] of m.liveTokens) if (id === token) m.liveTokens.delete(t);
        return OK;
      default:
        // CREDIT, PING, PONG, MR_GRANT (no request of the server's: it releases the grant), MR_DENY,
        // MR_LEND (the server's user takes and returns them), MR_RETURN, RNDV_CANCEL: harmless.
        return OK;
    }
  })();
  // Credits out of turn are checked first: they may already be one too many (PROTOCOL).
  if (v.k === "fatal") return unsure ? { ...v, codes: [...new Set([...v.codes, "PROTOCOL"])] } : v;
  return unsure ?? v;
}

// ------------------------------------------------------------ the generators

/** One thing the peer does. `honest`: its credits field is filled by the peer. */
type Action =
  | { k: "bytes"; bytes: Uint8Array; honest: boolean; label: string }
  | { k: "writeImm"; imm: number }
  | { k: "request"; size: number; lease: number }
  | { k: "rndv"; off: number; len: number; imm: number | null }
  | { k: "release"; pick: number; giveBack: boolean }
  | { k: "reuseLive" }
  | { k: "flood"; what: "ping" | "data" | "request" | "lend" | "writeImm"; n: number };

function enc(m: Partial<Msg> & { type: number }, payload = 0, fillByte = 0): Uint8Array {
  const full: Msg = { flags: 0, credits: 0, imm: 0, token: 0, a: 0, b: 0, addr: 0, rkey: 0, id: 0, ...m };
  const out = new Uint8Array(HDR + 16 + payload);
  const n = encodeMsg(out, full);
  if (payload > 0) out.fill(fillByte, n, n + payload);
  return out.subarray(0, n + payload);
}

const u32 = fc.integer({ min: 0, max: U32 });
const addr53 = fc.oneof(fc.constant(0), fc.integer({ min: 0, max: Number.MAX_SAFE_INTEGER }), fc.integer({ min: 0, max: U32 }));
/** Random values in the fields a type ignores ("unknown fields"). */
const noise = fc.record({ imm: u32, a: u32, b: u32 });

/** Well-formed control messages that the spec says change nothing fatal (credits filled in honestly). */
function harmless(eagerMax: number): fc.Arbitrary<Action> {
  const bytes = (arb: fc.Arbitrary<Uint8Array>, label: string): fc.Arbitrary<Action> => arb.map((b) => ({ k: "bytes", bytes: b, honest: true, label }));
  return fc.oneof(
    bytes(fc.tuple(fc.integer({ min: 0, max: PROBE_TOKEN_BASE - 1 }), noise).map(([token, n]) => enc({ type: MsgType.PING, token, ...n })), "PING"),
    bytes(fc.tuple(u32, noise).map(([token, n]) => enc({ type: MsgType.PONG, token, ...n })), "PONG"),
    bytes(fc.tuple(u32, noise).map(([token, n]) => enc({ type: MsgType.CREDIT, token, ...n })), "CREDIT"),
    bytes(fc.tuple(u32, u32, u32).map(([token, a, b]) => enc({ type: MsgType.MR_DENY, token, a, b })), "MR_DENY"),
    bytes(fc.tuple(u32, noise).map(([token, n]) => enc({ type: MsgType.MR_RELEASE, token, ...n })), "MR_RELEASE (unknown id)"),
    bytes(fc.tuple(u32, noise).map(([token, n]) => enc({ type: MsgType.MR_RETURN, token, ...n })), "MR_RETURN (unknown lend)"),
    bytes(fc.tuple(u32, u32, u32).map(([token, a, b]) => enc({ type: MsgType.MR_GIVE_BACK, token, a, b })), "MR_GIVE_BACK (unknown region)"),
    bytes(fc.tuple(u32, noise).map(([token, n]) => enc({ type: MsgType.RNDV_CANCEL, token, ...n })), "RNDV_CANCEL (unknown)"),
    bytes(fc.tuple(u32, u32, u32, u32, addr53, u32, u32).map(([token, id, a, b, addr, rkey, imm]) => enc({ type: MsgType.MR_GRANT, token, id, a, b, addr, rkey, imm })), "MR_GRANT (never requested)"),
    bytes(fc.tuple(u32, u32, u32, addr53, u32, u32).map(([token, a, b, addr, rkey, id]) => enc({ type: MsgType.MR_LEND, token, a, b, addr, rkey, id })), "MR_LEND (forged)"),
    bytes(
      fc.tuple(fc.integer({ min: 0, max: eagerMax }), fc.option(u32, { nil: null }), fc.integer({ min: 0, max: 255 }), u32).map(([n, imm, fill, b]) =>
        enc({ type: MsgType.DATA, a: n, b, flags: imm === null ? 0 : 1, imm: imm ?? 0 }, n, fill),
      ),
      "DATA",
    ),
    fc.record({ k: fc.constant("writeImm" as const), imm: u32 }),
    fc.record({ k: fc.constant("request" as const), size: fc.oneof(fc.integer({ min: 0, max: 4096 }), fc.integer({ min: 1, max: 1 << 20 }), u32), lease: fc.oneof(fc.constant(0), u32) }),
    fc.record({ k: fc.constant("rndv" as const), off: fc.nat(), len: fc.integer({ min: 1, max: 1 << 16 }), imm: fc.option(u32, { nil: null }) }),
    fc.record({ k: fc.constant("release" as const), pick: fc.nat(), giveBack: fc.boolean() }),
  );
}

/** Messages the spec says end the connection (with the code named), built from well-formed ones. */
function poison(eagerMax: number): fc.Arbitrary<Action> {
  const base = fc.tuple(fc.integer({ min: 1, max: 15 }), u32, u32, u32, fc.integer({ min: 0, max: U32 })).map(([type, token, a, b, rkey]) => enc({ type, token, a: type === MsgType.DATA ? 0 : a, b, rkey }));
  const mut = (label: string, arb: fc.Arbitrary<Uint8Array>): fc.Arbitrary<Action> => arb.map((bytes) => ({ k: "bytes", bytes, honest: false, label }));
  const set = (b: Uint8Array, i: number, v: number): Uint8Array => {
    const c = Uint8Array.from(b);
    c[i] = v;
    return c;
  };
  return fc.oneof(
    mut("bad magic", fc.tuple(base, fc.integer({ min: 0, max: 255 }).filter((x) => x !== 0xa7)).map(([b, v]) => set(b, 0, v))),
    mut("bad version", fc.tuple(base, fc.integer({ min: 0, max: 255 }).filter((x) => x !== 2)).map(([b, v]) => set(b, 1, v))),
    mut("unknown type", fc.tuple(fc.oneof(fc.constant(0), fc.integer({ min: 16, max: 255 })), fc.constantFrom(24, 40, 60)).map(([t, n]) => set(new Uint8Array(n).fill(0), 2, t)).map((b) => ((b[0] = 0xa7), (b[1] = 2), b))),
    mut("unknown flags", fc.tuple(base, fc.integer({ min: 2, max: 255 })).map(([b, f]) => set(b, 3, f))),
    mut("immediate flag on a control message", fc.tuple(fc.integer({ min: 2, max: 15 }), u32).map(([type, token]) => enc({ type, token, flags: 1 }))),
    mut("shorter than a header", fc.uint8Array({ minLength: 0, maxLength: 23 })),
    mut("shorter than a header, valid start", fc.tuple(base, fc.integer({ min: 0, max: 23 })).map(([b, n]) => b.slice(0, n))),
    mut(
      "wrong length for its type",
      fc.tuple(fc.integer({ min: 2, max: 15 }), fc.integer({ min: 24, max: 200 }), u32).map(([type, n, token]) => {
        const want = DESC_TYPES.has(type) ? 40 : 24;
        const len = n === want ? n + 1 : n;
        const b = new Uint8Array(len);
        b.set(enc({ type, token }).subarray(0, Math.min(want, len)));
        return b;
      }),
    ),
    mut(
      "DATA claiming another length",
      fc.tuple(fc.integer({ min: 0, max: eagerMax }), u32).filter(([n, a]) => a !== n).map(([n, a]) => {
        const b = enc({ type: MsgType.DATA }, n, 0x5a);
        new DataView(b.buffer, b.byteOffset).setUint32(16, a);
        return b;
      }),
    ),
    mut("credits beyond our receive depth", fc.tuple(fc.integer({ min: PEER_DEPTH + 1, max: U32 }), fc.integer({ min: 0, max: PROBE_TOKEN_BASE - 1 })).map(([credits, token]) => enc({ type: MsgType.PING, token, credits }))),
    mut(
      "address beyond 2^53",
      fc.tuple(fc.constantFrom(MsgType.RNDV, MsgType.MR_GRANT, MsgType.MR_LEND), fc.integer({ min: 0x200000, max: U32 }), u32, fc.integer({ min: 1, max: 4096 })).map(([type, hi, lo, a]) => {
        const b = enc({ type, a });
        const dv = new DataView(b.buffer, b.byteOffset);
        dv.setUint32(24, hi);
        dv.setUint32(28, lo);
        return b;
      }),
    ),
    mut("rendezvous of 0 bytes", fc.tuple(u32, addr53, u32).map(([token, addr, rkey]) => enc({ type: MsgType.RNDV, token, a: 0, addr, rkey }))),
    mut("rendezvous beyond maxMessageSize", fc.tuple(fc.integer({ min: (64 << 20) + 1, max: U32 }), addr53, u32).map(([a, addr, rkey]) => enc({ type: MsgType.RNDV, a, addr, rkey }))),
    mut("rendezvous READ with a forged key or address", fc.tuple(fc.integer({ min: 1, max: 1 << 20 }), addr53, u32, u32).map(([a, addr, rkey, token]) => enc({ type: MsgType.RNDV, token, a, addr, rkey }))),
    mut("RNDV_DONE for nothing", fc.tuple(u32, u32).map(([token, a]) => enc({ type: MsgType.RNDV_DONE, token, a }))),
    mut("CLOSE", fc.tuple(u32, noise).map(([token, n]) => enc({ type: MsgType.CLOSE, token, ...n }))),
    mut("longer than the server's receive buffers", fc.integer({ min: HDR + eagerMax + 1, max: SEND_SLOT_BYTES }).map((n) => enc({ type: MsgType.DATA, a: n - HDR }, n - HDR, 1))),
    fc.constant<Action>({ k: "reuseLive" }),
  );
}

/** Random edits of any of the above: byte writes, u32 overwrites, truncation, extension. */
function mutation(eagerMax: number): fc.Arbitrary<Action> {
  const src = fc.oneof(harmless(eagerMax), poison(eagerMax)).filter((a): a is Extract<Action, { k: "bytes" }> => a.k === "bytes");
  const edit = fc.oneof(
    fc.record({ op: fc.constant("byte" as const), at: fc.nat(), v: fc.integer({ min: 0, max: 255 }) }),
    fc.record({ op: fc.constant("u32" as const), at: fc.nat(), v: u32 }),
    fc.record({ op: fc.constant("cut" as const), at: fc.nat(), v: fc.constant(0) }),
    fc.record({ op: fc.constant("grow" as const), at: fc.integer({ min: 1, max: 64 }), v: fc.integer({ min: 0, max: 255 }) }),
  );
  return fc.tuple(src, fc.array(edit, { minLength: 1, maxLength: 4 })).map(([a, edits]) => {
    let b = Uint8Array.from(a.bytes);
    for (const e of edits) {
      if (e.op === "byte" && b.length > 0) b[e.at % Math.min(b.length, 40)] = e.v;
      else if (e.op === "u32" && b.length >= 4) new DataView(b.buffer).setUint32((e.at % Math.floor(Math.min(b.length, 40) / 4)) * 4, e.v);
      else if (e.op === "cut") b = b.slice(0, e.at % (b.length + 1));
      else if (e.op === "grow") {
        const g = new Uint8Array(Math.min(SEND_SLOT_BYTES, b.length + e.at)).fill(e.v);
        g.set(b.subarray(0, g.length));
        b = g;
      }
    }
    return { k: "bytes", bytes: b, honest: false, label: `mutated ${a.label}` };
  });
}

function flood(): fc.Arbitrary<Action> {
  return fc.record({ k: fc.constant("flood" as const), what: fc.constantFrom("ping", "data", "request", "lend", "writeImm"), n: fc.integer({ min: 50, max: 600 }) });
}

type Case = { kind: "harmless" | "poisoned" | "mutated"; actions: Action[] };

function show(a: Action): string {
  switch (a.k) {
    case "bytes":
      return `${a.label}${a.honest ? "" : " (credits as is)"} ${hex(a.bytes)}`;
    case "flood":
      return `flood of ${a.n} ${a.what}`;
    default:
      return JSON.stringify(a);
  }
}

/** Counterexamples print as one line per action, not as kilobytes of arrays. */
function printable(c: Case): Case {
  return Object.assign(c, { [fc.toStringMethod]: () => `${c.kind} case:\n  ${c.actions.map(show).join("\n  ")}` });
}

function cases(eagerMax: number): fc.Arbitrary<Case> {
  return fc.oneof(
    { weight: 4, arbitrary: fc.array(fc.oneof({ weight: 30, arbitrary: harmless(eagerMax) }, { weight: 1, arbitrary: flood() }), { minLength: 1, maxLength: 400, size: "medium" }).map((actions): Case => printable({ kind: "harmless", actions })) },
    { weight: 3, arbitrary: fc.tuple(fc.array(harmless(eagerMax), { maxLength: 40, size: "medium" }), poison(eagerMax)).map(([h, p]): Case => printable({ kind: "poisoned", actions: [...h, p] })) },
    { weight: 3, arbitrary: fc.tuple(fc.array(harmless(eagerMax), { maxLength: 20 }), fc.array(mutation(eagerMax), { minLength: 1, maxLength: 6 })).map(([h, m]): Case => printable({ kind: "mutated", actions: [...h, ...m] })) },
  );
}

// ------------------------------------------------------------- the server side

interface Served {
  rdma: Rdma;
  peer: RawAgentPeer;
  model: Model;
  ctx: Ctx;
  /** Rejections of the server user's waits: each must be an RdmaError. */
  errors: unknown[];
  delivered: number;
  cases: number;
  nextTok: number;
}

/** The server's user: reads every message, immediate and region, and drops them (returning lent regions). */
function serve(rdma: Rdma, w: Waiter, errors: unknown[], counts: { delivered: number }): void {
  const loop = async (take: () => Promise<{ dispose(): void } | number>): Promise<void> => {
    for (;;) {
      const v = await take();
      counts.delivered++;
      if (typeof v !== "number") v.dispose();
    }
  };
  const onErr = (e: unknown): void => {
    errors.push(e);
    w.poke();
  };
  loop(() => rdma.receive()).catch(onErr);
  loop(() => rdma.receiveWriteImm()).catch(onErr);
  loop(() => rdma.receiveRemoteMr()).catch(onErr);
  loop(() => rdma.receiveLocalMr()).catch(onErr);
}

describe(`agent control protocol fuzz [${PROVIDER}]`, { timeout: 900_000 * SLOW }, () => {
  let listener: RdmaListener;
  let peerDev: Device;
  let serverDev: Device | null = null;
  /** The server device's tables with no connection open (after a first one came and went). */
  let base: Tables;
  let cur: Served | null = null;
  let inputs = 0;
  let connections = 0;
  const outcomes = new Map<string, number>();
  const watch = watchUnhandled();

  function countOutcome(k: string): void {
    outcomes.set(k, (outcomes.get(k) ?? 0) + 1);
  }

  before(async () => {
    const b = new RdmaBuilder().setProvider(PROVIDER).setConnectionManager("tcp");
    const [sname, pname] = deviceNames();
    if (PROVIDER === "verbs" && sname) b.setDevice(sname);
    listener = await b.bind("127.0.0.1:0");
    peerDev = await openDevice(pname);
    const first = await open();
    serverDev = first.rdma.ctx.device;
    await retire(first);
    base = tables(serverDev);
  });

  after(async () => {
    if (cur) await retire(cur);
    await listener?.close();
    peerDev?.close();
    watch.stop();
  });

  async function open(): Promise<Served> {
    const accepted = listener.accept({ timeoutMs: CASE_MS });
    const peer = await RawAgentPeer.connect(peerDev, listener.port, { recvDepth: PEER_DEPTH, rndvBytes: 256 * 1024 });
    const rdma = await accepted;
    connections++;
    const errors: unknown[] = [];
    const counts = { delivered: 0 };
    const s: Served = {
      rdma,
      peer,
      model: { requestTokens: new Set(), liveTokens: new Map(), tainted: false, rndvExpected: 0 },
      ctx: { rndv: { addr: peer.rndvMr.addr, rkey: peer.rndvMr.rkey, length: peer.rndvMr.length }, serverEagerMax: peer.server.eagerMax, serverMaxMessage: peer.server.maxMessageSize },
      errors,
      get delivered() {
        return counts.delivered;
      },
      cases: 0,
      nextTok: 1,
    };
    serve(rdma, peer.w, errors, counts);
    return s;
  }

  /** Ends a connection (both sides) and checks that nothing it held is still counted. */
  async function retire(s: Served): Promise<void> {
    if (cur === s) cur = null;
    // close() resolves once the connection tore down (or its close timeout forced it to)
    await deadline(s.rdma.close(), CASE_MS, "the server side to close");
    s.peer.close();
    assert.ok(s.rdma.isClosed, "the server side tore down");
    for (const e of s.errors) assert.ok(e instanceof RdmaError, `a wait of the server's user rejected with a non-RdmaError: ${String(e)}`);
    assert.equal(peerMemoryUsage().used, 0, "the process-wide peer memory budget is back to 0 once the connection closed");
  }

  /** Runs one action; returns the model's verdict for it (the first fatal one decides the case). */
  async function act(s: Served, a: Action): Promise<Verdict[]> {
    const p = s.peer;
    const failed = (): boolean => s.rdma.conn.failure !== null;
    const send = (bytes: Uint8Array, honest: boolean): Verdict => {
      const v = verdict(bytes, honest, s.model, s.ctx);
      p.sendRaw(bytes, honest);
      inputs++;
      return v;
    };
    switch (a.k) {
      case "bytes":
        return [send(a.bytes, a.honest)];
      case "writeImm":
        p.writeImm(a.imm);
        inputs++;
        return [OK];
      case "request": {
        const token = nextToken(s);
        return [send(enc({ type: MsgType.MR_REQUEST, token, a: a.size, b: a.lease, imm: 0xe }), true)];
      }
      case "rndv": {
        const off = a.off % p.rndvMr.length;
        const len = Math.max(1, Math.min(a.len, p.rndvMr.length - off));
        return [send(enc({ type: MsgType.RNDV, token: nextToken(s), a: len, b: a.imm === null ? 0 : 1, imm: a.imm ?? 0, addr: p.rndvMr.addr + off, rkey: p.rndvMr.rkey }), true)];
      }
      case "release": {
        const ids = [...p.grants.values()].map((g) => g.id);
        const id = ids.length ? ids[a.pick % ids.length]! : a.pick;
        return [send(enc({ type: a.giveBack ? MsgType.MR_GIVE_BACK : MsgType.MR_RELEASE, token: id, a: 0 }), true)];
      }
      case "reuseLive": {
        // A grant we know is live (lease: an hour), then its request token again.
        const token = nextToken(s);
        const v = send(enc({ type: MsgType.MR_REQUEST, token, a: 8, b: 3_600_000, imm: 0xe }), true);
        const answer = await p.answerTo(token, failed, CASE_MS);
        if (answer === "granted") s.model.liveTokens.set(token, p.grants.get(token)!.id);
        return [v, send(enc({ type: MsgType.MR_REQUEST, token, a: 8, b: 0, imm: 0xe }), true)];
      }
      case "flood": {
        const out: Verdict[] = [];
        for (let i = 0; i < a.n; i++) {
          if (a.what === "ping") out.push(send(enc({ type: MsgType.PING, token: i }), true));
          else if (a.what === "data") out.push(send(enc({ type: MsgType.DATA, a: i % 64 }, i % 64, i & 0xff), true));
          else if (a.what === "request") out.push(send(enc({ type: MsgType.MR_REQUEST, token: nextToken(s), a: 1 + (i % 512), imm: 0xe }), true));
          else if (a.what === "lend") out.push(send(enc({ type: MsgType.MR_LEND, token: i + 1, a: 64, b: 60_000, addr: 0x1000 + i * 64, rkey: 77, imm: 0xe }), true));
          else {
            p.writeImm(i);
            inputs++;
            out.push(OK);
          }
          // Keep the queue of the peer bounded: wait for credits every so often.
          if (p.queued > 512) await p.w.until(() => p.queued <= 64 || failed() || p.dead !== null, "credits from the server during a flood", CASE_MS);
        }
        return out;
      }
    }
  }

  /** Fresh request/rendezvous tokens, deterministic (a case must replay from its seed). */
  function nextToken(s: Served): number {
    let t: number;
    do t = s.nextTok++;
    while (s.model.requestTokens.has(t));
    return t;
  }

  it("regression: a message that arrives just before the connection fails cannot crash the process (a PING, then a SEND longer than the receive buffer)", async () => {
    // Found by the fuzz below: the PING's completion was handled after the failure, its PONG was
    // queued after fail() had emptied the queues, and the next flush wrote into a buffer the
    // teardown had freed (uncaught TypeError: detached ArrayBuffer).
    const eagerMax = 4096;
    for (let i = 0; i < 20; i++) {
      const s = await open();
      s.peer.sendRaw(enc({ type: MsgType.PING, token: i }), true);
      s.peer.sendRaw(enc({ type: MsgType.DATA, a: eagerMax + 100 }, eagerMax + 100), false);
      await s.peer.w.until(() => s.rdma.conn.failure !== null, "the server side to fail", CASE_MS);
      await retire(s);
      // the flush that crashed ran in a microtask after the teardown: give it its turn
      await new Promise((r) => setImmediate(r));
      watch.check();
    }
  });

  it("control messages: harmless ones keep the connection, fatal ones end it with their code, mutations end typed or harmless; peer memory back to 0", async () => {
    const numRuns = runs(900, 60);
    const eagerMax = 4096;
    let rss0 = 0;
    let warm = false;
    let traced = 0;
    await fc.assert(
      fc.asyncProperty(cases(eagerMax), async (c) => {
        cur ??= await open();
        const s = cur;
        // RSS baseline once warm (JIT, heap and allocator growth of the first cases are not leaks)
        if (!warm && traced >= Math.min(100, numRuns / 5)) {
          warm = true;
          rss0 = await settledRssMiB();
        }
        s.cases++;
        if (++traced % 200 === 0 && process.env.FUZZ_RSS_TRACE) {
          const mu = process.memoryUsage();
          console.log(`# case ${traced}: rss ${(mu.rss / 2 ** 20).toFixed(0)} heap ${(mu.heapUsed / 2 ** 20).toFixed(0)} ext ${(mu.external / 2 ** 20).toFixed(0)} ab ${(mu.arrayBuffers / 2 ** 20).toFixed(0)}`);
        }
        let expect: { k: "ok" } | { k: "fatal"; codes: string[]; why: string } | { k: "unknown"; why: string; mustFail: boolean } = OK;
        for (const a of c.actions) {
          const vs = await act(s, a);
          for (const v of vs) {
            if (expect.k === "fatal") break;
            if (v.k === "fatal") expect = expect.k === "unknown" ? { k: "unknown", why: `${expect.why}, then ${v.why}`, mustFail: true } : v;
            else if (v.k === "unknown" && expect.k === "ok") expect = { k: "unknown", why: v.why, mustFail: false };
          }
          if (expect.k === "fatal" || (expect.k === "unknown" && expect.mustFail)) break;
        }
        const failed = (): boolean => s.rdma.conn.failure !== null;
        let healthy = await deadline(s.peer.probe(failed, CASE_MS), CASE_MS + 1000, "the probe");
        // Rendezvous READs complete after the PONG: wait for each one's RNDV_DONE (or the failure a forged one causes).
        const done = (): number => s.peer.receivedByType.get(MsgType.RNDV_DONE) ?? 0;
        if (healthy) {
          // (a READ outside our region fails the connection instead: waiting for it settles the case too)
          await s.peer.w.until(() => done() >= s.model.rndvExpected || failed(), `RNDV_DONE for ${s.model.rndvExpected} rendezvous (got ${done()})`, CASE_MS);
          healthy = !failed();
        }
        const failure = s.rdma.conn.failure;
        const what = `${c.kind} case of ${c.actions.length} actions`;
        if (expect.k === "ok") {
          assert.ok(healthy, `${what}: the connection should be healthy, but: ${failure?.code} ${failure?.message ?? s.peer.dead}`);
          countOutcome("healthy as predicted");
        } else if (expect.k === "fatal") {
          assert.ok(!healthy, `${what}: should have failed (${expect.why}), but the connection is healthy`);
          assert.ok(failure instanceof RdmaError, `${what}: failed without a typed error (peer: ${s.peer.dead})`);
          assert.ok(expect.codes.includes(failure.code), `${what}: ${expect.why}: expected ${expect.codes.join("/")}, got ${failure.code}: ${failure.message}`);
          countOutcome(`failed as predicted: ${failure.code}`);
        } else {
          if (expect.mustFail) assert.ok(!healthy, `${what}: should have failed (${expect.why})`);
          if (!healthy) {
            assert.ok(failure instanceof RdmaError, `${what}: failed without a typed error (peer: ${s.peer.dead})`);
            countOutcome(`unknown → failed: ${failure.code}`);
          } else countOutcome("unknown → healthy");
        }
        watch.check();
        if (!healthy || s.model.tainted || s.cases >= 25) await retire(s);
      }),
      fcParams(0x5eed0a, numRuns),
    );
    if (cur) await retire(cur);
    const rss = await settledRssMiB();
    assert.deepEqual(tables(serverDev), base, "contexts, QPs, CQs, registrations and peer memory back to the baseline");
    const mu = process.memoryUsage();
    console.log(`# heap ${(mu.heapUsed / 2 ** 20).toFixed(0)} MiB, external ${(mu.external / 2 ** 20).toFixed(0)} MiB, arrayBuffers ${(mu.arrayBuffers / 2 ** 20).toFixed(0)} MiB`);
    console.log(`# ${inputs} control messages in ${numRuns} cases over ${connections} connections; RSS ${rss0.toFixed(0)} → ${rss.toFixed(0)} MiB; outcomes ${JSON.stringify(Object.fromEntries(outcomes))}`);
    assert.ok(rss - rss0 < 100, `RSS grew by ${(rss - rss0).toFixed(0)} MiB after the warm-up`);
    watch.check();
  });

  it("the server asks a lying peer for memory: grants that lie about size, address, key, lease, token or id end with the write landing exactly where a real grant allows, or a typed error", async () => {
    const numRuns = runs(200, 30);
    type Reply =
      | { k: "grant"; tokenDelta: number; sizeDelta: number; off: number; foreignKey: boolean; lease: number; id: number; twice: boolean }
      | { k: "deny"; reason: number }
      | { k: "silence" };
    const reply: fc.Arbitrary<Reply> = fc.oneof(
      {
        weight: 20,
        arbitrary: fc.record({
          k: fc.constant("grant" as const),
          tokenDelta: fc.oneof({ weight: 19, arbitrary: fc.constant(0) }, { weight: 1, arbitrary: fc.integer({ min: 1, max: 1000 }) }),
          sizeDelta: fc.oneof({ weight: 3, arbitrary: fc.constant(0) }, { weight: 1, arbitrary: fc.integer({ min: -4096, max: 1 << 20 }) }),
          off: fc.oneof(fc.integer({ min: 0, max: 64 * 1024 }), fc.integer({ min: -(1 << 20), max: 1 << 20 })),
          foreignKey: fc.oneof({ weight: 4, arbitrary: fc.constant(false) }, { weight: 1, arbitrary: fc.constant(true) }),
          lease: fc.oneof({ weight: 1, arbitrary: fc.constant(0) }, { weight: 4, arbitrary: fc.integer({ min: 600_000, max: U32 }) }),
          id: u32,
          twice: fc.boolean(),
        }),
      },
      { weight: 2, arbitrary: fc.record({ k: fc.constant("deny" as const), reason: fc.oneof(fc.constantFrom(1, 2, 3), u32) }) },
      { weight: 1, arbitrary: fc.constant({ k: "silence" as const }) },
    );
    const DENY_CODES: Record<number, string> = { 1: "QUOTA_EXCEEDED", 2: "OUT_OF_RANGE", 4: "NOT_FOUND", 6: "OUT_OF_RANGE", 7: "QUOTA_EXCEEDED" };
    // a connection left by an earlier test that failed is not this test's
    if (cur) await retire(cur).catch(() => (cur = null));
    let cases = 0;
    const seen = new Map<string, number>();
    await fc.assert(
      fc.asyncProperty(fc.integer({ min: 1, max: 8192 }), reply, async (size, r) => {
        cur ??= await open();
        const s = cur;
        s.cases++;
        cases++;
        const p = s.peer;
        const g = p.grantMr;
        const gv = new Uint8Array(g.buffer, g.offset, g.length);
        gv.fill(0xee);
        const asked = p.requests.length;
        const req = s.rdma.requestRemoteMr(size, { timeoutMs: r.k === "silence" || (r.k === "grant" && r.tokenDelta !== 0) ? 100 * SLOW : CASE_MS, leaseMs: 3_600_000 });
        // Settled in its own time (the short timeout may fire while we wait for the MR_REQUEST): handled now, examined below.
        const answered = req.then(
          (rmr) => ({ rmr }),
          (err: unknown) => ({ err }),
        );
        await p.w.until(() => p.requests.length > asked, "the server's MR_REQUEST", CASE_MS);
        const m = p.requests[asked]!;
        assert.equal(m.a, size, "the MR_REQUEST names the size asked for");
        let expect: string;
        let landed: [number, number] | null = null;
        if (r.k === "deny") {
          p.send({ type: MsgType.MR_DENY, token: m.token, a: r.reason });
          inputs++;
          expect = DENY_CODES[r.reason] ?? "RESOURCE_EXHAUSTED";
        } else if (r.k === "silence" || r.tokenDelta !== 0) {
          if (r.k === "grant") {
            p.send({ type: MsgType.MR_GRANT, token: (m.token + r.tokenDelta) >>> 0, id: r.id, a: size, b: 0, addr: g.addr, rkey: g.rkey, imm: 0xe });
            inputs++;
          }
          expect = "TIMEOUT";
        } else {
          const a = Math.max(0, size + r.sizeDelta);
          const addr = Math.max(0, g.addr + r.off);
          const rkey = r.foreignKey ? (g.rkey ^ 0x5a5a5a5a) >>> 0 : g.rkey;
          p.send({ type: MsgType.MR_GRANT, token: m.token, id: r.id, a, b: r.lease, addr, rkey, imm: 0xe });
          if (r.twice) p.send({ type: MsgType.MR_GRANT, token: m.token, id: (r.id + 1) >>> 0, a, b: r.lease, addr, rkey, imm: 0xe });
          inputs += r.twice ? 2 : 1;
          // A grant of another size than requested is a protocol breach (docs/wire-format.md, version 4).
          if (a !== size) expect = "PROTOCOL";
          else if (r.lease === 0) expect = "LEASE_EXPIRED";
          else if (rkey === g.rkey && addr >= g.addr && addr + size <= g.addr + g.length) {
            expect = "ok";
            landed = [addr - g.addr, addr - g.addr + size];
          } else expect = "REMOTE_ACCESS";
        }
        let got: string;
        try {
          const a = await deadline(answered, CASE_MS, "requestRemoteMr to settle");
          if ("err" in a) throw a.err;
          const rmr = a.rmr;
          const lmr = s.rdma.allocLocalMr(size);
          lmr.bytes.fill(0x42);
          try {
            await deadline(s.rdma.write(lmr, rmr), CASE_MS, "the write to settle");
            got = "ok";
          } catch (e) {
            assert.ok(e instanceof RdmaError, `the write rejected with a non-RdmaError: ${String(e)}`);
            got = e.code;
          } finally {
            lmr.dispose();
            rmr.dispose();
          }
        } catch (e) {
          assert.ok(e instanceof RdmaError, `requestRemoteMr rejected with a non-RdmaError: ${String(e)}`);
          got = e.code;
        }
        const what = `size ${size}, reply ${JSON.stringify(r)}`;
        assert.equal(got, expect, what);
        seen.set(got, (seen.get(got) ?? 0) + 1);
        // Only a grant that names our region lets bytes land, and exactly in the range it names.
        for (let i = 0; i < gv.length; i++) {
          const inside = landed !== null && i >= landed[0] && i < landed[1];
          if (gv[i] !== (inside ? 0x42 : 0xee)) assert.fail(`${what}: byte ${i} of the peer's region is ${gv[i]}`);
        }
        watch.check();
        if (got === "REMOTE_ACCESS" || got === "PROTOCOL") {
          assert.ok(s.rdma.conn.failure instanceof RdmaError, "a refused write or a lying grant fails the connection, typed");
          await retire(s);
        } else if (s.cases >= 50) await retire(s);
      }),
      fcParams(0x9a7e, numRuns),
    );
    if (cur) await retire(cur);
    assert.deepEqual(tables(serverDev), base, "contexts, QPs, CQs, registrations and peer memory back to the baseline");
    console.log(`# ${cases} requests answered by a lying peer: ${JSON.stringify(Object.fromEntries(seen))}`);
  });
});
