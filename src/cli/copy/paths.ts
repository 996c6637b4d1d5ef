/**
 * Path confinement for `async-rdma serve` (and for the names a server sends
 * to `cp`): every path a peer names is relative, has no `..`, and resolves
 * (through any symlink of its parent directories) inside the root. The last
 * component is never followed: files are opened with O_NOFOLLOW and a
 * symlink is copied as a link.
 */
import { realpath } from "node:fs/promises";
import { realpathSync } from "node:fs";
import { basename, dirname, join, posix } from "node:path";

/** An error with a stable code (Node's fs codes, or ESCAPE, CHECKSUM, SOURCE_CHANGED, EROFS, PROTOCOL). */
export class CopyError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

/**
 * Checks a peer-supplied relative path; returns it normalised ("" is the
 * root). Absolute paths, `..` components, NUL and backslash-free tricks are
 * refused with ESCAPE.
 */
export function checkRel(p: unknown): string {
  if (typeof p !== "string") throw new CopyError("PROTOCOL", "a path must be a string");
  if (p.includes("\0")) throw new CopyError("ESCAPE", "a path with a NUL byte is refused");
  if (p.startsWith("/")) throw new CopyError("ESCAPE", `${JSON.stringify(p)}: absolute paths are refused (paths are relative to the served directory)`);
  const parts = p.split("/").filter((x) => x !== "" && x !== ".");
  if (parts.includes("..")) throw new CopyError("ESCAPE", `${JSON.stringify(p)}: '..' is refused (nothing outside the served directory is reachable)`);
  return parts.join("/");
}

export function inside(root: string, real: string): boolean {
  return real === root || real.startsWith(root.endsWith("/") ? root : root + "/");
}

/**
 * The absolute path of `rel` under `root` (a realpath), with its parent
 * directory resolved through symlinks and checked to be inside the root.
 * The last component is returned as is (not followed). The root itself is
 * returned for "".
 */
export async function resolveInside(root: string, rel: string): Promise<string> {
  if (rel === "") return root;
  const abs = join(root, rel);
  let parent: string;
  try {
    parent = await realpath(dirname(abs));
  } catch (e) {
    throw withPath(e, rel);
  }
  if (!inside(root, parent)) throw new CopyError("ESCAPE", `${JSON.stringify(rel)} resolves outside the served directory (through a symlink): refused`);
  return join(parent, basename(abs));
}

/** A symlink target that, placed at `rel`, stays inside the root (relative, no climb above it). */
export function checkLinkTarget(rel: string, target: string): void {
  if (target.startsWith("/")) throw new CopyError("ESCAPE", `symlink ${JSON.stringify(rel)} -> ${JSON.stringify(target)}: an absolute target is refused (it points outside the served directory)`);
  const n = posix.normalize(posix.join(posix.dirname(rel), target));
  if (n === ".." || n.startsWith("../")) throw new CopyError("ESCAPE", `symlink ${JSON.stringify(rel)} -> ${JSON.stringify(target)} points outside the served directory: refused`);
}

/** Puts the peer's relative path in place of our absolute one in an fs error. */
export function withPath(e: unknown, rel: string): unknown {
  const code = (e as { code?: unknown })?.code;
  if (typeof code !== "string" || e instanceof CopyError) return e;
  const what: Record<string, string> = {
    ENOENT: "no such file or directory",
    EACCES: "permission denied",
    EPERM: "operation not permitted",
    ENOTDIR: "a path component is not a directory",
    EISDIR: "is a directory",
    ENOSPC: "no space left on the device",
    EDQUOT: "disk quota exceeded",
    EEXIST: "already exists",
    ELOOP: "is a symlink (not followed)",
    EROFS: "read-only file system",
    EFBIG: "file too large",
  };
  return new CopyError(code, `${rel === "" ? "." : rel}: ${what[code] ?? (e as Error).message}`);
}

/**
 * resolveInside for many paths at once (a batch of small files): the
 * parent's realpath is looked up once per directory, synchronously.
 */
export function resolveInsideSync(root: string, rel: string, parents: Map<string, string>): string {
  if (rel === "") return root;
  const abs = join(root, rel);
  const dir = dirname(abs);
  let parent = parents.get(dir);
  if (parent === undefined) {
    try {
      parent = realpathSync(dir);
    } catch (e) {
      throw withPath(e, rel);
    }
    parents.set(dir, parent);
  }
  if (!inside(root, parent)) throw new CopyError("ESCAPE", `${JSON.stringify(rel)} resolves outside the served directory (through a symlink): refused`);
  return join(parent, basename(abs));
}
