/**
 * `async-rdma cp` that stops itself (SIGSTOP) once `bytes` are copied, after saying so on
 * stdout ({"type":"stopped"}), so a test can kill a peer mid-copy at a known point instead of
 * racing the copy. Run as `node cp-stop.js <bytes> <cp arguments...>`. It hears the copy's
 * progress through the listener the library's copy() uses: the product has no test switch.
 */
import { cp } from "../../src/cli/copy/cp.js";
import { CopyError } from "../../src/cli/copy/paths.js";

const bytes = Number(process.argv[2]);
let stopped = false;
try {
  process.exitCode = await cp(process.argv.slice(3), {
    progress: (p) => {
      if (stopped || p.bytes < bytes) return;
      stopped = true;
      process.stdout.write(JSON.stringify({ type: "stopped", bytes: p.bytes }) + "\n");
      process.kill(process.pid, "SIGSTOP");
    },
    error: () => {},
  });
} catch (e) {
  console.error(`cp-stop: ${e instanceof Error ? e.message : String(e)}`);
  process.exitCode = e instanceof CopyError && e.code === "USAGE" ? 2 : 1;
}
