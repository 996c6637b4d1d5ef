/**
 * What a copy runs with: its settings (`Options`, the command's options or
 * the library's CopyOptions) and their measured defaults, the command's
 * usage text, and how a path names a remote file (scp syntax).
 */
import { DEFAULT_PORT } from "./common.js";
import type { OutputMode } from "./progress.js";

/** Measured defaults (docs/performance.md, "cp"). */
export const DEFAULT_CHUNK = 1024 * 1024;
export const DEFAULT_DEPTH = 8;
/**
 * Every call to the server has a deadline: a server that is alive (its
 * transport answers) but never replies must not hang cp. The longest
 * legitimate call is a large file's final flush or a listing of a very
 * large tree, well under this.
 */
export const DEFAULT_TIMEOUT_S = 120;

export const USAGE = `usage: async-rdma cp [options] src... dest
Copies files to or from an \`async-rdma serve\` server. A remote path is
host:path or host:port:path (scp syntax; paths are relative to the served
directory). Either every src is remote (download) or dest is (upload).
A src of - uploads stdin (dest names the file); a dest of - writes the
one remote file named by src to stdout (progress and summary on stderr).

  -r, --recursive         copy directories
      --resume            continue an interrupted copy: files already complete
                          (same size and mtime) are skipped, a partial file
                          continues from its verified prefix
      --no-verify         no CRC-32 checks (faster, less CPU)
      --keep-setid        downloads keep the setuid/setgid bits the server sends
                          (by default they are dropped)
      --chunk <size>      bytes per chunk (default 1m; 4k to 16m)
      --depth <n>         chunks in flight (default ${DEFAULT_DEPTH}; 1 to 64)
      --timeout <s>       seconds the server may take to answer a call
                          (default ${DEFAULT_TIMEOUT_S}; 0: no limit)
      --provider <p>      tcp, verbs or auto (default auto)
      --auth-key-file <f> authenticate with the key in this file (not
                          readable by others: chmod 600)
      --json              progress and result as JSON lines on stdout
  -q, --quiet             no progress, no summary
  -h, --help              this help

Examples:
  async-rdma cp big.iso server:isos/          upload into the directory isos/
  async-rdma cp -r server:7000:photos ./      download a tree from port 7000
  async-rdma cp --resume big.iso server:      continue after an interruption
  tar c dir | async-rdma cp - server:dir.tar  upload a pipe
  async-rdma cp server:dir.tar - | tar x      download into a pipe
`;

export interface Remote {
  host: string;
  port: number;
  path: string;
}

/** host:path, host:port:path, [v6]:path, [v6]:port:path; local when it starts with / or . or has no colon. */
export function parseRemote(s: string): Remote | null {
  if (s.startsWith("/") || s.startsWith(".")) return null;
  let host: string;
  let rest: string;
  if (s.startsWith("[")) {
    const e = s.indexOf("]:");
    if (e < 0) return null;
    host = s.slice(1, e);
    rest = s.slice(e + 2);
  } else {
    const c = s.indexOf(":");
    if (c <= 0) return null;
    host = s.slice(0, c);
    if (host.includes("/")) return null;
    rest = s.slice(c + 1);
  }
  const m = /^(\d{1,5}):(.*)$/s.exec(rest);
  if (m) return { host, port: Number(m[1]), path: m[2]! };
  return { host, port: DEFAULT_PORT, path: rest };
}

/** The settings of one copy (the command's options, or the library's CopyOptions). */
export interface Options {
  recursive: boolean;
  resume: boolean;
  verify: boolean;
  chunk: number;
  depth: number;
  provider: string | undefined;
  keyFile: string | undefined;
  mode: OutputMode;
  /** Downloads keep the setuid/setgid bits the server sends (--keep-setid). */
  keepSetid: boolean;
  /** Deadline of every call to the server, ms (0: none). */
  timeoutMs: number;
  /** Uploads pulled by the server with RDMA READ (the measurement switch ASYNC_RDMA_CP_UPLOAD=read). */
  pull: boolean;
}

/** Default settings of a copy (the command's defaults). */
export function defaultOptions(): Options {
  return { recursive: false, resume: false, verify: true, chunk: DEFAULT_CHUNK, depth: DEFAULT_DEPTH, provider: undefined, keyFile: undefined, mode: "human", keepSetid: false, timeoutMs: DEFAULT_TIMEOUT_S * 1000, pull: false };
}
