/**
 * The liveness rule of agent/liveness.ts on a scripted clock and host: each
 * rule a test that fails when the rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import type { RdmaError } from "../../src/index.js";
import { Liveness } from "../../src/agent/liveness.js";

function scripted(keepaliveMs: number, peerTimeoutMs: number) {
  let t = 1000;
  const host = { down: false, outstanding: 0, pings: 0, expired: null as RdmaError | null };
  const live = new Liveness(
    {
      isDown: () => host.down,
      outstanding: () => host.outstanding,
      ping: () => void host.pings++,
      expire: (e) => void (host.expired = e),
    },
    keepaliveMs,
    peerTimeoutMs,
    () => t,
  );
  live.start();
  live.stop(); // the test drives the checks
  const every = keepaliveMs === 0 && peerTimeoutMs === 0 ? 0 : Math.min(keepaliveMs || Infinity, Math.max(10, peerTimeoutMs / 4));
  let next = t + every;
  /** Advances the clock by `ms`, running each check on time (every `every` ms from the start). */
  const advance = (ms: number): void => {
    const end = t + ms;
    while (every > 0 && next <= end) {
      t = next;
      next += every;
      live.check();
      if (host.expired) return;
    }
    t = end;
  };
  /** The event loop stalls: the clock jumps and the next check comes late. */
  const stall = (ms: number): void => {
    t += ms;
    next = t;
  };
  return { live, host, advance, stall, now: () => t, every, expired: (): RdmaError | null => host.expired };
}

describe("agent liveness (agent/liveness.ts)", () => {
  it("an idle connection PINGs once nothing arrived for keepalive, and an answer clears it", () => {
    const s = scripted(2000, 15_000);
    s.advance(1999);
    assert.equal(s.host.pings, 0);
    s.advance(1);
    assert.equal(s.host.pings, 1);
    s.advance(2000);
    assert.equal(s.host.pings, 1, "one PING until the answer");
    s.live.arrived();
    s.advance(2000);
    assert.equal(s.host.pings, 2);
  });

  it("a silent peer fails the connection after keepalive + peer timeout, counted from when the PING was due", () => {
    const s = scripted(2000, 15_000);
    const t0 = s.now();
    s.advance(60_000);
    const e = s.expired();
    assert.ok(e, "expired");
    assert.equal(e.code, "RETRY_EXCEEDED");
    const took = s.now() - t0;
    assert.ok(took > 17_000 && took <= 17_000 + s.every, `noticed after ${took} ms: keepalive + peer timeout (17 s), at most one check (${s.every} ms) later`);
  });

  it("a PING due between two checks still counts the peer timeout from when it was due", () => {
    // Checks every 2000 ms; the last arrival falls between two checks, so the PING is due 1700 ms
    // before the check that sends it.
    const s = scripted(2000, 15_000);
    s.advance(300);
    s.live.arrived();
    const t0 = s.now();
    s.advance(60_000);
    const took = s.now() - t0;
    assert.ok(s.expired());
    assert.ok(took <= 17_000 + s.every, `noticed ${took} ms after the last arrival: more than one check after keepalive + peer timeout`);
  });

  it("progress keeps a busy connection alive; no progress with work outstanding fails it", () => {
    const s = scripted(2000, 8000);
    s.host.outstanding = 3;
    s.live.startWaiting();
    for (let i = 0; i < 20; i++) {
      s.advance(1000);
      s.live.progressed();
      s.live.arrived();
    }
    assert.equal(s.host.expired, null);
    s.advance(8000 + s.every);
    const e = s.expired();
    assert.ok(e && /3 work requests outstanding/.test(e.message), String(e?.message));
  });

  it("a late check (this process's own stall) is not counted against the peer", () => {
    const s = scripted(2000, 8000);
    s.host.outstanding = 1;
    s.live.startWaiting();
    s.advance(s.every);
    // The event loop did not run for 60 s: the next check comes that late.
    s.stall(60_000);
    s.advance(0);
    assert.equal(s.host.expired, null, "our own stall is not the peer's silence");
    s.advance(8000 + 2 * s.every);
    assert.ok(s.expired(), "the peer's own silence still counts after the stall");
  });

  it("nothing is checked once the connection is down", () => {
    const s = scripted(2000, 8000);
    s.host.down = true;
    s.host.outstanding = 1;
    s.advance(60_000);
    assert.equal(s.host.expired, null);
    assert.equal(s.host.pings, 0);
  });

  it("keepalive 0 and peer timeout 0 watch nothing", () => {
    const s = scripted(0, 0);
    s.live.check();
    assert.equal(s.host.pings, 0);
    assert.equal(s.host.expired, null);
  });
});
