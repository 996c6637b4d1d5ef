/**
 * issue 20 point 2 (the agent in parts): "our own stall does not count
 * against the peer" has one home, transport/stall.ts, used by the agent's
 * liveness (agent/liveness.ts) and the tcp provider's requester timer
 * (tcp/liveness.ts). Each rule a test that fails when the rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { excuseOwnStall } from "../../src/transport/stall.js";

describe("our own stall does not count against the peer (transport/stall.ts)", () => {
  it("issue 20 point 2: a check on time leaves when the peer was last heard from unchanged", () => {
    // Checks every 100 ms; the previous one at 1000, this one at 1100: on time.
    assert.equal(excuseOwnStall(500, 1100, 1000, 100, 100), 500);
  });

  it("issue 20 point 2: a check late by at most the tolerance is jitter, not a stall: a silent peer is still found out", () => {
    assert.equal(excuseOwnStall(500, 1250, 1000, 100, 150), 500, "late by 150, tolerance 150");
    assert.equal(excuseOwnStall(500, 1150, 1000, 100, 100), 500, "late by 50, tolerance 100");
  });

  it("issue 20 point 2: a check that ran late moves the peer's last sign of life forward by the whole lateness", () => {
    // Due at 1100, ran at 5100: our event loop did not run for 4000 ms, which the peer is not charged.
    assert.equal(excuseOwnStall(500, 5100, 1000, 100, 100), 4500);
    // The tcp timer's shape: tick 25, tolerance 25 (a quarter of a 100 ms limit).
    assert.equal(excuseOwnStall(2000, 3025, 2000, 25, 25), 3000);
  });

  it("issue 20 point 2: the stall never moves the peer's last sign of life past now", () => {
    // The stall ended, the peer's answer was read at 5080, then the late check ran at 5100:
    // last + lateness (9080) would be in the future.
    assert.equal(excuseOwnStall(5080, 5100, 1000, 100, 100), 5100);
  });

  it("issue 20 point 2: over a run of checks only the stalled one is excused, so the peer timeout still runs out", () => {
    // A peer heard last at 0, checks every 100 ms, one stall of 3000 ms at the 10th check, peer timeout 2000 ms.
    let last = 0;
    let prev = 0;
    let expiredAt = -1;
    for (let now = 100; now <= 10_000 && expiredAt < 0; ) {
      last = excuseOwnStall(last, now, prev, 100, 100);
      prev = now;
      if (now - last > 2000) expiredAt = now;
      now += now === 1000 ? 3100 : 100;
    }
    // Without the stall the peer times out at 2100; the 3000 ms of our own stall are not its.
    assert.equal(expiredAt, 5100);
  });
});
