/**
 * ArrayBuffer helpers that work on Node 20 (V8 11.3 has neither
 * ArrayBuffer.prototype.transfer nor .detached).
 */

const detachers = new WeakMap<ArrayBuffer, (ab: ArrayBuffer) => void>();

/**
 * Registers how to detach `ab` when structuredClone cannot: Node ignores
 * external (native) ArrayBuffers in a transfer list, so a provider whose
 * memory is native detaches them itself (napi_detach_arraybuffer).
 */
export function setDetacher(ab: ArrayBuffer, detach: (ab: ArrayBuffer) => void): void {
  detachers.set(ab, detach);
}

/** Detaches `ab`: every view over it now has length 0 and cannot touch the memory. */
export function detachArrayBuffer(ab: ArrayBuffer): void {
  if (ab.byteLength === 0) return;
  const d = detachers.get(ab);
  if (d) d(ab);
  else structuredClone(ab, { transfer: [ab] });
  // A buffer that silently stayed attached would leave freed memory reachable.
  if (ab.byteLength !== 0) throw new Error("detachArrayBuffer: this ArrayBuffer cannot be detached (external memory without a registered detacher)");
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
