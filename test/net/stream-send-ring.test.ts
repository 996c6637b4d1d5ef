/**
 * issue 21: the stream's send ring under a connection that completes WRITEs
 * out of order and returns ring credit before this side sees their
 * completions (what a peer that reads fast may do). A fake connection
 * snapshots each WRITE's region of the send ring when it is posted and
 * compares it when it completes: no byte may change while a WRITE reads
 * from it, and the bytes written, in post order, are the application's.
 * Seeded, so each case is the same run every time.
 */
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import { RdmaStream } from "../../src/api/stream.js";
import { RING } from "../../src/api/stream-ring.js";
import { RdmaError } from "../../src/index.js";
import { rng } from "../support/rng.js";

interface Region {
  start: number;
  length: number;
  slice(a: number, b: number): Region;
  dispose(): void;
}

function region(start: number, length: number): Region {
  return { start, length, slice: (a, b) => region(start + a, b - a), dispose() {} };
}

/** The connection the stream runs on: a peer ring that takes every WRITE, completions in random order. */
class FakeConnection {
  isClosed = false;
  readonly peer = { address: "127.0.0.1", port: 1, identity: null };
  private ring: Uint8Array | null = null;
  private readonly inbox: Uint8Array[] = [];
  private waiter: ((b: Uint8Array) => void) | null = null;
  private readonly flight: { start: number; snap: Uint8Array; order: number; done: () => void }[] = [];
  readonly written: { order: number; bytes: Uint8Array }[] = [];
  violations = 0;
  maxInFlight = 0;
  posts = 0;
  registrations = 0;
  private scheduled = false;

  constructor(private readonly rand: () => number) {}

  private deliver(b: Uint8Array): void {
    const w = this.waiter;
    this.waiter = null;
    if (w) w(b);
    else this.inbox.push(b);
  }

  allocLocalMr(n: number): never {
    return { bytes: new Uint8Array(n), dispose() {} } as never;
  }

  registerMr(buffer: ArrayBuffer): never {
    this.registrations++;
    this.ring = new Uint8Array(buffer);
    return region(0, buffer.byteLength) as never;
  }

  send(mr: { bytes: Uint8Array }): Promise<void> {
    // RING? is answered with the ring's name
    if (mr.bytes[0] === 0x04) setImmediate(() => this.deliver(Buffer.concat([Buffer.of(0x05), Buffer.from("ring")])));
    return Promise.resolve();
  }

  receive(opts: { signal: AbortSignal }): Promise<{ bytes: Uint8Array; dispose(): void }> {
    const m = this.inbox.shift();
    if (m) return Promise.resolve({ bytes: m, dispose() {} });
    return new Promise((res, rej) => {
      this.waiter = (b) => res({ bytes: b, dispose() {} });
      opts.signal.addEventListener("abort", () => rej(new RdmaError("CONNECTION_CLOSED", "closed")));
    });
  }

  receiveWriteImm(opts: { signal: AbortSignal }): Promise<number> {
    return new Promise((_res, rej) => opts.signal.addEventListener("abort", () => rej(new RdmaError("CONNECTION_CLOSED", "closed"))));
  }

  writeWithImm(src: Region, _rmr: Region, imm: number): Promise<void> {
    assert.equal(imm, src.length, "the immediate is the chunk's length");
    const snap = this.ring!.slice(src.start, src.start + src.length);
    const order = this.posts++;
    return new Promise((res) => {
      this.flight.push({ start: src.start, snap, order, done: res });
      this.maxInFlight = Math.max(this.maxInFlight, this.flight.length);
      // the peer reads the chunk at once and returns its credit before the completion comes
      const wnd = Buffer.alloc(5);
      wnd[0] = 0x03;
      wnd.writeUInt32BE(src.length, 1);
      setImmediate(() => this.deliver(wnd));
      this.schedule();
    });
  }

  /** Completes one WRITE in flight, chosen at random, on a later turn, checking its region first. */
  private schedule(): void {
    if (this.scheduled) return;
    this.scheduled = true;
    setImmediate(() => {
      this.scheduled = false;
      if (this.flight.length === 0) return;
      const f = this.flight.splice(Math.floor(this.rand() * this.flight.length), 1)[0]!;
      if (!Buffer.from(this.ring!.subarray(f.start, f.start + f.snap.length)).equals(Buffer.from(f.snap))) this.violations++;
      this.written.push({ order: f.order, bytes: f.snap });
      f.done();
      if (this.flight.length > 0) this.schedule();
    });
  }

  share(): never {
    throw new Error("the stream under test only writes");
  }

  openSharedMr(): Promise<Region> {
    return Promise.resolve(region(0, RING));
  }

  close(): Promise<void> {
    this.isClosed = true;
    return Promise.resolve();
  }

  ref(): void {}
  unref(): void {}
}

describe("issue 21: the stream's send ring (out-of-order completions, early credit)", () => {
  for (const seed of [1, 2, 3]) {
    it(`seed ${seed}: no region changes under a WRITE in flight, the bytes arrive in order, one registration`, async () => {
      const rand = rng(seed);
      const conn = new FakeConnection(rand);
      const s = new RdmaStream(conn as never, {});
      const errors: Error[] = [];
      s.on("error", (e) => errors.push(e));
      const input: Buffer[] = [];
      let total = 0;
      let k = 0;
      // 6 rings' worth of writes: empty ones, runs of tiny ones (gathered), and large ones cut at the ring's end
      while (total < 6 * RING) {
        const r = rand();
        const n = r < 0.1 ? 0 : r < 0.5 ? 1 + Math.floor(rand() * 300) : r < 0.6 ? Math.floor(rand() * 70_000) : Math.floor(rand() * 600_000);
        const b = Buffer.alloc(n);
        for (let i = 0; i < n; i++, k++) b[i] = (k * 7 + Math.floor(k / 1000) * 13 + 3) & 0xff;
        input.push(b);
        total += n;
        if (!s.write(b)) await new Promise((res) => s.once("drain", res));
      }
      await new Promise<void>((res) => s.end(() => res()));
      assert.deepEqual(errors, []);
      assert.equal(conn.violations, 0, "a region changed while a WRITE read from it");
      assert.equal(conn.registrations, 1);
      assert.ok(conn.maxInFlight > 1, "WRITEs overlapped");
      const out = Buffer.concat(conn.written.sort((a, b) => a.order - b.order).map((w) => Buffer.from(w.bytes)));
      assert.ok(out.equals(Buffer.concat(input)), "the bytes written, in order, are the application's");
      s.destroy();
    });
  }
});
