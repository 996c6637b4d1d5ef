/**
 * examples/counter across processes: client processes fetch-and-add on one
 * counter the owner (this process) shares; the total is exact. The test can
 * fail: with a READ, add, WRITE in place of fetchAndAdd (a scratch run) it
 * got 8848 of 20000 on tcp.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { CM, PROVIDER, at, builder } from "../support/api.js";
import { SLOW } from "../support/seam.js";
import { spawnNode, type Kid } from "../support/procs.js";
import { collectReports, shareCounter, valueOf } from "../../examples/counter/counter.js";

const here = dirname(fileURLToPath(import.meta.url));
const root = join(here, "..", "..", "..");
const clientJs = join(here, "..", "support", "counter-client.js");
const CLIENTS = 4;
const TIMES = Number(process.env.TEST_COUNTER_TIMES ?? 5_000);
const DEADLINE = 300_000 * SLOW;

describe(`shared counter across processes [${PROVIDER}, ${CM}]`, { timeout: 2 * DEADLINE }, () => {
  it(`${CLIENTS} client processes × ${TIMES} fetchAndAdd on one shared counter add up to exactly ${CLIENTS * TIMES}`, async () => {
    const listener = await builder("server").bind(at(0));
    const counter = shareCounter(listener);
    const reports = collectReports(listener, CLIENTS);
    reports.catch(() => {}); // awaited below; a failure before then must not go unhandled
    const kids: Kid[] = [];
    try {
      for (let i = 0; i < CLIENTS; i++) kids.push(spawnNode(clientJs, [at(listener.port), String(TIMES)], `counter client ${i + 1}`));
      // every client connected and opened the counter: start them together
      await Promise.all(kids.map((k) => k.waitFor(/^ready$/m, DEADLINE)));
      for (const k of kids) k.tell("go");
      const { reported, connections } = await reports;
      assert.equal(valueOf(counter), BigInt(CLIENTS * TIMES));
      assert.equal(reported, BigInt(CLIENTS * TIMES));
      await Promise.all(connections.map((c) => c.close()));
      const codes = await Promise.all(kids.map((k) => k.exited(DEADLINE)));
      assert.deepEqual(codes, kids.map(() => 0));
    } finally {
      for (const k of kids) k.child.kill("SIGKILL");
      await listener.close();
    }
  });

  it("the demo (node dist/examples/counter/run.js) runs the owner and its clients as processes", () => {
    const r = spawnSync(process.execPath, [join(root, "dist", "examples", "counter", "run.js"), "3", "200"], {
      encoding: "utf8",
      timeout: DEADLINE,
      env: { ...process.env, ASYNC_RDMA_PROVIDER: PROVIDER },
    });
    assert.equal(r.status, 0, `demo failed:\n${r.stdout}\n${r.stderr}`);
    assert.match(r.stdout, /\[owner\] counter = 600 \(the clients report 600 increments\)/);
    assert.equal((r.stdout.match(/added 200 \(provider /g) ?? []).length, 3);
    assert.match(r.stdout, /all processes finished/);
  });
});
