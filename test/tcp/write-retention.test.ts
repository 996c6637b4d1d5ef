/**
 * tcp provider: a socket write queued from registered bytes keeps those bytes
 * attached and in place, whichever registration it went through. A READ
 * response is written through the grant or share the peer used (a second
 * registration over part of the owner's buffer); the owner must neither
 * detach (free) nor renew (recycle) the buffer while such a write is queued.
 */
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import { Access } from "../../src/transport/types.js";
import { tcpProvider } from "../../src/transport/tcp/index.js";
import type { TcpMr } from "../../src/transport/tcp/memory.js";

describe("tcp: queued writes retain the bytes they read, through any registration", async () => {
  const dev = await tcpProvider.openDevice("tcp-retain", { host: "127.0.0.1" });
  after(() => dev.close());
  const pd = dev.allocPd();

  it("an owner does not renew its buffer while a write through a grant over it is queued", () => {
    const owner = pd.registerMr(4096, Access.LOCAL_WRITE) as TcpMr;
    const grant = pd.registerMr(owner.buffer, Access.LOCAL_WRITE | Access.REMOTE_READ, 100, 200) as TcpMr;
    grant.retainForWrite();
    assert.equal(owner.renewBuffer(), false, "renewed under a queued write");
    grant.writeDone();
    grant.deregister();
    assert.equal(owner.renewBuffer(), true, "renews once the write is done");
    owner.deregister();
  });

  it("an owner's buffer is detached only after the last queued write through a grant is done", () => {
    const owner = pd.registerMr(4096, Access.LOCAL_WRITE) as TcpMr;
    const grant = pd.registerMr(owner.buffer, Access.LOCAL_WRITE | Access.REMOTE_READ, 0, 64) as TcpMr;
    const buf = owner.buffer;
    grant.retainForWrite();
    grant.retainForWrite();
    grant.deregister();
    owner.deregister();
    assert.equal(buf.byteLength, 4096, "detached (freed) under a queued write");
    grant.writeDone();
    assert.equal(buf.byteLength, 4096, "detached before the last write was done");
    grant.writeDone();
    assert.equal(buf.byteLength, 0, "detached once the writes are done");
  });

  it("the owner's own queued writes still hold its buffer", () => {
    const owner = pd.registerMr(256, Access.LOCAL_WRITE) as TcpMr;
    const buf = owner.buffer;
    owner.retainForWrite();
    owner.deregister();
    assert.equal(buf.byteLength, 256);
    owner.writeDone();
    assert.equal(buf.byteLength, 0);
  });
});
