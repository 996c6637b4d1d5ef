/**
 * The idle timeout an RdmaStream has as a `net.Socket` (`setTimeout(ms)`).
 *
 * Invariant: the countdown restarts on every read or write and fires once
 * per idle period; it never holds the process open (unref'd) and never ends
 * the stream by itself: the stream emits 'timeout' and the application
 * decides. A timeout of 0 stops it.
 */
export class IdleTimer {
  /** The timeout in ms (0: none). */
  ms = 0;
  private timer: NodeJS.Timeout | null = null;

  constructor(private readonly fire: () => void) {}

  /** Activity: restarts the countdown (stops it when the timeout is 0). */
  touch(): void {
    if (this.ms === 0) return this.clear();
    if (this.timer) return void this.timer.refresh();
    this.timer = setTimeout(() => {
      this.timer = null;
      this.fire();
    }, this.ms).unref();
  }

  /** Stops the countdown. */
  clear(): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
  }
}
