#!/usr/bin/env node
/**
 * async-rdma command line: thin, parse → call the library → print.
 * Conventions: `--help`/`-h`/`help` print usage on stdout and exit 0;
 * `--version`; a usage error or an unknown command exits 2 with a hint on
 * stderr; a library error exits 1 with its code. Long runs show progress on
 * stderr only when it is a terminal (progress.ts). A command is one entry of
 * COMMANDS: its usage line, a one-line summary and its entry point.
 */
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { RdmaError } from "../errors.js";
import { loadProvider, type ProviderChoice } from "../transport/providers.js";

interface Command {
  /** Arguments after the command's name, as in the usage text. */
  args: string;
  summary: string;
  /** The full usage text (`async-rdma <command> --help`); default: the usage line and the summary. */
  help?(): string | Promise<string>;
  run(args: string[]): void | Promise<void>;
}

const COMMANDS: Record<string, Command> = {
  devices: { args: "[--provider tcp|verbs|auto] [--json]", summary: "RDMA devices, ports, GIDs and limits (as ibv_devinfo)", run: devices },
  lab: { args: "[host]", summary: "the seed lab: server and client as two processes", run: lab },
  perf: {
    args: "<test> [server-address] [options]",
    summary: "perftest's tests and columns (async-rdma perf --help)",
    help: async () => (await import("./perf/options.js")).PERF_USAGE,
    run: async (a) => (await import("./perf/run.js")).perf(a),
  },
  cp: {
    args: "[options] src... dest",
    summary: "copy files and trees to or from an async-rdma serve server (docs/cp.md)",
    help: async () => (await import("./copy/cp.js")).USAGE.trimEnd(),
    run: async (a) => void (process.exitCode = await (await import("./copy/command.js")).run("cp", a)),
  },
  serve: {
    args: "[dir] [options]",
    summary: "serve one directory tree to async-rdma cp",
    help: async () => (await import("./copy/serve.js")).USAGE.trimEnd(),
    run: async (a) => void (process.exitCode = await (await import("./copy/command.js")).run("serve", a)),
  },
};

function usageText(): string {
  const names = Object.keys(COMMANDS);
  const w = Math.max(...names.map((n) => n.length));
  return [
    "usage: async-rdma <command> [arguments]",
    "",
    "commands:",
    ...names.map((n) => `  ${n.padEnd(w)}  ${COMMANDS[n]!.summary}\n  ${" ".repeat(w)}  async-rdma ${n} ${COMMANDS[n]!.args}`),
    "",
    "  async-rdma <command> --help   usage of one command",
    "  async-rdma --version          the package's version",
    "",
    "environment: ASYNC_RDMA_PROVIDER=tcp|verbs overrides the provider of programs that do not choose one",
  ].join("\n");
}

/** A usage error: the message and a hint on stderr, exit status 2. */
function usageError(message: string, cmd?: string): never {
  console.error(`async-rdma: ${message}`);
  console.error(cmd ? `usage: async-rdma ${cmd} ${COMMANDS[cmd]!.args}` : 'Run "async-rdma --help" for the commands.');
  process.exit(2);
}

function version(): string {
  const here = dirname(fileURLToPath(import.meta.url));
  return (JSON.parse(readFileSync(join(here, "..", "..", "..", "package.json"), "utf8")) as { version: string }).version;
}

async function devices(args: string[]): Promise<void> {
  let choice: ProviderChoice = "auto";
  let json = false;
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (a === "--provider") choice = (args[++i] ?? "auto") as ProviderChoice;
    else if (a === "--json") json = true;
    else usageError(`devices: unknown option ${a ?? ""}`, "devices");
  }
  const provider = await loadProvider(choice);
  const out = [];
  for (const info of provider.listDevices()) {
    const dev = await provider.openDevice(info.name);
    try {
      const ports = [];
      for (let p = 1; p <= dev.attr.physPortCnt; p++) ports.push(dev.queryPort(p));
      out.push({ name: dev.name, attr: dev.attr, ports });
    } finally {
      dev.close();
    }
  }
  if (json) {
    console.log(JSON.stringify(out, null, 2));
    return;
  }
  if (out.length === 0) console.error(`no RDMA devices found (provider ${provider.name})`);
  for (const d of out) {
    const a = d.attr;
    console.log(`hca_id: ${d.name}    (provider ${a.provider})`);
    console.log(`    fw_ver: ${a.fwVer}    node_guid: ${a.nodeGuid}`);
    console.log(`    max_mr_size: ${a.maxMrSize}  max_qp: ${a.maxQp}  max_qp_wr: ${a.maxQpWr}  max_sge: ${a.maxSge}  max_cqe: ${a.maxCqe}`);
    console.log(`    max_qp_rd_atom: ${a.maxQpRdAtom}  max_qp_init_rd_atom: ${a.maxQpInitRdAtom}  max_inline: ${a.maxInline}  atomic_cap: ${a.atomicCap}`);
    console.log(`    memory windows: ${a.maxMw ? `types ${a.mwTypes.join(",")}, bounds ${a.mwEnforcesBounds ? "enforced" : "NOT enforced (grants use dedicated MRs)"}` : "none"}`);
    for (const p of d.ports) {
      console.log(`    port ${p.portNum}: state ${p.state}  active_mtu ${p.activeMtu}  max_mtu ${p.maxMtu}  link_layer ${p.linkLayer}  lid ${p.lid}`);
      for (const g of p.gids) console.log(`        GID[${g.index}]: ${g.gid}${g.type ? `  ${g.type}` : ""}`);
    }
  }
}

function lab(args: string[]): void {
  const here = dirname(fileURLToPath(import.meta.url));
  const r = spawnSync(process.execPath, [join(here, "..", "..", "examples", "lab", "run.js"), ...args], { stdio: "inherit" });
  process.exit(r.status ?? 1);
}

const HELP = ["--help", "-h", "help"];
let [cmd, ...rest] = process.argv.slice(2);
if (cmd === "help" && rest.length > 0) [cmd, rest] = [rest[0], ["--help"]]; // help <command> = <command> --help
try {
  if (cmd === undefined) usageError("no command given");
  else if (HELP.includes(cmd) && rest.length === 0) console.log(usageText());
  else if (cmd === "--version" || cmd === "-V") console.log(version());
  else if (!Object.hasOwn(COMMANDS, cmd)) usageError(cmd.startsWith("-") ? `unknown option ${cmd}` : `unknown command "${cmd}"`);
  else if (rest.includes("--help") || rest.includes("-h")) {
    const c = COMMANDS[cmd]!;
    console.log(c.help ? await c.help() : `usage: async-rdma ${cmd} ${c.args}\n  ${c.summary}`);
  } else await COMMANDS[cmd]!.run(rest);
} catch (e) {
  if (e instanceof RdmaError) {
    console.error(`async-rdma: ${e.code}: ${e.message}`);
    process.exit(1);
  }
  throw e;
}
