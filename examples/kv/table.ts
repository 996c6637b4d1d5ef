/**
 * The key-value table's memory layout: one fixed-size hash table in one
 * region. The owner writes it in its own memory; clients READ it with
 * one-sided RDMA READs, which are not atomic: a READ that runs while the owner
 * rewrites a slot can return half old, half new bytes. Every slot therefore
 * carries a version (odd while it is being written) and a checksum over the
 * version and the contents, and a reader accepts a slot only when the version
 * is even and the checksum matches; otherwise it reads again.
 *
 *   header, 64 bytes:  magic u32 | buckets u32 | ways u32 | keyMax u32 | valueMax u32
 *   then buckets × ways slots of slotSize bytes (a multiple of 8), each:
 *     0  version  u32   even: stable, odd: being written
 *     4  check    u32   FNV-1a over version, lengths, key and value
 *     8  keyLen   u16   0: the slot is empty
 *    10  valueLen u16
 *    12  key      keyMax bytes
 *        value    valueMax bytes
 *   little-endian.
 *
 * A key lives in one of the `ways` slots of bucket hash(key) % buckets, so a
 * GET is one READ of one bucket. A full bucket refuses new keys (no resizing,
 * no chaining: this is an example).
 */

export const HEADER_BYTES = 64;
const MAGIC = 0x3154564b; // "KVT1"
const SLOT_HEADER = 12;

export interface Geometry {
  buckets: number;
  ways: number;
  keyMax: number;
  valueMax: number;
}

export function slotBytes(g: Geometry): number {
  return Math.ceil((SLOT_HEADER + g.keyMax + g.valueMax) / 8) * 8;
}

export function bucketBytes(g: Geometry): number {
  return g.ways * slotBytes(g);
}

/** Bytes of a table with this geometry (the size to allocate and share). */
export function tableBytes(g: Geometry): number {
  return HEADER_BYTES + g.buckets * bucketBytes(g);
}

/** Offset of `key`'s bucket in the table. */
export function bucketOffset(g: Geometry, key: Uint8Array): number {
  return HEADER_BYTES + (fnv1a(FNV_OFFSET, key, 0, key.length) % g.buckets) * bucketBytes(g);
}

export function readHeader(b: Uint8Array): Geometry {
  const dv = new DataView(b.buffer, b.byteOffset, HEADER_BYTES);
  if (dv.getUint32(0, true) !== MAGIC) throw new Error("not a KV table (bad magic)");
  return { buckets: dv.getUint32(4, true), ways: dv.getUint32(8, true), keyMax: dv.getUint32(12, true), valueMax: dv.getUint32(16, true) };
}

const FNV_OFFSET = 0x811c9dc5;

function fnv1a(h: number, b: Uint8Array, start: number, end: number): number {
  for (let i = start; i < end; i++) h = Math.imul(h ^ b[i]!, 0x01000193);
  return h >>> 0;
}

/** The checksum a slot at `off` must carry for `version` and its current lengths and contents. */
function checksum(b: Uint8Array, off: number, version: number, keyLen: number, valueLen: number, g: Geometry): number {
  let h = FNV_OFFSET;
  for (let s = 0; s < 32; s += 8) h = Math.imul(h ^ ((version >>> s) & 0xff), 0x01000193);
  h = fnv1a(h, b, off + 8, off + SLOT_HEADER); // lengths
  h = fnv1a(h, b, off + SLOT_HEADER, off + SLOT_HEADER + keyLen);
  return fnv1a(h, b, off + SLOT_HEADER + g.keyMax, off + SLOT_HEADER + g.keyMax + valueLen);
}

/** What a slot holds, as seen in `b` (the owner's memory, or a copy READ from it). */
export const TORN = "torn";
export type Slot = { key: Uint8Array; value: Uint8Array } | null | typeof TORN;

export function readSlot(b: Uint8Array, off: number, g: Geometry): Slot {
  const dv = new DataView(b.buffer, b.byteOffset + off, SLOT_HEADER);
  const version = dv.getUint32(0, true);
  if (version & 1) return TORN; // the owner is writing it
  const keyLen = dv.getUint16(8, true);
  const valueLen = dv.getUint16(10, true);
  if (keyLen > g.keyMax || valueLen > g.valueMax) return TORN;
  if (dv.getUint32(4, true) !== checksum(b, off, version, keyLen, valueLen, g)) return TORN; // mixed old and new bytes
  if (keyLen === 0) return null;
  const k = off + SLOT_HEADER;
  const v = k + g.keyMax;
  return { key: b.subarray(k, k + keyLen), value: b.subarray(v, v + valueLen) };
}

/**
 * Looks `key` up in a copy of its bucket (`b` holds exactly the bucket):
 * the value, null when it is not there, or TORN when a slot was caught
 * mid-write and the key could be in it (read the bucket again).
 */
export function findInBucket(b: Uint8Array, key: Uint8Array, g: Geometry): Uint8Array | null | typeof TORN {
  let torn = false;
  for (let i = 0; i < g.ways; i++) {
    const s = readSlot(b, i * slotBytes(g), g);
    if (s === TORN) torn = true;
    else if (s !== null && equal(s.key, key)) return s.value;
  }
  return torn ? TORN : null;
}

function equal(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/**
 * The owner's side: the table in the owner's own memory (`bytes`, e.g. the
 * `bytes` of the LocalMr it shares). Only the owner writes, synchronously, so
 * its own reads never see a torn slot.
 */
export class KvTable {
  readonly geometry: Geometry;
  private readonly b: Uint8Array;
  private readonly dv: DataView;

  private constructor(bytes: Uint8Array, g: Geometry) {
    this.b = bytes;
    this.dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
    this.geometry = g;
  }

  /** Lays an empty table out in `bytes` (at least tableBytes(g) long). */
  static format(bytes: Uint8Array, g: Geometry): KvTable {
    if (g.keyMax > 255 || g.valueMax > 65535 || g.buckets < 1 || g.ways < 1) throw new Error("keyMax ≤ 255, valueMax ≤ 65535, buckets and ways ≥ 1");
    if (bytes.length < tableBytes(g)) throw new Error(`the table needs ${tableBytes(g)} bytes`);
    const t = new KvTable(bytes, g);
    [MAGIC, g.buckets, g.ways, g.keyMax, g.valueMax].forEach((x, i) => t.dv.setUint32(4 * i, x, true));
    for (let off = HEADER_BYTES; off < tableBytes(g); off += slotBytes(g)) t.writeSlot(off, new Uint8Array(0), new Uint8Array(0));
    return t;
  }

  /** A copy of `key`'s value, or null. */
  get(key: Uint8Array): Uint8Array | null {
    const base = bucketOffset(this.geometry, key);
    const v = findInBucket(this.b.subarray(base, base + bucketBytes(this.geometry)), key, this.geometry);
    return v === null || v === TORN ? null : v.slice();
  }

  /** Inserts or replaces; false when the key's bucket is full (or key or value too long). */
  put(key: Uint8Array, value: Uint8Array): boolean {
    const g = this.geometry;
    if (key.length === 0 || key.length > g.keyMax || value.length > g.valueMax) return false;
    let off = this.find(key);
    if (off === null) {
      const base = bucketOffset(g, key);
      for (let i = 0; i < g.ways && off === null; i++) if (readSlot(this.b, base + i * slotBytes(g), g) === null) off = base + i * slotBytes(g);
    }
    if (off === null) return false;
    this.writeSlot(off, key, value);
    return true;
  }

  /** Removes `key`; false when it was not there. */
  delete(key: Uint8Array): boolean {
    const off = this.find(key);
    if (off === null) return false;
    this.writeSlot(off, new Uint8Array(0), new Uint8Array(0));
    return true;
  }

  /** Entries in the table. */
  get size(): number {
    let n = 0;
    for (let off = HEADER_BYTES; off < tableBytes(this.geometry); off += slotBytes(this.geometry)) if (readSlot(this.b, off, this.geometry) !== null) n++;
    return n;
  }

  /** Offset of `key`'s slot, or null. */
  slotOf(key: Uint8Array): number | null {
    return this.find(key);
  }

  private find(key: Uint8Array): number | null {
    const g = this.geometry;
    const base = bucketOffset(g, key);
    for (let i = 0; i < g.ways; i++) {
      const s = readSlot(this.b, base + i * slotBytes(g), g);
      if (s !== null && s !== TORN && equal(s.key, key)) return base + i * slotBytes(g);
    }
    return null;
  }

  /**
   * The seqlock write: version made odd first (readers retry), then the
   * contents, the checksum for the next even version, and that version last.
   */
  private writeSlot(off: number, key: Uint8Array, value: Uint8Array): void {
    const g = this.geometry;
    const version = this.dv.getUint32(off, true);
    this.dv.setUint32(off, (version + 1) >>> 0, true);
    this.dv.setUint16(off + 8, key.length, true);
    this.dv.setUint16(off + 10, value.length, true);
    this.b.set(key, off + SLOT_HEADER);
    this.b.set(value, off + SLOT_HEADER + g.keyMax);
    const next = (version + 2) >>> 0;
    this.dv.setUint32(off + 4, checksum(this.b, off, next, key.length, value.length, g), true);
    this.dv.setUint32(off, next, true);
  }
}
