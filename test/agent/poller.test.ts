/**
 * Busy and adaptive polling give way when the process waits for a core
 * while it spins (more pollers than cores): the contention detector, and
 * what the poller does with its answer, on a scripted completion queue.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { Contention, Poller, runQueueWait, type ContentionSignal } from "../../src/agent/poller.js";
import { WcOpcode, type CompletionBuffer, type CompletionQueue, type Device } from "../../src/transport/types.js";

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

/** A scripted signal: contention is `value` growing by 5 or more in a window. */
function scripted(): ContentionSignal & { value: number } {
  return {
    name: "scripted",
    value: 0,
    read() {
      return this.value;
    },
    exceeded: (delta) => delta >= 5,
  };
}

/** Runs the event loop's check phase `n` times (the poller's scheduled turns). */
async function turns(n: number): Promise<void> {
  for (let i = 0; i < n; i++) await new Promise((r) => setImmediate(r));
}

describe("polling under CPU contention", () => {
  it("the detector judges each window of spinning by its signal, doubles the back-off on contended windows and halves it on clean ones", () => {
    const sig = scripted();
    const c = new Contention(sig, 10, 20, 80);
    assert.equal(c.contended(0), false, "the first probe only takes a reading");
    sig.value = 100;
    assert.equal(c.contended(5), false, "no probe inside probeMs");
    assert.equal(c.contended(10), true, "a window whose signal says so");
    assert.equal(c.inBackoff(29), true, "back-off of 20 ms");
    assert.equal(c.contended(29), true);
    assert.equal(c.contended(31), false, "the window after a back-off only takes a reading");
    sig.value = 200;
    assert.equal(c.contended(41), true, "contended again…");
    assert.equal(c.contended(41 + 39), true, "…for twice as long (40 ms)");
    assert.equal(c.contended(41 + 41), false, "reading after the back-off");
    sig.value = 201;
    assert.equal(c.contended(92), false, "a clean window halves the back-off (80 → 40 ms)…");
    sig.value = 300;
    assert.equal(c.contended(102), true, "…so the next one lasts 40 ms");
    assert.equal(c.inBackoff(141), true);
    assert.equal(c.inBackoff(143), false);
    assert.equal(c.contended(143), false, "reading after the back-off");
    for (let t = 153, v = 301; t <= 193; t += 10, v++) {
      sig.value = v;
      assert.equal(c.contended(t), false, `clean window at ${t}`);
    }
    sig.value = 400;
    assert.equal(c.contended(203), true, "after clean windows the back-off is down to the minimum (20 ms)");
    assert.equal(c.inBackoff(222), true);
    assert.equal(c.inBackoff(224), false);
    assert.equal(c.yields, 4);
  });

  it("a window longer than twice probeMs (the poller slept in it) is not judged, whatever its signal", () => {
    const sig = scripted();
    const c = new Contention(sig, 10, 20, 80);
    c.contended(0);
    sig.value = 1_000;
    assert.equal(c.contended(5_000), false, "5 s since the last probe: only a reading");
    sig.value = 1_001;
    assert.equal(c.contended(5_010), false, "then a clean 10 ms window");
    assert.equal(c.yields, 0);
  });

  it("a signal whose reading fails is replaced by the fallback (involuntary switches); the poller never sees the error", () => {
    const c = new Contention({ name: "broken", read: () => { throw new Error("EBADF"); }, exceeded: () => true }, 10, 20, 80);
    assert.equal(c.contended(0), false);
    assert.equal(c.signal.name, "involuntary context switches");
    assert.equal(c.contended(10), false, "the fallback's first probe only reads");
  });

  it("reset() forgets the back-off and readings (tests restore the process's detector with it)", () => {
    const sig = scripted();
    const c = new Contention(sig, 10, 20, 80);
    c.contended(0);
    sig.value = 50;
    assert.equal(c.contended(10), true);
    c.reset();
    assert.equal(c.inBackoff(11), false);
    assert.equal(c.contended(11), false, "first probe after reset only reads");
  });

  it("on Linux, the run-queue wait of this thread is readable and grows only by time spent waiting", { skip: process.platform !== "linux" && "Linux only" }, () => {
    const sig = runQueueWait();
    assert.ok(sig, "/proc/thread-self/schedstat is readable");
    const a = sig.read();
    const b = sig.read();
    assert.ok(Number.isFinite(a) && b >= a, `readings ${a} then ${b}`);
  });

  for (const mode of ["busy", "adaptive"] as const) {
    it(`${mode}: spins unarmed on an uncontended core, arms and stops spinning while contended`, async () => {
      const sig = scripted();
      const det = new Contention(sig, 0, 1_000, 1_000, Infinity);
      const cq = emptyCq();
      // spinUs large: adaptive would spin the whole test if not for the detector.
      const p = new Poller(cq, mode, 60_000_000, () => {}, () => {}, det);
      try {
        p.start();
        await turns(20);
        const armsUncontended = cq.arms;
        assert.equal(armsUncontended, mode === "busy" ? 0 : 1, "busy never arms; adaptive arms once at start, then spins");
        assert.ok(process.getActiveResourcesInfo().includes("Immediate"), "still spinning");
        sig.value = 1_000; // this thread waited for a core while it spun
        await turns(5);
        assert.ok(cq.arms > armsUncontended, "armed: completions now come as events");
        assert.equal(det.yields, 1);
        assert.ok(det.gaveWay >= 1);
        // Contended: the poller sleeps; no Immediate remains scheduled by it, and a post neither
        // polls nor schedules one.
        await turns(3);
        const armsNow = cq.arms;
        p.afterPost(1, 1);
        assert.equal(cq.arms, armsNow, "a post in a back-off period does not poll");
        await turns(2);
        assert.ok(!process.getActiveResourcesInfo().includes("Immediate"), `no spinning while contended (${process.getActiveResourcesInfo().join(", ")})`);
      } finally {
        p.stop();
      }
    });
  }
});

describe("an event-driven CQ (tcp: completions come from this thread's socket events)", () => {
  /** An empty CQ marked event-driven, counting its arms. */
  const eventCq = (): CompletionQueue & { arms: number } => Object.assign(emptyCq(), { eventDriven: true });
  const spinning = (): boolean => process.getActiveResourcesInfo().includes("Immediate");
  /** A detector that never says "contended". */
  const calm = (): Contention => new Contention({ name: "calm", read: () => 0, exceeded: () => false });

  it("event: armed, and nothing keeps the loop turning after activity", async () => {
    const cq = eventCq();
    const p = new Poller(cq, "event", 60_000_000, () => {}, () => {}, calm());
    try {
      p.start();
      p.afterPost(1, 1);
      await turns(3);
      assert.ok(cq.arms >= 1, "armed");
      assert.ok(!spinning(), `no Immediate (${process.getActiveResourcesInfo().join(", ")})`);
    } finally {
      p.stop();
    }
  });

  for (const mode of ["busy", "adaptive"] as const) {
    it(`${mode}: stays armed (completions come as events) and keeps the loop turning while it would poll`, async () => {
      const cq = eventCq();
      const p = new Poller(cq, mode, 60_000_000, () => {}, () => {}, calm());
      try {
        p.start();
        p.afterPost(1, 1);
        const arms = cq.arms;
        assert.ok(arms >= 1, "armed from the start, busy included");
        await turns(20);
        assert.ok(spinning(), "the loop keeps turning");
        // A notification (the CQ disarms itself when it notifies): the drain arms it again.
        cq.onNotify!();
        assert.ok(cq.arms > arms, "re-armed after the notification's drain: never left unarmed");
        await turns(3);
        assert.ok(spinning(), "still turning after the notification");
      } finally {
        p.stop();
      }
      await turns(2);
      assert.ok(!spinning(), `stopped: no Immediate left (${process.getActiveResourcesInfo().join(", ")})`);
    });
  }

  it("adaptive: stops turning once spinUs passed without activity, and starts again on the next post", async () => {
    const cq = eventCq();
    const p = new Poller(cq, "adaptive", 2_000, () => {}, () => {}, calm());
    try {
      p.start();
      p.afterPost(1, 1);
      assert.ok(spinning(), "turning after the post");
      const end = performance.now() + 5_000;
      while (spinning()) {
        assert.ok(performance.now() < end, "still turning long after spinUs (2 ms)");
        await new Promise((r) => setTimeout(r, 1));
      }
      p.afterPost(1, 1);
      assert.ok(spinning(), "turning again after the next post");
    } finally {
      p.stop();
    }
  });

  /** An event-driven CQ that hands out `arrivals` receive completions, then `pending` send completions, when polled. */
  const scriptedCq = (): CompletionQueue & { arms: number; pending: number; arrivals: number } => {
    const cq = Object.assign(eventCq(), { pending: 0, arrivals: 0 });
    cq.poll = (b: CompletionBuffer, max?: number) => {
      const n = Math.min(cq.arrivals + cq.pending, max ?? b.capacity);
      for (let i = 0; i < n; i++) {
        b.wrId[i] = i;
        b.opcode[i] = cq.arrivals > 0 ? WcOpcode.RECV : WcOpcode.SEND;
        if (cq.arrivals > 0) cq.arrivals--;
        else cq.pending--;
      }
      return n;
    };
    return cq;
  };
  /** The connection's state as a poller sees it: work outstanding, and a completion that acknowledges it. */
  const exchange = (cq: ReturnType<typeof scriptedCq>) => {
    const s = {
      outstanding: 0,
      post(p: Poller) {
        s.outstanding++;
        p.afterPost(1, s.outstanding);
      },
      /** The peer's ACK (or answer) arrives: one completion, nothing outstanding after it. */
      acked() {
        s.outstanding = 0;
        cq.pending++;
        cq.onNotify!();
      },
      /** One of several outstanding is acknowledged. */
      ackOne() {
        s.outstanding--;
        cq.pending++;
        cq.onNotify!();
      },
    };
    return s;
  };

  /** Waits until `ms` have passed and nothing keeps the loop turning (deadline 10 s). */
  const idleFor = async (ms: number): Promise<void> => {
    const t0 = performance.now();
    while (performance.now() - t0 < ms || spinning()) {
      assert.ok(performance.now() - t0 < 10_000, "still turning 10 s on");
      await new Promise((r) => setTimeout(r, 1));
    }
  };

  /**
   * A poller in `mode` on a scripted event-driven CQ, the connection's state
   * kept by `exchange`, after a clean start (no Immediate left by the test before).
   */
  const pollerOn = async (mode: "adaptive" | "busy", spinUs: number) => {
    const cq = scriptedCq();
    const x = exchange(cq);
    const p = new Poller(cq, mode, spinUs, () => {}, () => {}, calm(), () => x.outstanding > 0);
    await turns(2);
    assert.ok(!spinning(), `a clean start (${process.getActiveResourcesInfo().join(", ")})`);
    return { cq, x, p };
  };

  it("adaptive: in a running exchange an acknowledgement arriving alone keeps the loop turning (the answer may follow it)", async () => {
    const { cq, x, p } = await pollerOn("adaptive", 60_000_000);
    try {
      p.start();
      x.post(p);
      await turns(20);
      assert.ok(spinning(), "a send outstanding: the loop keeps turning");
      x.acked();
      await turns(20);
      assert.ok(spinning(), "acknowledged, nothing outstanding: still turning within spinUs");
      assert.ok(cq.arms >= 1, "armed throughout");
    } finally {
      p.stop();
    }
  });

  it("adaptive: after more than 4 × spinUs idle (sparse traffic) an arrival, the next wait and its end sleep; a post right after an answer spins", async () => {
    // spinUs 20 ms: "right after" must stay under 80 ms on a loaded machine; idle is 120 ms.
    const { cq, x, p } = await pollerOn("adaptive", 20_000);
    try {
      p.start();
      x.post(p);
      assert.ok(spinning(), "the first wait spins");
      x.acked();
      await idleFor(120); // well over 4 × spinUs (80 ms)
      cq.arrivals++;
      cq.onNotify!(); // the peer's request, after a long idle time
      assert.ok(!spinning(), "an arrival after a long idle time: not even one turn");
      await turns(2);
      assert.ok(!spinning(), "nor later");
      x.post(p); // the answer
      assert.ok(!spinning(), "a post after a long idle time: not even one turn");
      await turns(2);
      assert.ok(!spinning(), `its wait sleeps on events (${process.getActiveResourcesInfo().join(", ")})`);
      x.acked();
      assert.ok(!spinning(), "and so does its end");
      await turns(2);
      assert.ok(!spinning(), "and after it");
      // The exchange runs: the next post follows its answer at once.
      x.post(p);
      assert.ok(spinning(), "a post right after the last answer: the wait spins");
      x.acked();
      // Idle again, then a window of two: the first wait sleeps; a completion that leaves one
      // outstanding shows the exchange running, and the rest of the wait spins.
      await idleFor(120);
      x.post(p);
      x.post(p);
      assert.ok(!spinning(), "a window posted after a long idle time: not even one turn");
      await turns(2);
      assert.ok(!spinning(), "a window posted after a long idle time: sleeps");
      x.ackOne();
      assert.ok(spinning(), "one acknowledged, one still outstanding: spins");
    } finally {
      p.stop();
    }
  });

  it("adaptive: a side that only receives (its waits are CREDIT messages) spins again once messages arrive in rhythm", async () => {
    const { cq, x, p } = await pollerOn("adaptive", 20_000);
    try {
      p.start();
      x.post(p); // the connection's first message (its LIMITS)
      x.acked();
      await idleFor(120); // the peer starts streaming long after
      cq.arrivals++;
      cq.onNotify!();
      assert.ok(!spinning(), "the first message after a long idle time: no turn");
      x.post(p); // a CREDIT back: its wait opens after a long idle time
      assert.ok(!spinning(), "its wait sleeps");
      cq.arrivals++;
      cq.pending++; // the next message, acknowledging the CREDIT
      x.outstanding = 0;
      cq.onNotify!();
      assert.ok(spinning(), "a second message right after the first: the stream runs, the loop turns");
    } finally {
      p.stop();
    }
  });

  it("adaptive: messages more than 4 × spinUs apart are no rhythm: a side that only receives sparse messages sleeps", async () => {
    const { cq, x, p } = await pollerOn("adaptive", 20_000);
    try {
      p.start();
      x.post(p);
      x.acked();
      await idleFor(120);
      for (let i = 0; i < 3; i++) {
        cq.arrivals++;
        cq.onNotify!();
        assert.ok(!spinning(), `message ${i + 1}, the last more than 80 ms before: no turn`);
        await idleFor(120);
      }
    } finally {
      p.stop();
    }
  });

  it("busy: keeps turning after a long idle time (the idle rule is adaptive's)", async () => {
    const { cq, x, p } = await pollerOn("busy", 20_000);
    try {
      p.start();
      x.post(p);
      x.acked();
      const t0 = performance.now();
      while (performance.now() - t0 < 120) await new Promise((r) => setTimeout(r, 1));
      assert.ok(spinning(), "busy turns while the connection is open, however long idle");
    } finally {
      p.stop();
    }
  });

  it("adaptive: a post made inside a drain (credits arrive, queued work is posted) after a long idle time opens a wait that sleeps", async () => {
    const cq = scriptedCq();
    let outstanding = 0;
    let postInDrain = false;
    const post = (): void => {
      outstanding++;
      p.afterPost(1, outstanding);
    };
    const p: Poller = new Poller(
      cq,
      "adaptive",
      2_000,
      () => {
        if (postInDrain) {
          postInDrain = false;
          post();
        }
      },
      () => {},
      calm(),
      () => outstanding > 0,
    );
    try {
      p.start();
      post();
      outstanding = 0; // acknowledged: the wait ends, idle from now
      cq.pending++;
      cq.onNotify!();
      await idleFor(12); // > 4 × spinUs (8 ms)
      postInDrain = true; // the peer's CREDIT arrives; its handling posts the queued work
      cq.arrivals++;
      cq.onNotify!();
      assert.equal(outstanding, 1, "posted inside the drain");
      assert.ok(!spinning(), "not even one turn");
      await turns(2);
      assert.ok(!spinning(), "the completion that made the post is not one that came while the wait went on");
    } finally {
      p.stop();
    }
  });

  it("adaptive: a drain that uses up its budget of completions still closes the wait they ended", async () => {
    const cq = scriptedCq();
    let outstanding = 0;
    const p = new Poller(cq, "adaptive", 2_000, () => {}, () => {}, calm(), () => outstanding > 0);
    try {
      p.start();
      outstanding = 300;
      p.afterPost(300, outstanding);
      outstanding = 0; // one read brings 512 completions that acknowledge everything
      cq.pending = 512;
      cq.onNotify!();
      await idleFor(12);
      outstanding = 1;
      p.afterPost(1, outstanding);
      assert.ok(!spinning(), "not even one turn");
      await turns(2);
      assert.ok(!spinning(), "the wait after a long idle time sleeps: the previous one was closed");
    } finally {
      p.stop();
    }
  });
});

describe("a completion that ends the connection", () => {
  it("stops the drain: the destroyed CQ is neither polled nor armed again (no uncaught error)", () => {
    // A CQ with three completions; the first one's handler tears the connection down
    // (stop + destroy), after which polling or arming the CQ throws, as both providers do.
    let destroyed = false;
    let handled = 0;
    let pending = 3;
    const cq = {
      device: {} as Device,
      depth: 16,
      poll(b: CompletionBuffer, max?: number) {
        if (destroyed) throw new Error("poll on a destroyed CQ");
        const n = Math.min(pending, max ?? b.capacity);
        for (let i = 0; i < n; i++) b.wrId[i] = i;
        pending -= n;
        return n;
      },
      requestNotify() {
        if (destroyed) throw new Error("requestNotify on a destroyed CQ");
      },
      onNotify: null,
      destroy() {
        destroyed = true;
      },
    } as unknown as CompletionQueue;
    let p: Poller | null = null;
    p = new Poller(
      cq,
      "adaptive",
      50,
      () => {
        handled++;
        p!.stop();
        cq.destroy();
      },
      () => {},
    );
    assert.doesNotThrow(() => p!.pollNow());
    assert.equal(handled, 1, "no completion is handled after the teardown");
  });
});
