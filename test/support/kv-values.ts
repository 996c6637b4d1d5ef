/**
 * Values for the KV tests that show whether they were read whole: key index,
 * writer, sequence number, then one fill byte repeated, then an FNV-1a
 * checksum of everything before it. Any mix of two values fails the check.
 */
export const KEYS = Array.from({ length: 8 }, (_, i) => `key-${i}`);
export const ABSENT = Array.from({ length: 4 }, (_, i) => `absent-${i}`);
const HEAD = 6; // key u8, writer u8, seq u32

function fnv(b: Uint8Array, end: number): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < end; i++) h = Math.imul(h ^ b[i]!, 0x01000193);
  return h >>> 0;
}

/** Value `seq` of writer `writer` for key `key`, between 10 and `max` bytes long. */
export function makeValue(key: number, writer: number, seq: number, max: number): Uint8Array {
  const len = HEAD + 4 + ((seq * 37 + writer * 11) % (max - HEAD - 4 + 1));
  const v = new Uint8Array(len);
  const dv = new DataView(v.buffer);
  v[0] = key;
  v[1] = writer;
  dv.setUint32(2, seq >>> 0, true);
  v.fill((writer * 67 + seq * 13 + key) & 0xff, HEAD, len - 4);
  dv.setUint32(len - 4, fnv(v, len - 4), true);
  return v;
}

/** null when `v` is a whole value for key `key`, else what is wrong with it. */
export function checkValue(v: Uint8Array, key: number): string | null {
  if (v.length < HEAD + 4) return `too short (${v.length} bytes)`;
  const dv = new DataView(v.buffer, v.byteOffset, v.length);
  if (v[0] !== key) return `key index ${v[0]}, expected ${key}`;
  for (let i = HEAD + 1; i < v.length - 4; i++) if (v[i] !== v[HEAD]) return `fill byte ${i} is ${v[i]}, not ${v[HEAD]}`;
  if (dv.getUint32(v.length - 4, true) !== fnv(v, v.length - 4)) return "checksum mismatch";
  return null;
}

/** "writer:seq" of a whole value, to count changes. */
export function versionOf(v: Uint8Array): string {
  return `${v[1]}:${new DataView(v.buffer, v.byteOffset, v.length).getUint32(2, true)}`;
}
