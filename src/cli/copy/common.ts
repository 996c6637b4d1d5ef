/**
 * What cp and serve share on the command line: the default port, the
 * builder from --provider and --auth-key-file, and size parsing.
 */
import { closeSync, fstatSync, openSync, readFileSync } from "node:fs";
import { RdmaBuilder, type ProviderChoice } from "../../index.js";
import { CopyError } from "./paths.js";

export const DEFAULT_PORT = 7471;

/**
 * serve listens on this machine only unless --bind says otherwise: a tree
 * is not handed to a network by accident (and its write access only with
 * --writable).
 */
export const DEFAULT_BIND = "127.0.0.1";

export function builderFor(provider: string | undefined, keyFile: string | undefined): RdmaBuilder {
  const b = new RdmaBuilder();
  if (provider !== undefined) {
    if (provider !== "tcp" && provider !== "verbs" && provider !== "auto") throw new CopyError("USAGE", `--provider must be tcp, verbs or auto, got ${JSON.stringify(provider)}`);
    b.setProvider(provider as ProviderChoice);
  }
  if (keyFile !== undefined) {
    let key: Buffer;
    let fd = -1;
    try {
      fd = openSync(keyFile, "r");
      // as ssh does with its private keys: a key others can read (or write) is no secret
      const mode = fstatSync(fd).mode;
      if ((mode & 0o077) !== 0) throw new CopyError("USAGE", `--auth-key-file ${keyFile}: the key file is accessible by others (mode ${(mode & 0o777).toString(8).padStart(4, "0")}); make it private with chmod 600 ${keyFile}`);
      key = readFileSync(fd);
    } catch (e) {
      throw e instanceof CopyError ? e : new CopyError("USAGE", `--auth-key-file ${keyFile}: ${(e as Error).message}`);
    } finally {
      if (fd >= 0) closeSync(fd);
    }
    // a key file written by `echo` ends with a newline that is not part of the key
    let end = key.length;
    while (end > 0 && (key[end - 1] === 0x0a || key[end - 1] === 0x0d)) end--;
    if (end < 16) throw new CopyError("USAGE", `--auth-key-file ${keyFile}: the key must be at least 16 bytes (e.g. (umask 077; head -c 32 /dev/urandom | base64 > ${keyFile}))`);
    b.setAuth({ key: key.subarray(0, end) });
  }
  return b;
}

/** "1m", "256k", "4194304" → bytes. */
export function parseSize(s: string | undefined, what: string): number {
  const m = /^(\d+)([kKmMgG]?)(i?[bB])?$/.exec(s ?? "");
  if (!m) throw new CopyError("USAGE", `${what}: expected a size such as 1m, 256k or 65536, got ${JSON.stringify(s)}`);
  const mult = { "": 1, k: 1024, m: 1024 ** 2, g: 1024 ** 3 }[m[2]!.toLowerCase() as "" | "k" | "m" | "g"];
  return Number(m[1]) * mult;
}

export function parseIntArg(s: string | undefined, what: string, min: number, max: number): number {
  const n = Number(s);
  if (s === undefined || !/^\d+$/.test(s) || n < min || n > max) throw new CopyError("USAGE", `${what}: expected an integer in [${min}, ${max}], got ${JSON.stringify(s)}`);
  return n;
}
