/**
 * ArrayBuffer helpers that work on Node 20 (V8 11.3 has neither
 * ArrayBuffer.prototype.transfer nor .detached).
 */

/** Detaches `ab`: every view over it now has length 0 and cannot touch the memory. */
export function detachArrayBuffer(ab: ArrayBuffer): void {
  if (ab.byteLength === 0) return;
  structuredClone(ab, { transfer: [ab] });
}

export function isDetached(ab: ArrayBuffer): boolean {
  if (ab.byteLength !== 0) return false;
  try {
    new Uint8Array(ab);
    return false;
  } catch {
    return true;
  }
}
