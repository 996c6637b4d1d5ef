/**
 * Completion polling for one connection's CQ, in three modes:
 *
 * - "event": arm the CQ and wait for the completion channel;
 * - "busy": never arm while the connection is open; poll once per event-loop
 *   turn (setImmediate);
 * - "adaptive" (default): poll, unarmed, for `spinUs` after any activity (a
 *   post, a send completion, an arrival), then arm; on an event-driven CQ,
 *   only in a running exchange (below).
 *
 * In busy and adaptive modes a post is followed by a synchronous poll when
 * nothing else was outstanding (a software device or a loopback often
 * completes inside the post), at most SYNC_POLLS per event-loop turn so a
 * chain of always-ready completions cannot starve timers and I/O. At most
 * POLL_BUDGET completions are handled per turn.
 *
 * On an event-driven CQ (the tcp provider: completions are made by this
 * thread's own socket events) the CQ stays armed in every mode, since a
 * poll between two events cannot find anything: busy and adaptive instead
 * keep the event loop turning (one Immediate per turn) for as long as they
 * would poll, so the next socket event is read without the process going
 * to sleep in epoll and being woken again (on a 2-core VM that wake-up cost
 * more than the whole round trip's JavaScript: an RPC call at concurrency 1
 * went from about 100 to 30 µs). Adaptive there turns for spinUs after
 * activity only in a running exchange. A post opens a wait; the
 * completions after which nothing is outstanding close it (sends not yet
 * acknowledged, work queued for credits, a rendezvous send awaiting its
 * RNDV_DONE: the `waiting` callback). A wait opened after more than
 * IDLE_SPIN_FACTOR × spinUs of idle time (since the last wait closed) is
 * not spun, nor is the time after it, nor an arrival after such idle time;
 * the exchange counts as running again once a post follows the close of a
 * wait within that time, completions come while a wait goes on, or two
 * drains within it of each other bring received messages (a side that
 * only receives; a burst read at once counts once).
 * In traffic sparser than that the peer sleeps too, its wake-up outlasts
 * the spin, and the spin is paid for nothing (one call per millisecond
 * cost each side 60-80 µs of CPU per call). On tcp a send completes when
 * the peer's ACK arrives, which rides on the peer's next message if it
 * posts one in the same turn of its loop, else goes alone at the end of
 * that turn. On verbs, where none of this is tracked, adaptive spins after
 * any activity.
 *
 * Spinning pays only while this process has a core to itself. When it
 * waits for a core while runnable (another runnable process wants it, often
 * the very peer whose completion it waits for), busy and adaptive sleep on
 * completion events (as "event" does) for a back-off period, and try
 * spinning again after it. One detector per thread ({@link Contention}),
 * shared by every poller of that thread.
 */
import { closeSync, openSync, readSync } from "node:fs";
import { CompletionBuffer, WcOpcode, type CompletionQueue } from "../transport/types.js";

/** A cumulative reading of how much this thread was kept from running, and when that means contention. */
export interface ContentionSignal {
  readonly name: string;
  /** Cumulative and non-decreasing. */
  read(): number;
  /** Did the reading grow by `delta` over `windowMs` of spinning because the CPU is oversubscribed? */
  exceeded(delta: number, windowMs: number): boolean;
}

/**
 * Linux schedstat: milliseconds this thread spent runnable but waiting for a
 * CPU (/proc/thread-self/schedstat, second field), read with one pread on a
 * descriptor kept open. Contention: a fifth of the window or more spent
 * waiting. A short kernel thread or a helper thread of this process that
 * takes the core for microseconds does not count; two spinning processes per
 * core wait about half the time. Null where the file is missing.
 */
export function runQueueWait(): ContentionSignal | null {
  let fd: number;
  try {
    fd = openSync("/proc/thread-self/schedstat", "r");
  } catch {
    return null;
  }
  const buf = Buffer.alloc(96);
  const read = (): number => {
    const n = readSync(fd, buf, 0, buf.length, 0);
    const text = buf.toString("latin1", 0, n);
    const a = text.indexOf(" ");
    return Number(text.slice(a + 1, text.indexOf(" ", a + 1))) / 1e6;
  };
  try {
    if (!Number.isFinite(read())) throw new Error("unexpected schedstat");
  } catch {
    closeSync(fd);
    return null;
  }
  return { name: "run-queue wait", read, exceeded: (delta, windowMs) => delta >= 0.2 * windowMs };
}

/** Fallback: the process's involuntary context switches (getrusage; all threads); two in a window. */
export const involuntarySwitches: ContentionSignal = {
  name: "involuntary context switches",
  read: () => process.resourceUsage().involuntaryContextSwitches,
  exceeded: (delta) => delta >= 2,
};

/**
 * Is the CPU oversubscribed? Takes a reading of its signal at most every
 * `probeMs` of spinning and, when the signal says so for that window, says
 * "contended" for a back-off period: `minBackoffMs`, doubled on each
 * contended window up to `maxBackoffMs`, halved on each clean one. A window that was not all spinning (the first one, one
 * longer than `staleMs` (twice `probeMs`), the one right after a back-off) only takes a
 * reading: the time asleep in it says nothing either way.
 */
export class Contention {
  private lastProbe = -Infinity;
  private last = 0;
  private until = -Infinity;
  private afterBackoff = false;
  private backoff: number;
  private sig: ContentionSignal | null = null;
  /** Back-off periods started (stats, tests). */
  yields = 0;
  /** Empty polls after which a busy or adaptive poller slept on events because of contention. */
  gaveWay = 0;

  constructor(
    /** Chosen at the first probe when not given: run-queue wait, else involuntary switches. */
    signal: ContentionSignal | null = null,
    private readonly probeMs = 10,
    private readonly minBackoffMs = 20,
    private readonly maxBackoffMs = 640,
    /** A window longer than this was not all spinning. */
    private readonly staleMs = 2 * probeMs,
  ) {
    this.sig = signal;
    this.backoff = minBackoffMs;
  }

  get signal(): ContentionSignal {
    return (this.sig ??= runQueueWait() ?? involuntarySwitches);
  }

  /** Replaces the signal (tests) and forgets every reading and back-off. */
  reset(signal: ContentionSignal | null = this.sig): void {
    this.sig = signal;
    this.lastProbe = -Infinity;
    this.until = -Infinity;
    this.afterBackoff = false;
    this.backoff = this.minBackoffMs;
  }

  /** Inside a back-off period: pollers sleep on events. */
  inBackoff(now: number): boolean {
    return now < this.until;
  }

  /** True while spinning should give way (called with performance.now() on an empty poll). */
  contended(now: number): boolean {
    if (now < this.until) return true;
    const window = now - this.lastProbe;
    if (window < this.probeMs) return false;
    let v: number;
    try {
      v = this.signal.read();
    } catch {
      // The reading failed (its descriptor closed under it, say): the fallback from now on.
      this.reset(involuntarySwitches);
      return false;
    }
    const delta = v - this.last;
    this.last = v;
    this.lastProbe = now;
    if (window > this.staleMs || this.afterBackoff) {
      this.afterBackoff = false;
      return false;
    }
    if (!this.signal.exceeded(delta, window)) {
      // Halved, not reset: when every poller of an oversubscribed machine backs off at once, the
      // next window is clean for everybody, and a reset would have them all spin again together.
      this.backoff = Math.max(this.minBackoffMs, this.backoff / 2);
      return false;
    }
    this.until = now + this.backoff;
    this.afterBackoff = true;
    this.backoff = Math.min(this.backoff * 2, this.maxBackoffMs);
    this.yields++;
    return true;
  }
}

/** This thread's detector (every connection's poller asks the same one). */
export const contention = new Contention();

/** How completions are noticed: "event" (sleep until the device signals), "busy" (poll every event-loop turn) or "adaptive" (poll for spinUs after activity, then sleep). See RdmaBuilder.setPolling. */
export type PollingMode = "event" | "busy" | "adaptive";

/** Completions handled per event-loop turn before yielding ("512 ops" as zeromq.js does). */
const POLL_BUDGET = 512;
/**
 * Event-driven CQ, adaptive mode: a connection idle (no wait open) for
 * more than this many times spinUs is in sparse traffic, and does not
 * spin (see the header). A connection's first wait spins.
 */
const IDLE_SPIN_FACTOR = 4;
/** Synchronous CQ polls after posting, per event-loop turn, in busy and adaptive modes. */
const SYNC_POLLS = 64;

/**
 * Pollers of event-driven CQs keeping the loop turning: one Immediate per
 * turn serves all of this thread's (swapped lists, reused: a turn allocates
 * nothing).
 */
let turners: Poller[] = [];
let turnersSpare: Poller[] = [];
let turnScheduled = false;

function turnAll(): void {
  turnScheduled = false;
  const list = turners;
  turners = turnersSpare;
  turnersSpare = list;
  const now = performance.now();
  for (let i = 0; i < list.length; i++) list[i]!.onTurn(now);
  list.length = 0;
}

export class Poller {
  private readonly cbuf = new CompletionBuffer(128);
  /** Inside a drain (completion handlers run): batched work waits for its end. */
  draining = false;
  private scheduled = false;
  private syncPolls = 0;
  private lastActivity = 0;
  private stopped = false;

  private readonly mode: PollingMode;

  constructor(
    private readonly cq: CompletionQueue,
    mode: PollingMode,
    private readonly spinUs: number,
    /** One completion: entry `i` of the buffer. */
    private readonly onCompletion: (b: CompletionBuffer, i: number) => void,
    /** After each drain (post batched receives, tear down when drained). */
    private readonly afterDrain: () => void,
    private readonly detector: Contention = contention,
    /**
     * Event-driven CQ, adaptive mode: is the connection waiting for
     * something (parts.ts: sends not yet acknowledged, work queued, a
     * rendezvous send awaiting RNDV_DONE)? A post opens a wait, the
     * completions after which this is false close it, and the time between
     * two waits is the connection's idle time.
     */
    private readonly waiting: () => boolean = () => true,
  ) {
    this.mode = mode;
    // A CQ whose completions only this thread's event loop produces (tcp) has nothing to
    // find between notifications: it stays armed, and spinning only keeps the loop awake.
    this.eventDriven = cq.eventDriven === true;
    cq.onNotify = () => this.pollNow();
  }

  private readonly eventDriven: boolean;

  start(): void {
    if (this.mode !== "busy" || this.eventDriven) this.cq.requestNotify();
    this.pollNow();
  }

  /**
   * When the drain under way started (performance.now(), read once per
   * drain): the time of every completion it hands out. Completions are
   * handed out only inside a drain, so it is older than the event by at
   * most the drain's length (on verbs, a completion that lands during the
   * drain), never by more.
   */
  drainTime = 0;

  /** Something happened (an arrival, inside a drain): adaptive mode keeps spinning for a while. */
  touch(): void {
    this.lastActivity = this.drainTime;
  }

  pollNow(): void {
    if (this.draining || this.stopped) return;
    this.draining = true;
    try {
      this.drain();
    } finally {
      this.draining = false;
    }
    this.afterDrain();
  }

  /** A list of `n` work requests was just posted (at `now`), `outstanding` now in the send queue. */
  afterPost(n: number, outstanding: number, now: number = performance.now()): void {
    this.lastActivity = now;
    if (this.mode === "event") return;
    // Event-driven: a post while no wait is open opens one.
    if (this.eventDriven && !this.waitingNow) {
      this.waitingNow = true;
      this.idleLong = this.idleFrom >= 0 && this.lastActivity - this.idleFrom > (IDLE_SPIN_FACTOR * this.spinUs) / 1000;
    }
    // In a back-off period the poller is armed (or already scheduled): no poll, no spin.
    if (this.detector.inBackoff(this.lastActivity)) return;
    // Only when nothing else was outstanding (a request/response step): with a window in
    // flight the poll loop is already running and an extra poll per post only costs. An
    // event-driven CQ completes nothing inside a post.
    if (this.eventDriven) {
      if (this.keepAlive && !(this.mode === "adaptive" && this.idleLong)) this.turn();
      return;
    }
    if (outstanding === n && this.syncPolls < SYNC_POLLS) {
      this.syncPolls++;
      this.pollNow();
    }
    this.schedule();
  }

  /** Whether this connection keeps the process alive (Rdma.ref/unref). */
  private keepAlive = true;

  /**
   * Unref'd (false), the CQ no longer holds the event loop while armed, and
   * busy and adaptive modes sleep on completion events between completions
   * (their per-turn Immediate would hold the loop).
   */
  setKeepAlive(on: boolean): void {
    this.keepAlive = on;
    this.cq.setKeepAlive?.(on);
  }

  /** Failing: flushed completions must still be seen, whatever the mode. */
  armForFlush(): void {
    if (!this.stopped) this.cq.requestNotify();
  }

  stop(): void {
    this.stopped = true;
    this.cq.onNotify = null;
  }

  private drain(): void {
    // A wait opened by a post inside this drain is not one that completions came during.
    const waitBefore = this.waitingNow;
    this.drainTime = performance.now();
    let budget = POLL_BUDGET;
    let n: number;
    let arrived = false;
    const b = this.cbuf;
    // A completion may end the connection (its teardown stops this poller and destroys the
    // CQ): nothing is polled or armed after that.
    while (budget > 0 && !this.stopped && (n = this.cq.poll(b, Math.min(b.capacity, budget))) > 0) {
      budget -= n;
      for (let i = 0; i < n && !this.stopped; i++) {
        if (b.opcode[i]! >= WcOpcode.RECV) arrived = true;
        this.onCompletion(b, i);
      }
    }
    if (this.stopped) return;
    const now = performance.now();
    if (this.eventDriven && budget < POLL_BUDGET) this.endOfWait(now, waitBefore, arrived);
    if (budget === 0) return this.schedule();
    // Kept waiting for a core while spinning: another process needs it; sleep on events for a while.
    const giveWay = this.mode !== "event" && this.detector.contended(now);
    if (giveWay) this.detector.gaveWay++;
    let spin = false;
    // Busy: on verbs the CQ is never armed while the connection is open, so no completion
    // ever takes the event path (channel read, ack and re-arm, three syscalls).
    if (this.mode === "busy" && !giveWay && this.keepAlive) spin = true;
    else if (this.mode === "adaptive" && !giveWay) {
      // Keep polling, unarmed, for a short bounded time after any activity: the next
      // completion often follows closely, and in a request/response exchange the answer
      // arrives while nothing is outstanding here. Then fall back to completion events.
      if (budget < POLL_BUDGET) this.lastActivity = now;
      // Unref'd, as busy: the per-turn Immediate would hold the process.
      spin = this.keepAlive && now - this.lastActivity < this.spinUs / 1000 && (!this.eventDriven || this.runningExchange(now));
    }
    if (spin && !this.eventDriven) return this.schedule();
    // Arm, then poll once more: a completion between the last poll and the arm raises no event.
    this.cq.requestNotify();
    while (!this.stopped && (n = this.cq.poll(b)) > 0) for (let i = 0; i < n && !this.stopped; i++) this.onCompletion(b, i);
    // Event-driven and spinning: armed, and the loop keeps turning without sleeping in epoll.
    if (spin) this.turn();
  }

  /**
   * Event-driven CQ: keeps the event loop turning (one Immediate per turn)
   * while this poller would poll. A turn does nothing else: the CQ is armed,
   * and its notification comes inside the socket read that completes work.
   */
  private turn(): void {
    if (this.turning || this.stopped) return;
    this.turning = true;
    turners.push(this);
    if (!turnScheduled) {
      turnScheduled = true;
      setImmediate(turnAll);
    }
  }

  private turning = false;

  /** A turn of the loop it kept turning (turnAll): another one while it would still poll. */
  onTurn(now: number): void {
    this.turning = false;
    if (this.stopped || this.mode === "event") return;
    if (this.detector.contended(now)) {
      this.detector.gaveWay++;
      return;
    }
    if (this.keepAlive && (this.mode === "busy" || (now - this.lastActivity < this.spinUs / 1000 && this.runningExchange(now)))) this.turn();
  }

  /**
   * Event-driven: the wait bookkeeping after a drain that brought
   * completions (`arrived`: a message among them).
   */
  private endOfWait(now: number, waitBefore: boolean, arrived: boolean): void {
    // Messages arriving in rhythm (the one before within IDLE_SPIN_FACTOR × spinUs): the
    // exchange runs, even for a side that only receives (its waits are its CREDIT messages).
    if (arrived) {
      if (this.lastArrival >= 0 && now - this.lastArrival <= (IDLE_SPIN_FACTOR * this.spinUs) / 1000) {
        this.idleLong = false;
        if (!this.waitingNow) this.idleFrom = now;
      }
      this.lastArrival = now;
    }
    if (!this.waitingNow) return;
    // Completions ended the wait (nothing outstanding): idle from now; or came while it goes
    // on (a window in flight): the exchange runs, whatever the idle time before.
    if (!this.waiting()) {
      this.waitingNow = false;
      this.idleFrom = now;
    } else if (waitBefore) this.idleLong = false;
  }

  /** Event-driven: when the last message arrived (-1: none yet). */
  private lastArrival = -1;
  /** Event-driven: the connection waits for something (work outstanding), as of the last post or drain. */
  private waitingNow = false;
  /** Event-driven: when it last stopped waiting (performance.now(); -1: never waited). */
  private idleFrom = -1;
  /**
   * Event-driven: the verdict "sparse": set when a wait opens after more
   * than IDLE_SPIN_FACTOR × spinUs idle, cleared by completions during a
   * wait and by messages in rhythm.
   */
  private idleLong = false;

  /**
   * Event-driven, adaptive: is this a running exchange, where a spin can
   * catch the next event? Not under the "sparse" verdict (idleLong), nor
   * while idle for long now (messages in rhythm reset the idle time): traffic that
   * sparse lets the peer sleep too, and its wake-up outlasts any spin. The
   * idle time decides, not the length of the waits: a wait measured while
   * both sides sleep includes both wake-ups, and would keep an exchange
   * that could run at spinning speed at sleeping speed.
   */
  private runningExchange(now: number): boolean {
    return !this.idleLong && (this.waitingNow || this.idleFrom < 0 || now - this.idleFrom <= (IDLE_SPIN_FACTOR * this.spinUs) / 1000);
  }

  private schedule(): void {
    if (this.scheduled || this.stopped) return;
    this.scheduled = true;
    setImmediate(() => {
      this.scheduled = false;
      this.syncPolls = 0;
      this.pollNow();
    });
  }
}
