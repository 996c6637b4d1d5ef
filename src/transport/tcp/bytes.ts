/**
 * Copies of a few bytes without a view per copy. Copying a range with
 * `TypedArray.prototype.set` (or Buffer's copy) makes a view of the source
 * range first: an object on the heap per copy, per message on the small-message
 * path. Up to SMALL_COPY bytes are copied through DataViews the owners of the
 * memory keep (an MR, a staging slab, the read buffer): measured cheaper than
 * making the view up to ~100 bytes; above that the view is cheaper and is made.
 */

/** Up to this many bytes are copied word by word through DataViews (no view made). */
export const SMALL_COPY = 96;

/** Copies n bytes from `s` at byte `so` to `d` at byte `dof` (offsets into the DataViews' buffers). */
export function copyWords(s: DataView, so: number, d: DataView, dof: number, n: number): void {
  let i = 0;
  for (; i + 4 <= n; i += 4) d.setInt32(dof + i, s.getInt32(so + i));
  for (; i < n; i++) d.setUint8(dof + i, s.getUint8(so + i));
}

/** A DataView over the whole of `u8`'s ArrayBuffer, cached in `cache` while the buffer stays the same. */
export interface DvCache {
  ab: ArrayBufferLike | null;
  dv: DataView | null;
}

export function dvOf(u8: Uint8Array, cache: DvCache): DataView {
  const ab = u8.buffer;
  if (cache.ab !== ab || cache.dv === null) {
    cache.ab = ab;
    cache.dv = new DataView(ab);
  }
  return cache.dv;
}
