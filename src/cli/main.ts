#!/usr/bin/env node
/**
 * async-rdma command line: thin, parse → call the library → print.
 *   async-rdma devices [--provider tcp|verbs|auto] [--json]
 *   async-rdma lab [host]          the seed lab, server and client as two processes
 *   async-rdma perf <test> [server] perftest's tests and columns (src/cli/perf.ts)
 *   async-rdma cp / serve          file copy over RDMA (src/cli/cp.ts, src/cli/serve.ts)
 */
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { RdmaError } from "../errors.js";
import { loadProvider, type ProviderChoice } from "../transport/providers.js";

function usage(): never {
  console.error("usage: async-rdma devices [--provider tcp|verbs|auto] [--json]\n       async-rdma lab [host]\n       async-rdma perf <test> [server-address] [options]   (async-rdma perf --help)\n       async-rdma cp [options] src... dest   (async-rdma cp --help)\n       async-rdma serve [dir] [options]      (async-rdma serve --help)");
  process.exit(2);
}

async function devices(args: string[]): Promise<void> {
  let choice: ProviderChoice = "auto";
  let json = false;
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (a === "--provider") choice = (args[++i] ?? "auto") as ProviderChoice;
    else if (a === "--json") json = true;
    else usage();
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

const [cmd, ...rest] = process.argv.slice(2);
try {
  if (cmd === "devices") await devices(rest);
  else if (cmd === "lab") lab(rest);
  else if (cmd === "perf") await (await import("./perf.js")).perf(rest);
  else if (cmd === "cp" || cmd === "serve") process.exitCode = await (await import("./copy/command.js")).run(cmd, rest);
  else usage();
} catch (e) {
  if (e instanceof RdmaError) {
    console.error(`async-rdma: ${e.code}: ${e.message}`);
    process.exit(1);
  }
  throw e;
}
