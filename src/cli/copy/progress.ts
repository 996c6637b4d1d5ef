/**
 * What cp prints: a live progress line on a terminal (stderr, redrawn with
 * \r), plain lines every few seconds when stderr is not a terminal (no
 * control codes), JSON lines with --json (stdout), and always a summary
 * unless -q.
 */
export type OutputMode = "human" | "json" | "quiet" | "none";

/** Where a copy is: sent with every chunk or batch that completes (`"progress"` events of the library's copy()). */
export interface CopyProgress {
  /** Bytes copied so far (files skipped by --resume not counted). */
  bytes: number;
  /** Bytes found already in place (resume) and not copied. */
  skipped: number;
  /** Bytes of every file of the copy (known once the copy is planned; 0 before). */
  total: number;
  /** Files completed. */
  files: number;
  /** Seconds since the copy started. */
  seconds: number;
  /** The file being copied. */
  file: string;
}

/** A file (or source) that could not be copied; the copy goes on with the others. */
export interface CopyFileError {
  path: string;
  code: string;
  message: string;
}

/** What a Progress tells a program (the library's copy()). */
export interface ProgressListener {
  progress(p: CopyProgress): void;
  error(e: CopyFileError): void;
}

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
  /** Where --json lines and the summary go: stdout, unless stdout carries the data (`cp remote -`). */
  out: { write(s: string): unknown } = process.stdout;

  /** `mode` "none": nothing is written (the library); `listener` hears every step in any mode. */
  constructor(
    readonly mode: OutputMode,
    private readonly listener: ProgressListener | null = null,
  ) {
    this.tty = process.stderr.isTTY === true;
  }

  get seconds(): number {
    return (performance.now() - this.t0) / 1000;
  }

  add(n: number): void {
    this.done += n;
    if (this.listener !== null) this.listener.progress(this.snapshot());
    this.tick();
  }

  snapshot(): CopyProgress {
    return { bytes: this.done, skipped: this.skipped, total: this.total, files: this.files, seconds: this.seconds, file: this.file };
  }

  fail(path: string, code: string, message: string): void {
    this.errors.push({ path, code, message });
    if (this.listener !== null) this.listener.error({ path, code, message });
    if (this.mode === "none") return;
    if (this.mode === "json") this.out.write(JSON.stringify({ type: "error", path, code, message }) + "\n");
    else {
      this.clear();
      process.stderr.write(`async-rdma cp: ${path}: ${message} (${code})\n`);
    }
  }

  note(text: string): void {
    if (this.mode === "json") this.out.write(JSON.stringify({ type: "note", message: text }) + "\n");
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
    if (this.mode === "quiet" || this.mode === "none" || (!force && now - this.last < every)) return;
    this.last = now;
    const s = this.seconds;
    const rate = s > 0 ? this.done / s : 0;
    const left = this.total - this.skipped - this.done;
    const eta = rate > 0 ? Math.max(0, left / rate) : null;
    if (this.mode === "json") {
      this.out.write(JSON.stringify({ type: "progress", bytes: this.done, skipped: this.skipped, total: this.total, seconds: +s.toFixed(3), rate: Math.round(rate), eta: eta === null ? null : +eta.toFixed(1), file: this.file }) + "\n");
      return;
    }
    const pct = this.total > 0 ? Math.floor(((this.done + this.skipped) * 100) / this.total) : 100;
    const line = `${pct}% ${bytesText(this.done + this.skipped)}/${bytesText(this.total)} ${mb(rate)} MB/s ETA ${eta === null ? "--" : `${Math.ceil(eta)}s`} ${this.file}`;
    if (this.tty) {
      process.stderr.write(`\r\x1b[K${line.slice(0, (process.stderr.columns ?? 100) - 1)}`);
      this.drawn = true;
    } else process.stderr.write(line + "\n");
  }

  /** The --json result line (and the library's result). */
  result(): { type: "result"; ok: boolean; files: number; filesSkipped: number; bytes: number; skipped: number; seconds: number; mbps: number; errors: number; calls: number } {
    const s = this.seconds;
    const rate = s > 0 ? this.done / s / 1e6 : 0;
    return { type: "result", ok: this.errors.length === 0, files: this.files, filesSkipped: this.filesSkipped, bytes: this.done, skipped: this.skipped, seconds: +s.toFixed(3), mbps: +rate.toFixed(1), errors: this.errors.length, calls: this.calls };
  }

  summary(): void {
    const s = this.seconds;
    const rate = s > 0 ? this.done / s / 1e6 : 0;
    const r = this.result();
    if (this.mode === "none") return;
    if (this.mode === "json") {
      this.out.write(JSON.stringify(r) + "\n");
      return;
    }
    this.clear();
    if (this.mode === "quiet") return;
    const skip = this.skipped > 0 || this.filesSkipped > 0 ? `, skipped ${bytesText(this.skipped)} already there (${this.filesSkipped} whole files)` : "";
    const err = this.errors.length > 0 ? `, ${this.errors.length} failed` : "";
    this.out.write(`${this.files} files, ${bytesText(this.done)} in ${s.toFixed(2)} s, ${rate.toFixed(1)} MB/s${skip}${err}\n`);
  }
}
