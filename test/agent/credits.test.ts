/**
 * The credit rules of agent/credits.ts, one test per rule: each fails when
 * its rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { CREDIT_RESERVE, CTRL_RESERVE, Credits, NEED } from "../../src/agent/credits.js";

const idle = { credit: false, ctrl: false, data: false, dataHeadNeed: 0 };

describe("send credits (agent/credits.ts)", () => {
  it("the reserves: a CREDIT may take the last credit, control leaves it, data leaves the control reserve too; one-sided work needs none", () => {
    assert.equal(NEED.credit, CREDIT_RESERVE);
    assert.equal(NEED.ctrl, CREDIT_RESERVE + 1);
    assert.equal(NEED.data, CREDIT_RESERVE + CTRL_RESERVE + 1);
    const c = new Credits(8, 8);
    while (c.canSend(NEED.data)) c.spend(NEED.data);
    assert.equal(c.credits, NEED.data - 1, "data stops with the control reserve left");
    while (c.canSend(NEED.ctrl)) c.spend(NEED.ctrl);
    assert.equal(c.credits, CREDIT_RESERVE, "control stops with the CREDIT reserve left");
    assert.ok(c.canSend(NEED.credit));
    c.spend(NEED.credit);
    assert.equal(c.credits, 0);
    assert.ok(c.canSend(0), "one-sided work needs no credit");
    c.spend(0);
    assert.equal(c.credits, 0);
  });

  it("a peer that returns more credits than its depth is in breach", () => {
    const c = new Credits(4, 8);
    assert.match(c.returned(5) ?? "", /more than its 4/);
    const d = new Credits(4, 8);
    d.spend(NEED.data);
    assert.equal(d.returned(1), null);
    assert.match(d.returned(1) ?? "", /more credits than its 4/);
  });

  it("the handshake's depth replaces the provisional one", () => {
    const c = new Credits(32, 8);
    c.setPeerDepth(4);
    assert.equal(c.credits, 4);
    assert.notEqual(c.returned(5), null);
  });

  it("a report hands over every re-posted receive and the peer sees them", () => {
    const c = new Credits(8, 8);
    c.consumed();
    c.consumed();
    c.reposted(2);
    assert.equal(c.peerCredits, 6);
    assert.equal(c.report(), 2);
    assert.equal(c.peerCredits, 8);
    assert.equal(c.report(), 0);
  });

  it("idle: a CREDIT goes once a quarter of the depth is owed, not before", () => {
    const c = new Credits(32, 32);
    for (let i = 0; i < 7; i++) c.consumed();
    c.reposted(7);
    assert.equal(c.shouldSendCredits(idle), false);
    c.consumed();
    c.reposted(1);
    assert.equal(c.shouldSendCredits(idle), true);
  });

  it("queued work that can take credits carries them: no CREDIT", () => {
    const c = new Credits(32, 32);
    for (let i = 0; i < 10; i++) c.consumed();
    c.reposted(10);
    assert.equal(c.shouldSendCredits({ ...idle, data: true, dataHeadNeed: NEED.data }), false);
    assert.equal(c.shouldSendCredits({ ...idle, ctrl: true }), false);
  });

  it("every queued message waiting for credits: a CREDIT as soon as two are owed (both sides could wait on each other)", () => {
    const c = new Credits(32, 32);
    while (c.canSend(NEED.data)) c.spend(NEED.data);
    for (let i = 0; i < 2; i++) c.consumed();
    c.reposted(1);
    const blocked = { ...idle, data: true, dataHeadNeed: NEED.data };
    assert.equal(c.shouldSendCredits(blocked), false, "one owed is not enough");
    c.reposted(1);
    assert.equal(c.shouldSendCredits(blocked), true);
    assert.equal(c.shouldSendCredits({ ...blocked, credit: true }), false, "never a second CREDIT while one is queued");
  });

  it("a starved peer gets even one real credit back, but never just the echo of its own CREDIT", () => {
    const c = new Credits(32, 32);
    // The peer sees fewer credits than a data message needs.
    for (let i = 0; i < 32 - NEED.data + 1; i++) c.consumed();
    c.reposted(1);
    c.echoed();
    assert.equal(c.shouldSendCredits(idle), false, "answering a CREDIT's own buffer would ping-pong for ever");
    const d = new Credits(32, 32);
    for (let i = 0; i < 32 - NEED.data + 1; i++) d.consumed();
    d.reposted(1);
    assert.equal(d.shouldSendCredits(idle), true, "one real credit goes back at once");
    d.echoed();
    d.reposted(1);
    assert.equal(d.shouldSendCredits(idle), true, "two owed, one an echo: they go");
  });
});
