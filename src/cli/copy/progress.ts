/**
 * What cp prints: a live progress line on a terminal (stderr, redrawn with
 * \r), plain lines every few seconds when stderr is not a terminal (no
 * control codes), JSON lines with --json (stdout), and always a summary
 * unless -q.
 */
export type OutputMode = "human" | "json" | "quiet";

function mb(n: number): string {
  return (n / 1e6).toFixed(1);
}

function bytesText(n: number): string {
  if (n >= 1 << 30) return `${(n / (1 << 30)).toFixed(2)} GiB`;
  if (n >= 1 << 20) return `${(n / (1 << 20)).toFixed(1)} MiB`;
  if (n >= 1 << 10) return `${(n / (1 << 10)).toFixed(1)} KiB`;
  return `${n} B`;
}

export class Progress {
  total = 0;
  done = 0;
  skipped = 0;
  files = 0;
  filesSkipped = 0;
  /** Round trips to the server (calls of the protocol). */
  calls = 0;
  file = "";
  readonly errors: { path: string; code: string; message: string }[] = [];
  private readonly t0 = performance.now();
  private last = 0;
  private readonly tty: boolean;
  private drawn = false;
  private stopAt: number;

  constructor(readonly mode: OutputMode) {
    this.tty = process.stderr.isTTY === true;
    // Test seam: stop this process (SIGSTOP) once this many bytes are copied, after saying so on stdout,
    // so a test can kill a peer mid-copy at a known point instead of racing the copy.
    this.stopAt = Number(process.env.ASYNC_RDMA_CP_STOP_AFTER ?? Infinity);
  }

  get seconds(): number {
    return (performance.now() - this.t0) / 1000;
  }

  add(n: number): void {
    this.done += n;
    if (this.done >= this.stopAt) {
      process.stdout.write(JSON.stringify({ type: "stopped", bytes: this.done }) + "\n");
      this.stopAt = Infinity;
      process.kill(process.pid, "SIGSTOP");
    }
    this.tick();
  }

  fail(path: string, code: string, message: string): void {
    this.errors.push({ path, code, message });
    if (this.mode === "json") process.stdout.write(JSON.stringify({ type: "error", path, code, message }) + "\n");
    else {
      this.clear();
      process.stderr.write(`async-rdma cp: ${path}: ${message} (${code})\n`);
    }
  }

  note(text: string): void {
    if (this.mode === "json") process.stdout.write(JSON.stringify({ type: "note", message: text }) + "\n");
    else if (this.mode === "human") {
      this.clear();
      process.stderr.write(`async-rdma cp: ${text}\n`);
    }
  }

  private clear(): void {
    if (this.drawn) process.stderr.write("\r\x1b[K");
    this.drawn = false;
  }

  tick(force = false): void {
    const now = performance.now();
    const every = this.mode === "json" ? 500 : this.tty ? 200 : 5000;
    if (this.mode === "quiet" || (!force && now - this.last < every)) return;
    this.last = now;
    const s = this.seconds;
    const rate = s > 0 ? this.done / s : 0;
    const left = this.total - this.skipped - this.done;
    const eta = rate > 0 ? Math.max(0, left / rate) : null;
    if (this.mode === "json") {
      process.stdout.write(JSON.stringify({ type: "progress", bytes: this.done, skipped: this.skipped, total: this.total, seconds: +s.toFixed(3), rate: Math.round(rate), eta: eta === null ? null : +eta.toFixed(1), file: this.file }) + "\n");
      return;
    }
    const pct = this.total > 0 ? Math.floor(((this.done + this.skipped) * 100) / this.total) : 100;
    const line = `${pct}% ${bytesText(this.done + this.skipped)}/${bytesText(this.total)} ${mb(rate)} MB/s ETA ${eta === null ? "--" : `${Math.ceil(eta)}s`} ${this.file}`;
    if (this.tty) {
      process.stderr.write(`\r\x1b[K${line.slice(0, (process.stderr.columns ?? 100) - 1)}`);
      this.drawn = true;
    } else process.stderr.write(line + "\n");
  }

  summary(): void {
    const s = this.seconds;
    const rate = s > 0 ? this.done / s / 1e6 : 0;
    const r = { type: "result", ok: this.errors.length === 0, files: this.files, filesSkipped: this.filesSkipped, bytes: this.done, skipped: this.skipped, seconds: +s.toFixed(3), mbps: +rate.toFixed(1), errors: this.errors.length, calls: this.calls };
    if (this.mode === "json") {
      process.stdout.write(JSON.stringify(r) + "\n");
      return;
    }
    this.clear();
    if (this.mode === "quiet") return;
    const skip = this.skipped > 0 || this.filesSkipped > 0 ? `, skipped ${bytesText(this.skipped)} already there (${this.filesSkipped} whole files)` : "";
    const err = this.errors.length > 0 ? `, ${this.errors.length} failed` : "";
    process.stdout.write(`${this.files} files, ${bytesText(this.done)} in ${s.toFixed(2)} s, ${rate.toFixed(1)} MB/s${skip}${err}\n`);
  }
}
