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
  /** The library's copy(): every file that failed, when the copy failed (the first one's code is `code`). */
  errors?: readonly { path: string; code: string; message: string }[];

  /** An error of `code` (see the class) with its message. */
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

/**
 * A symlink target that, placed at `rel`, stays inside the root. The kernel
 * resolves a target from the link's physical directory, component by
 * component, following links: `up/../victim` with `up -> .` leaves the tree
 * although it reads as inside. So a target is judged where the kernel will
 * resolve it: from `parent`, the realpath of the link's directory (as
 * resolveInside returns it), `..` only at its start (climbing real
 * directories, never a link), and never above the root. `parent` defaults
 * to the lexical directory of `rel` under a stand-in root (for checks
 * without a file system).
 */
export function checkLinkTarget(rel: string, target: string, root = "/tree", parent = posix.join(root, posix.dirname(rel))): void {
  const say = (why: string): CopyError => new CopyError("ESCAPE", `symlink ${JSON.stringify(rel)} -> ${JSON.stringify(target)}: ${why}: refused`);
  if (target.includes("\0")) throw say("a target with a NUL byte");
  if (target.startsWith("/")) throw say("an absolute target points outside the served directory");
  const parts = target.split("/").filter((x) => x !== "" && x !== ".");
  const climb = parts.findIndex((x) => x !== "..");
  if (climb >= 0 && parts.slice(climb).includes("..")) throw say("'..' after a name (it would climb from wherever that name leads)");
  const n = posix.normalize(posix.join(parent, target));
  if (!inside(root, n)) throw say("it points outside the served directory");
}

/** Messages for the fs codes a peer may see; any other code is named by itself. */
const FS_MESSAGES: Record<string, string> = {
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
  ENAMETOOLONG: "name too long",
  ENOTEMPTY: "directory not empty",
  EMLINK: "too many links",
  EBUSY: "device or resource busy",
  ETXTBSY: "text file busy",
  EIO: "input/output error",
  EINVAL: "invalid argument",
  ENXIO: "no such device or address",
  EMFILE: "too many open files",
  ENFILE: "too many open files in the system",
  EXDEV: "cross-device link",
  EAGAIN: "resource temporarily unavailable",
  EOVERFLOW: "value too large",
};

/**
 * Puts the peer's relative path in place of our absolute one in an fs
 * error. Node's own message names the absolute path, so it is never used:
 * a code without a message of ours is named by itself.
 */
export function withPath(e: unknown, rel: string): unknown {
  const code = (e as { code?: unknown })?.code;
  if (typeof code !== "string" || e instanceof CopyError) return e;
  return new CopyError(code, `${rel === "" ? "." : rel}: ${FS_MESSAGES[code] ?? code.toLowerCase()}`);
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
