/**
 * Entry of `cp` and `serve` from main.ts: usage errors exit 2, everything
 * else 1, each on stderr with its code.
 */
import { CopyError } from "./paths.js";

export async function run(cmd: "cp" | "serve", args: string[]): Promise<number> {
  try {
    if (cmd === "cp") return await (await import("./cp.js")).cp(args);
    await (await import("./serve.js")).serve(args);
    return 0;
  } catch (e) {
    const code = (e as { code?: unknown })?.code;
    console.error(`async-rdma ${cmd}: ${typeof code === "string" && code !== "USAGE" ? `${code}: ` : ""}${e instanceof Error ? e.message : String(e)}`);
    return e instanceof CopyError && e.code === "USAGE" ? 2 : 1;
  }
}
