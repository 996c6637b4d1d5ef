// Shared pieces of the bench/ comparisons: start a server, wait for the line
// that says it is ready (never a fixed sleep), run the client, collect
// output; medians; ratio tables; network namespaces.
import { spawn, spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { existsSync } from "node:fs";
import os from "node:os";

export const ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const CLI = join(ROOT, "dist", "src", "cli", "main.js");
export const NODE = process.execPath;

export function requireBuild() {
  if (!existsSync(CLI)) {
    console.error(`${CLI} is missing: run npm run build first`);
    process.exit(1);
  }
}

/** Quotes a command for display (what to paste into a shell from the repository root). */
export function shellQuote(argv) {
  return argv
    .map((a) => (a === NODE ? "node" : String(a).startsWith(ROOT + "/") ? String(a).slice(ROOT.length + 1) : String(a)))
    .map((a) => (/^[\w@%+=:,./-]+$/.test(a) ? a : `'${a.replace(/'/g, `'\\''`)}'`))
    .join(" ");
}

/**
 * Spawns `argv` (optionally inside a network namespace) and resolves once a
 * stdout line matches `ready` (the match is returned), rejecting if the
 * process exits first or `timeoutMs` passes. Output keeps being collected.
 */
export function startServer(argv, { ready, netns = null, timeoutMs = 30_000, env = process.env } = {}) {
  const full = netns ? ["ip", "netns", "exec", netns, ...argv] : argv;
  const child = spawn(full[0], full.slice(1), { stdio: ["ignore", "pipe", "pipe"], env });
  const proc = { child, cmd: shellQuote(full), stdout: "", stderr: "", exited: null };
  proc.exited = new Promise((resolve) => child.on("close", (code, sig) => resolve(code ?? (sig ? 128 : 1))));
  child.stderr.on("data", (d) => (proc.stderr += d));
  const matched = new Promise((resolve, reject) => {
    let buf = "";
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`server not ready after ${timeoutMs} ms: ${proc.cmd}\n${proc.stdout}${proc.stderr}`));
    }, timeoutMs);
    child.stdout.on("data", (d) => {
      proc.stdout += d;
      buf += d;
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, i);
        buf = buf.slice(i + 1);
        const m = ready.exec(line);
        if (m) {
          clearTimeout(timer);
          resolve(m);
        }
      }
    });
    proc.exited.then((code) => {
      clearTimeout(timer);
      reject(new Error(`server exited (${code}) before it was ready: ${proc.cmd}\n${proc.stdout}${proc.stderr}`));
    });
  });
  return { proc, ready: matched };
}

/** Runs a command to completion; resolves { code, stdout, stderr, cmd }. */
export function run(argv, { netns = null, timeoutMs = 300_000, env = process.env } = {}) {
  const full = netns ? ["ip", "netns", "exec", netns, ...argv] : argv;
  return new Promise((resolve) => {
    const child = spawn(full[0], full.slice(1), { stdio: ["ignore", "pipe", "pipe"], env });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (d) => (stdout += d));
    child.stderr.on("data", (d) => (stderr += d));
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.on("close", (code, sig) => {
      clearTimeout(timer);
      resolve({ code: code ?? (sig ? 128 : 1), stdout, stderr, cmd: shellQuote(full) });
    });
  });
}

/** Server + client pair: the client starts when the server's ready line appears. */
export async function pair(serverArgv, clientArgvOf, { ready, serverNetns = null, clientNetns = null, timeoutMs = 300_000, env = process.env } = {}) {
  const s = startServer(serverArgv, { ready, netns: serverNetns, env });
  let m;
  try {
    m = await s.ready;
  } catch (e) {
    s.proc.child.kill("SIGKILL");
    throw e;
  }
  const clientArgv = clientArgvOf(m);
  const c = await run(clientArgv, { netns: clientNetns, timeoutMs, env });
  const killer = setTimeout(() => s.proc.child.kill("SIGKILL"), 15_000);
  const scode = await s.proc.exited;
  clearTimeout(killer);
  return { client: c, server: { code: scode, stdout: s.proc.stdout, stderr: s.proc.stderr, cmd: s.proc.cmd } };
}

export function median(xs) {
  const v = xs.filter((x) => Number.isFinite(x)).sort((a, b) => a - b);
  if (v.length === 0) return NaN;
  const k = v.length >> 1;
  return v.length % 2 ? v[k] : (v[k - 1] + v[k]) / 2;
}

export function fmt(x, digits = 2) {
  if (!Number.isFinite(x)) return "n/a";
  if (Math.abs(x) >= 1000) return x.toFixed(0);
  if (Math.abs(x) >= 100) return x.toFixed(1);
  return x.toFixed(digits);
}

export function sizeLabel(n) {
  if (n >= 1 << 20) return `${n / (1 << 20)} MiB`;
  if (n >= 1024) return `${n / 1024} KiB`;
  return `${n} B`;
}

/** A Markdown table (also readable as plain text). */
export function table(header, rows) {
  const w = header.map((h, i) => Math.max(String(h).length, ...rows.map((r) => String(r[i]).length)));
  const line = (r) => "| " + r.map((c, i) => String(c).padEnd(w[i])).join(" | ") + " |";
  return [line(header), "|" + w.map((n) => "-".repeat(n + 2)).join("|") + "|", ...rows.map(line)].join("\n");
}

/** Parses JSON-lines output, returning the objects with the given type. */
export function jsonLines(text, type) {
  const out = [];
  for (const l of text.split("\n")) {
    if (!l.startsWith("{")) continue;
    try {
      const o = JSON.parse(l);
      if (type === undefined || o.type === type) out.push(o);
    } catch {
      /* not JSON */
    }
  }
  return out;
}

export function machine() {
  const cpus = os.cpus();
  return `${os.cpus().length} × ${cpus[0]?.model ?? "cpu"}, ${Math.round(os.totalmem() / 2 ** 30)} GiB, Linux ${os.release()}, node ${process.version}`;
}

export function loadavg() {
  return os.loadavg().map((x) => x.toFixed(2)).join(" ");
}

/** Simple flag parsing: --name value / --flag. */
export function flags(argv, spec) {
  const o = { ...spec };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (!a.startsWith("--")) throw new Error(`unexpected argument ${a}`);
    const k = a.slice(2);
    if (!(k in spec)) throw new Error(`unknown option ${a} (known: ${Object.keys(spec).map((x) => "--" + x).join(" ")})`);
    if (typeof spec[k] === "boolean") o[k] = true;
    else {
      const v = argv[++i];
      if (v === undefined) throw new Error(`${a} needs a value`);
      o[k] = typeof spec[k] === "number" ? Number(v) : v;
    }
  }
  return o;
}

export function usageExit(msg, usage) {
  console.error(`${msg}\n${usage}`);
  process.exit(2);
}

// ------------------------------------------------------- network namespaces

/** Creates two namespaces joined by veth (bench/netns.sh up); returns their names and addresses. */
export function netnsUp() {
  const r = spawnSync("sh", [join(ROOT, "bench", "netns.sh"), "up"], { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`bench/netns.sh up failed (${r.status}): ${r.stdout}${r.stderr}`);
  const env = Object.fromEntries(r.stdout.trim().split("\n").map((l) => l.split("=")));
  if (!env.NS_S || !env.NS_C || !env.IP_S || !env.IP_C) throw new Error(`bench/netns.sh up printed: ${r.stdout}`);
  let gone = false;
  const down = () => {
    if (gone) return;
    gone = true;
    spawnSync("sh", [join(ROOT, "bench", "netns.sh"), "down", env.NS_S, env.NS_C], { stdio: "inherit" });
  };
  process.on("exit", down);
  for (const s of ["SIGINT", "SIGTERM"]) process.on(s, () => process.exit(130));
  return { ...env, down };
}
