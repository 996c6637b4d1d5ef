/**
 * A one-line progress indicator for long CLI runs (`perf -a`, `cp`): shown on
 * stderr only when stderr is a terminal, rewritten in place, and erased before
 * anything else is printed, so piped or redirected output gets nothing extra.
 */
export interface Progress {
  /** Replaces the progress line (no-op when not on a terminal). */
  update(text: string): void;
  /** Erases the line; call before printing a result to the same terminal. */
  clear(): void;
}

export function progressLine(stream: NodeJS.WriteStream = process.stderr): Progress {
  if (!stream.isTTY) return { update() {}, clear() {} };
  let shown = false;
  return {
    update(text: string): void {
      const width = Math.max(10, (stream.columns || 80) - 1);
      stream.write(`\r\x1b[K${text.length > width ? text.slice(0, width) : text}`);
      shown = true;
    },
    clear(): void {
      if (shown) stream.write("\r\x1b[K");
      shown = false;
    },
  };
}
