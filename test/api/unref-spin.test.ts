/**
 * An unref'd connection never holds its process by spinning (found by a
 * review of the change that made tcp's busy and adaptive polling spin).
 * Rdma.unref(): the process may exit while the connection is open, "an
 * operation in flight does not hold the process either"; busy and adaptive
 * polling keep the event loop turning with an Immediate per turn, which
 * would hold it, so an unref'd connection waits on completion events. Seen
 * failing before the fix: adaptive ignored unref, and a child whose only
 * connection was unref'd never exited while messages kept arriving within
 * spinUs of each other.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { Contention, Poller } from "../../src/agent/poller.js";
import type { CompletionBuffer, CompletionQueue, Device } from "../../src/transport/types.js";
import { CM, PROVIDER, at, builder } from "../support/api.js";
import { SLOW } from "../support/seam.js";
import { spawnNode } from "../support/procs.js";

const here = dirname(fileURLToPath(import.meta.url));
const childJs = join(here, "..", "support", "unref-traffic-child.js");
const DEADLINE = 30_000 * SLOW;
/** Sends the parent keeps in flight. */
const WINDOW = Number(process.env.UNREF_SPIN_WINDOW ?? 1);

/** An empty event-driven CQ (as tcp's). */
function eventCq(): CompletionQueue {
  return { device: {} as Device, depth: 16, eventDriven: true, poll: (_b: CompletionBuffer) => 0, requestNotify() {}, onNotify: null, destroy() {} };
}
const immediates = (): number => process.getActiveResourcesInfo().filter((r) => r === "Immediate").length;
const turn = (): Promise<void> => new Promise((r) => setImmediate(r));

describe(`an unref'd connection does not hold its process by spinning [${PROVIDER}, ${CM}]`, { timeout: 4 * DEADLINE }, () => {
  for (const mode of ["busy", "adaptive"] as const) {
    it(`poller (${mode}, event-driven CQ), unref'd: activity leaves no Immediate holding the loop after a turn`, async () => {
      const p = new Poller(eventCq(), mode, 60_000_000, () => {}, () => {}, new Contention({ name: "calm", read: () => 0, exceeded: () => false }));
      const base = immediates();
      try {
        p.start();
        p.setKeepAlive(false);
        for (let i = 0; i < 5; i++) {
          p.afterPost(1, 1); // activity: a post (arrivals touch() the same way)
          await turn();
          await turn();
          assert.equal(immediates(), base, `after activity on an unref'd ${mode} poller an Immediate still holds the event loop (${process.getActiveResourcesInfo().join(", ")})`);
        }
      } finally {
        p.stop();
      }
    });
  }

  for (const [mode, spinUs] of [["event", 50], ["adaptive", 200_000]] as const) {
    it(`a process whose only connection is unref'd exits while messages keep arriving (${mode}, spinUs ${spinUs})`, async () => {
      const listener = await builder("server").bind(at(0));
      const kid = spawnNode(childJs, [at(listener.port), mode, String(spinUs)], `unref-traffic child (${mode})`);
      let exited = false;
      kid.child.once("exit", () => (exited = true));
      let server: Awaited<ReturnType<typeof listener.accept>> | null = null;
      try {
        server = await listener.accept({ timeoutMs: DEADLINE });
        const s = server;
        // Keep messages flowing to the child until it is gone (each send completes when the child took it).
        const msg = Buffer.alloc(32, 7);
        let sent = 0;
        const lane = async (): Promise<void> => {
          try {
            while (!exited) {
              await s.send(msg);
              sent++;
            }
          } catch {
            /* the child's end went away */
          }
        };
        const sender = Promise.all(Array.from({ length: WINDOW }, lane)).then(() => sent);
        await kid.waitFor(/^ready$/m, DEADLINE);
        const code = await kid.exited(DEADLINE);
        assert.equal(code, 0);
        assert.ok((await sender) > 0, "messages flowed to the child");
      } finally {
        kid.child.kill("SIGKILL");
        await server?.close();
        await listener.close();
      }
    });
  }
});
