/**
 * Side-channel test tools: a raw client (JSON lines by hand) and a
 * line-by-line man in the middle between a client and a listener.
 */
import net from "node:net";

/** A raw side-channel client: lines in, with a deadline on each wait. */
export class RawClient {
  readonly sock: net.Socket;
  private buf = "";
  private closed = false;
  private wake: (() => void) | null = null;

  private constructor(sock: net.Socket) {
    this.sock = sock;
    sock.setEncoding("utf8");
    sock.on("data", (d: string) => {
      this.buf += d;
      this.wake?.();
    });
    sock.on("error", () => {});
    sock.on("close", () => {
      this.closed = true;
      this.wake?.();
    });
  }

  /** `from`: the local address (another loopback address, 127.0.0.2, is another source to the server). */
  static open(port: number, host = "127.0.0.1", from?: string): Promise<RawClient> {
    return new Promise((resolve, reject) => {
      const s = net.connect({ port, host, ...(from === undefined ? {} : { localAddress: from }) });
      s.once("connect", () => resolve(new RawClient(s)));
      s.once("error", reject);
    });
  }

  send(v: unknown): void {
    this.sock.write(typeof v === "string" ? v : JSON.stringify(v) + "\n");
  }

  /** The next line from the server, or null when it closed first. */
  async line(ms = 60_000): Promise<string | null> {
    const end = performance.now() + ms;
    for (;;) {
      const i = this.buf.indexOf("\n");
      if (i >= 0) {
        const l = this.buf.slice(0, i);
        this.buf = this.buf.slice(i + 1);
        return l;
      }
      if (this.closed) return null;
      const left = end - performance.now();
      if (left <= 0) throw new Error(`no line from the server within ${ms} ms`);
      await new Promise<void>((r) => {
        const t = setTimeout(r, left);
        this.wake = () => {
          clearTimeout(t);
          r();
        };
      });
      this.wake = null;
    }
  }

  /** The next line as an object (throws when the server closed instead). */
  async json(ms?: number): Promise<Record<string, unknown>> {
    const l = await this.line(ms);
    if (l === null) throw new Error("the server closed the side channel");
    return JSON.parse(l) as Record<string, unknown>;
  }

  /** Resolves once the server closed the side channel. */
  async closedByServer(ms = 60_000): Promise<void> {
    while ((await this.line(ms)) !== null) {
      /* drain */
    }
  }

  destroy(): void {
    this.sock.destroy();
  }
}

/** A line's direction through the proxy: "up" client → server, "down" server → client. */
export type Direction = "up" | "down";

/**
 * A man in the middle on the side channel: forwards every line, letting
 * `edit` change it (return the line to forward), and records what went each
 * way (before editing).
 */
export class LineProxy {
  readonly lines: { dir: Direction; line: string }[] = [];
  private readonly socks = new Set<net.Socket>();
  private constructor(
    private readonly srv: net.Server,
    readonly port: number,
  ) {}

  static async start(target: number, edit: (dir: Direction, line: string, index: number) => string = (_d, l) => l): Promise<LineProxy> {
    const srv = net.createServer();
    await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
    const p = new LineProxy(srv, (srv.address() as net.AddressInfo).port);
    srv.on("connection", (down) => {
      const up = net.connect(target, "127.0.0.1");
      p.socks.add(down);
      p.socks.add(up);
      const counts = { up: 0, down: 0 };
      const pipe = (from: net.Socket, to: net.Socket, dir: Direction): void => {
        let buf = "";
        from.setEncoding("utf8");
        from.on("data", (d: string) => {
          buf += d;
          let i: number;
          while ((i = buf.indexOf("\n")) >= 0) {
            const line = buf.slice(0, i);
            buf = buf.slice(i + 1);
            p.lines.push({ dir, line });
            if (!to.destroyed) to.write(edit(dir, line, counts[dir]++) + "\n");
          }
        });
        from.on("end", () => to.end());
        from.on("close", () => to.destroy());
        from.on("error", () => {});
      };
      pipe(down, up, "up");
      pipe(up, down, "down");
    });
    return p;
  }

  close(): Promise<void> {
    for (const s of this.socks) s.destroy();
    return new Promise<void>((r) => this.srv.close(() => r()));
  }
}
