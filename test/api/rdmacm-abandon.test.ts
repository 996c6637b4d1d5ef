/**
 * RDMA CM establishment against clients that abandon it (issue 9, point 5):
 * a bad hello is refused before anything is allocated; a client that gets
 * the server's accept (the server has set up a PD, pool, CQ and QP with
 * receives posted for it) and then goes away without the RTU costs the
 * server nothing once the connect timeout passed: every context back, and a
 * legitimate client served throughout.
 *
 * Runs with ASYNC_RDMA_PROVIDER=verbs ASYNC_RDMA_CM=rdmacm (npm run
 * test:verbs); elsewhere it is skipped.
 */
import { before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { encodeHello } from "../../src/api/establish/rdmacm-wire.js";
import { contextStats } from "../../src/api/context.js";
import type { RdmaListener } from "../../src/index.js";
import { CM, HOST, PROVIDER, at, builder, eventually, pattern } from "../support/api.js";
import { SLOW } from "../support/seam.js";

const ACTIVE = PROVIDER === "verbs" && CM === "rdmacm";
const SKIP = ACTIVE ? false : `RDMA CM tests need ASYNC_RDMA_PROVIDER=verbs ASYNC_RDMA_CM=rdmacm (have provider ${PROVIDER}, connection manager ${CM})`;
const N = Number(process.env.ABANDON_N_CM ?? 20);

describe(`RDMA CM: abandoned establishments give back everything [${PROVIDER}, ${CM}]`, { skip: SKIP, timeout: 600_000 }, () => {
  type CmModule = typeof import("../../src/transport/verbs/cm.js");
  let cm: CmModule;
  before(async () => {
    cm = await import("../../src/transport/verbs/cm.js");
  });

  async function legit(listener: RdmaListener, seed: number): Promise<void> {
    const [c, s] = await Promise.all([builder("client").connect(at(listener.port)), listener.accept({ timeoutMs: 20_000 * SLOW })]);
    try {
      using m = c.allocLocalMr(16);
      m.bytes.set(pattern(16, seed));
      await c.send(m);
      using r = await s.receive();
      assert.deepEqual([...r.bytes], [...pattern(16, seed)]);
    } finally {
      await Promise.all([c.close(), s.close()]);
    }
  }

  /** A raw CM client: resolves, connects with `pdata`, waits for the answer, then goes away without the RTU. */
  async function abandonOne(port: number, pdata: Uint8Array): Promise<string> {
    const id = cm.CmId.create();
    try {
      id.resolveAddr(null, HOST, port, 2000 * SLOW);
      assert.equal((await id.next("resolve addr", 5000 * SLOW)).name, "ADDR_RESOLVED");
      id.resolveRoute(2000 * SLOW);
      assert.equal((await id.next("resolve route", 5000 * SLOW)).name, "ROUTE_RESOLVED");
      // a QP number nobody owns: the server connects its QP to it and never hears from it
      id.connect(0x4242, pdata, { responderResources: 1, initiatorDepth: 1, retryCount: 7, rnrRetryCount: 7 });
      return (await id.next("connect", 5000 * SLOW)).name;
    } finally {
      id.destroy();
    }
  }

  it(`${N} clients that leave after the server's accept, ${N} with garbage: contexts back, a legitimate client served`, async () => {
    const listener = await builder("server").setConnectTimeout(1000 * SLOW).bind(at(0));
    try {
      await legit(listener, 1);
      const base = contextStats().live;
      const hello = encodeHello(1, { psn: 7, recvDepth: 32, eagerMax: 4096 });
      const answers = new Map<string, number>();
      for (let i = 0; i < N; i++) {
        const a = await abandonOne(listener.port, hello);
        answers.set(a, (answers.get(a) ?? 0) + 1);
        const g = await abandonOne(listener.port, new Uint8Array([9, 9, 9, 9, 9, 9, 9, 9]));
        assert.equal(g, "REJECTED", "garbage is refused");
        if (i % 5 === 0) await legit(listener, 10 + i);
      }
      // the server set up a connection for each valid hello (it answered CONNECT_RESPONSE)
      assert.equal(answers.get("CONNECT_RESPONSE"), N, JSON.stringify([...answers]));
      await eventually(() => contextStats().live === base, 60_000 * SLOW, `every abandoned connection's context to be released (live ${contextStats().live}, base ${base})`);
      await legit(listener, 99);
      assert.equal(contextStats().live, base);
    } finally {
      await listener.close();
    }
  });
});
