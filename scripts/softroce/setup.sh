#!/bin/sh
# scripts/softroce/setup.sh — prepare the Soft-RoCE guest (Debian bookworm host).
#
# Idempotent: installs only missing Debian packages, downloads/extracts a kernel
# only when the archive has a newer 6.1 one than the extracted one, rebuilds the
# initramfs only when it is missing or older than its inputs. run.sh calls this
# automatically when the artifacts are missing or stale.
#
# Artifacts go to $SOFTROCE_HOME (default /var/cache/softroce), outside the repo,
# so every clone on the machine shares one kernel (~100 MB extracted).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd -P)
LAB=${SOFTROCE_HOME:-/var/cache/softroce}
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
say() { echo "softroce-setup: $*" >&2; }

if [ ! -d "$LAB" ] || [ ! -w "$LAB" ]; then
  $SUDO mkdir -p "$LAB"; [ -z "$SUDO" ] || $SUDO chown "$(id -u):$(id -g)" "$LAB"
fi
case $LAB in *[!A-Za-z0-9/._-]*) say "SOFTROCE_HOME must be a plain path (it goes on the kernel command line): $LAB"; exit 1;; esac
cd "$LAB"
# one setup at a time (parallel first runs of run.sh would race otherwise)
exec 9>"$LAB/.setup.lock"; flock 9   # flock: util-linux, Essential on Debian

# --- Debian packages -------------------------------------------------------
# qemu-system-x86: the guest runs under QEMU TCG (the host has no RDMA, and its
#   /dev/kvm cannot run a stock kernel).  busybox-static: the initramfs userland.
# kmod: modprobe/depmod against the extracted kernel.  cpio/gzip: initramfs.
# xz-utils: unpack vmlinuz to a plain vmlinux (faster boot under TCG).
# rdma-core & co: the guest runs the host's root, so the verbs userland (rdma
#   tool, rxe provider, perftest, rping/ucmatose, ucx_perftest) must be on the host.
PKGS="qemu-system-x86 busybox-static kmod iproute2 cpio gzip xz-utils util-linux
  rdma-core ibverbs-utils rdmacm-utils perftest ibverbs-providers
  libibverbs-dev librdmacm-dev ucx-utils"
apt_install() { # pkgs...; installs the missing ones, quiet when none are missing
  missing=
  for p in "$@"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q ' installed$' || missing="$missing $p"
  done
  [ -n "$missing" ] || return 0
  say "installing:$missing"; CHANGED=1
  # fresh machines (e.g. docker debian:bookworm) have no package lists at all
  ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1 || $SUDO apt-get update -q
  # shellcheck disable=SC2086
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing ||
    { # stale lists (package versions gone from the mirror): refresh once, retry
      $SUDO apt-get update -q
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing; }
}
# shellcheck disable=SC2086
apt_install $PKGS


# --- kernel ----------------------------------------------------------------
# Debian's 6.1 kernel ships rdma_rxe, ib_uverbs, rdma_ucm, 9p, overlay as modules.
# Take the newest linux-image-6.1.0-N-amd64 the package lists know (N moves with
# every Debian point release); it is extracted, never installed on the host.
newest_kv() {
  apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' 2>/dev/null |
    sed -n 's/^linux-image-\(6\.1\.0-[0-9]*-amd64\) .*/\1/p' | sort -V | tail -n 1
}
KV=${KV:-$(newest_kv)}
if [ -z "$KV" ]; then $SUDO apt-get update -q; KV=$(newest_kv); fi
[ -n "$KV" ] || { say "no linux-image-6.1.0-*-amd64 package in the apt lists"; exit 1; }
if [ "$(cat kver 2>/dev/null)" = "$KV" ] && [ -f vmlinux ] && [ -d "kernel/lib/modules/$KV" ]; then
  : # already extracted
else
  say "fetching kernel $KV"; CHANGED=1
  rm -f linux-image-*.deb
  apt-get download -q "linux-image-$KV" 2>/dev/null ||
    { $SUDO apt-get update -q; apt-get download -q "linux-image-$KV"; }
  rm -rf kernel.new && mkdir kernel.new && dpkg-deb -x linux-image-"${KV}"_*.deb kernel.new
  depmod -b "$LAB/kernel.new" "$KV"
  # Uncompressed ELF vmlinux (QEMU boots it via the PVH entry point): skips the
  # in-guest XZ decompression, which costs seconds under TCG.
  off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "kernel.new/boot/vmlinuz-$KV" | head -n 1 | cut -d: -f1)
  [ -n "$off" ] || { say "no XZ payload in vmlinuz-$KV"; exit 1; }
  tail -c +"$((off + 1))" "kernel.new/boot/vmlinuz-$KV" | xz -dc --single-stream > vmlinux.new
  rm -rf kernel && mv kernel.new kernel && mv vmlinux.new vmlinux
  echo "$KV" > kver
  rm -f linux-image-*.deb   # the extracted tree is all we need
  rm -f initramfs.cpio.gz   # modules changed: force a rebuild below
fi

# --- initramfs -------------------------------------------------------------
if [ ! -f initramfs.cpio.gz ] || [ -n "$(find "$HERE/build-initramfs.sh" "$HERE/initramfs-init" /bin/busybox -newer initramfs.cpio.gz 2>/dev/null)" ]; then
  "$HERE/build-initramfs.sh"; CHANGED=1
fi
# quiet when there was nothing to do (install-deps.sh / CI call this every time)
[ -z "${CHANGED:-}" ] || say "ready: kernel $KV in $LAB"
