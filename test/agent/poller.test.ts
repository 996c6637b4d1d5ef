/**
 * Busy and adaptive polling give way when the process is preempted while it
 * spins (more pollers than cores): the contention detector, and what the
 * poller does with its answer, on a scripted completion queue.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { Contention, Poller } from "../../src/agent/poller.js";
import type { CompletionBuffer, CompletionQueue, Device } from "../../src/transport/types.js";

/** A CQ with nothing in it that counts how often it was armed. */
function emptyCq(): CompletionQueue & { arms: number } {
  return {
    device: {} as Device,
    depth: 16,
    arms: 0,
    poll: (_b: CompletionBuffer) => 0,
    requestNotify() {
      this.arms++;
    },
    onNotify: null,
    destroy() {},
  };
}

/** Runs the poller's scheduled turns until it stops scheduling or `turns` ran. */
async function turns(n: number): Promise<void> {
  for (let i = 0; i < n; i++) await new Promise((r) => setImmediate(r));
}

describe("polling under CPU contention", () => {
  it("a single preemption per probe window is not contention; two are", () => {
    let sw = 0;
    const c = new Contention(() => sw, 10, 2, 20, 40);
    assert.equal(c.contended(0), false, "the first probe only takes a reading");
    sw = 1;
    assert.equal(c.contended(10), false, "one switch in the window");
    sw = 3;
    assert.equal(c.contended(20), true, "two switches in the window");
    assert.equal(c.yields, 1);
  });

  it("the detector says contended only after the involuntary switches grew, backs off exponentially and resets after a clean probe", () => {
    let sw = 100;
    const c = new Contention(() => sw, 1, 1, 10, 40);
    assert.equal(c.contended(0), false, "the first probe only takes a reading");
    assert.equal(c.contended(0.5), false, "no probe before probeMs");
    sw = 101; // preempted
    assert.equal(c.contended(0.9), false, "still inside the probe interval");
    assert.equal(c.contended(2), true, "preempted since the last probe");
    assert.equal(c.contended(11.9), true, "inside the first back-off (10 ms)");
    assert.equal(c.contended(12.1), false, "back-off over, and no new switch");
    sw = 102;
    assert.equal(c.contended(13.2), true);
    assert.equal(c.contended(22), true, "back-off 10 ms again after a clean probe");
    sw = 103;
    assert.equal(c.contended(24), true, "a second contended probe in a row…");
    assert.equal(c.contended(24 + 19), true, "…doubles the back-off (20 ms)");
    assert.equal(c.contended(24 + 21), false);
    assert.equal(c.yields, 3);
  });

  for (const mode of ["busy", "adaptive"] as const) {
    it(`${mode}: spins unarmed on an uncontended core, arms and stops spinning while preempted`, async () => {
      let sw = 0;
      const det = new Contention(() => sw, 0, 1, 1_000, 1_000);
      const cq = emptyCq();
      // spinUs large: adaptive would spin the whole test if not for the detector.
      const p = new Poller(cq, mode, 60_000_000, () => {}, () => {}, det);
      const armedAtStart = cq.arms;
      p.start();
      await turns(20);
      const armsUncontended = cq.arms - armedAtStart;
      assert.equal(armsUncontended, mode === "busy" ? 0 : 1, "busy never arms; adaptive arms once at start, then spins");
      assert.ok(process.getActiveResourcesInfo().includes("Immediate"), "still spinning");
      sw = 5; // the kernel preempted us while we spun
      await turns(5);
      assert.ok(cq.arms > armedAtStart + armsUncontended, "armed: completions now come as events");
      assert.equal(det.yields, 1);
      // Contended: the poller sleeps; no Immediate remains scheduled by it.
      await turns(3);
      assert.ok(!process.getActiveResourcesInfo().includes("Immediate"), `no spinning while contended (${process.getActiveResourcesInfo().join(", ")})`);
      p.stop();
    });
  }
});
