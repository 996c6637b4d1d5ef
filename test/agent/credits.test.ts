/**
 * The credit rules of agent/credits.ts, one test per rule: each fails when
 * its rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { CREDIT_RESERVE, CTRL_RESERVE, Credits, IMM_RING, INITIAL_RECEIVES, NEED, initialReceives } from "../../src/agent/credits.js";

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

  it("idle: a CREDIT goes once a quarter of the depth is owed, not before (a small ring gets its credits back when the peer runs short)", () => {
    const c = new Credits(32, 32);
    c.ourRing = 32;
    c.peerCredits = 32;
    for (let i = 0; i < 7; i++) c.consumed();
    c.reposted(7);
    assert.equal(c.shouldSendCredits(idle), false);
    c.consumed();
    c.reposted(1);
    assert.equal(c.shouldSendCredits(idle), true, "a quarter of a 32-receive depth");
    // The first 8 receives: 3 owed is not a reason for a CREDIT while the peer can still send data.
    const small = new Credits(32, 32);
    for (let i = 0; i < 3; i++) small.consumed();
    small.reposted(3);
    assert.equal(small.shouldSendCredits(idle), false, "the peer still sees 5 credits, enough for data");
    small.consumed();
    small.reposted(1);
    assert.equal(small.shouldSendCredits(idle), true, "the peer sees 4: short of a data message");
  });

  it("issue 21 point 6: the ring starts with 8 receives and grows, doubling up to the depth, only when the peer runs low even counting what it is owed", () => {
    assert.equal(INITIAL_RECEIVES, 8);
    assert.equal(initialReceives(32), 8);
    assert.equal(initialReceives(8), 8);
    const c = new Credits(32, 32);
    assert.equal(c.credits, 8, "the peer's first receives: 8 of its 32");
    assert.equal(c.peerCredits, 8);
    assert.equal(c.ourRing, 8);
    // One message at a time, each re-posted and reported: never grows.
    for (let i = 0; i < 100; i++) {
      c.consumed();
      assert.equal(c.growth(), 0);
      c.reposted(1);
      c.report();
    }
    assert.equal(c.ourRing, 8);
    // Owed but not reported counts: the peer will have them.
    for (let i = 0; i < 4; i++) c.consumed();
    c.reposted(4);
    assert.equal(c.growth(), 0, "4 owed: the peer is not short");
    // A WRITE with immediate took the receive: owed credits go back only by CREDIT message, so they do not count.
    const w = new Credits(1024, 1024);
    for (let i = 0; i < 4; i++) w.consumed();
    w.reposted(4);
    assert.equal(w.growth(true), 8, "4 owed after WRITEs with immediate: the ring doubles");
    w.reposted(8);
    w.report();
    while (w.peerCredits >= NEED.data) w.consumed();
    w.reposted(4);
    assert.equal(w.growth(true), 16, "16 receives, under IMM_RING: doubles again");
    w.reposted(16);
    w.report();
    while (w.peerCredits >= NEED.data) w.consumed();
    w.reposted(4);
    assert.equal(w.ourRing, IMM_RING);
    assert.equal(w.growth(true), 0, "at IMM_RING what is owed counts again: one message in flight does not take the whole depth");
    c.report();
    // The peer runs low with nothing owed: the ring doubles, then doubles again, never past the depth.
    for (let i = 0; i < 4; i++) c.consumed();
    assert.equal(c.growth(), 8);
    assert.equal(c.ourRing, 16);
    assert.equal(c.growth(), 0, "grown once: the new receives are owed now");
    c.reposted(8);
    c.report();
    while (c.peerCredits >= NEED.data) c.consumed();
    assert.equal(c.growth(), 16);
    assert.equal(c.ourRing, 32);
    c.reposted(16);
    c.report();
    while (c.peerCredits > 0) c.consumed();
    assert.equal(c.growth(), 0, "at its depth");
    // The peer accepts credits up to our depth, not just the first 8.
    const peer = new Credits(32, 32);
    while (peer.canSend(NEED.credit)) peer.spend(NEED.credit);
    assert.equal(peer.returned(8 + 16), null, "credits for a grown ring");
    assert.match(peer.returned(9) ?? "", /more credits than its 32/);
  });

  it("queued work that can take credits carries them: no CREDIT", () => {
    const c = new Credits(32, 32);
    c.ourRing = 32;
    c.peerCredits = 32;
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
