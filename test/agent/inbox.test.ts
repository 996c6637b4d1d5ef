/**
 * The rules of agent/inbox.ts on a scripted host, one test per rule: each
 * fails when its rule is broken.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaError } from "../../src/index.js";
import { LocalMemory, LocalMr } from "../../src/memory/mr.js";
import type { MemoryRegion } from "../../src/transport/types.js";
import { Inbox, type Incoming } from "../../src/agent/inbox.js";

/** A message whose first byte is `tag` (memory of no pool). */
function msg(tag: number): LocalMr {
  const buffer = new ArrayBuffer(1);
  new Uint8Array(buffer)[0] = tag;
  const mr = { pd: null, buffer, offset: 0, addr: 0, length: 1, lkey: 0, rkey: 0, access: 0, deregistered: false, deregister() {} } as unknown as MemoryRegion;
  return new LocalMr(new LocalMemory(null, { mr, addr: 0, length: 1, buffer, bufOffset: 0, mrBufOffset: 0 }), 0, 1);
}

function scripted(depth = 8) {
  const host = { reposts: 0, failure: null as RdmaError | null };
  const inbox = new Inbox({ repostRecv: () => void host.reposts++, failed: () => host.failure }, depth);
  return { inbox, host };
}

const tagOf = async (p: Promise<{ mr: LocalMr }>): Promise<number> => (await p).mr.bytes[0]!;

function rendezvous(token: number): Incoming {
  return { ready: false, mr: null, imm: undefined, rndv: { token, len: 1, addr: 0, rkey: 0, done: false, cancelled: false, started: false } };
}

describe("inbox (agent/inbox.ts)", () => {
  it("delivers in arrival order, a rendezvous holding its place until it is read; each message once", async () => {
    const { inbox } = scripted();
    inbox.pushMessage(msg(1), undefined);
    const r = rendezvous(7);
    inbox.pushRendezvous(r);
    inbox.pushMessage(msg(3), 33);
    assert.equal(await tagOf(inbox.receive()), 1);
    let second: number | null = null;
    const p = tagOf(inbox.receive()).then((t) => (second = t));
    await Promise.resolve();
    assert.equal(second, null, "the message behind the rendezvous waits for it");
    inbox.ready(r, msg(2));
    await p;
    assert.equal(second, 2);
    const third = await inbox.receive();
    assert.equal(third.mr.bytes[0], 3);
    assert.equal(third.imm, 33);
    assert.equal(inbox.held(), 0);
  });

  it("a dropped (cancelled) rendezvous frees its place: the next message is delivered", async () => {
    const { inbox } = scripted();
    const r = rendezvous(9);
    inbox.pushRendezvous(r);
    inbox.pushMessage(msg(5), undefined);
    const p = tagOf(inbox.receive());
    assert.equal(inbox.findRendezvous(9), r);
    inbox.drop(r);
    assert.equal(await p, 5);
    assert.equal(inbox.findRendezvous(9), undefined);
  });

  it("back-pressure: past half the depth unread, consumed receives are held back until the user reads below half", async () => {
    const { inbox, host } = scripted(8);
    for (let i = 0; i < 4; i++) inbox.pushMessage(msg(i), undefined);
    assert.equal(host.reposts, 4, "up to half the depth: re-posted at once");
    for (let i = 4; i < 8; i++) inbox.pushMessage(msg(i), undefined);
    inbox.pushImm(42);
    assert.equal(host.reposts, 4, "past it: held back");
    assert.equal(inbox.held(), 9, "immediates count with messages");
    for (let i = 0; i < 5; i++) (await inbox.receive()).mr.dispose();
    assert.equal(inbox.held(), 4);
    assert.equal(host.reposts, 4, "still half the depth unread: nothing re-posted");
    (await inbox.receive()).mr.dispose();
    assert.equal(host.reposts, 4 + 5, "below half: every held-back receive goes back to the peer");
    assert.equal(await inbox.receiveWriteImm(), 42);
    await Promise.resolve();
    assert.equal(host.reposts, 9, "each receive is re-posted once");
  });

  it("when the connection fails, what arrived whole stays receivable, then the failure; a rendezvous being read is dropped", async () => {
    const { inbox, host } = scripted();
    inbox.pushMessage(msg(1), undefined);
    const r = rendezvous(4);
    inbox.pushRendezvous(r);
    inbox.pushMessage(msg(2), undefined);
    inbox.pushImm(77);
    const err = new RdmaError("CONNECTION_CLOSED", "the peer closed the connection");
    host.failure = err;
    inbox.fail(err, false);
    assert.equal(r.rndv!.cancelled, true, "its READ frees its memory when it completes");
    inbox.teardown();
    assert.equal(await tagOf(inbox.receive()), 1);
    assert.equal(await tagOf(inbox.receive()), 2);
    assert.equal(await inbox.receiveWriteImm(), 77);
    await assert.rejects(inbox.receive(), (e: unknown) => e === err);
    await assert.rejects(inbox.receiveWriteImm(), (e: unknown) => e === err);
  });

  it("a waiter at the moment of failure gets the message that arrived before it, others the failure", async () => {
    const { inbox, host } = scripted();
    const r = rendezvous(1);
    inbox.pushRendezvous(r);
    inbox.pushMessage(msg(8), undefined);
    const first = inbox.receive();
    const second = inbox.receive();
    const err = new RdmaError("RETRY_EXCEEDED", "dead");
    host.failure = err;
    inbox.fail(err, false);
    assert.equal(await tagOf(first), 8);
    await assert.rejects(second, (e: unknown) => e === err);
  });

  it("a side that closes itself drops what it did not read, before or after teardown", async () => {
    for (const order of ["before", "after"] as const) {
      const { inbox, host } = scripted();
      const m = msg(1);
      inbox.pushMessage(m, undefined);
      inbox.pushImm(5);
      const err = new RdmaError("CONNECTION_CLOSED", "closed by this side");
      host.failure = err;
      if (order === "before") {
        inbox.fail(err, true);
        inbox.teardown();
      } else {
        inbox.fail(err, false);
        inbox.teardown();
        inbox.dropUnread(true);
      }
      assert.equal(m.disposed, true, `${order}: the unread message is freed`);
      assert.equal(inbox.held(), 0);
      await assert.rejects(inbox.receive(), (e: unknown) => e === err);
      await assert.rejects(inbox.receiveWriteImm(), (e: unknown) => e === err);
    }
  });
});
