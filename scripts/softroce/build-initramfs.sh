#!/bin/sh
# scripts/softroce/build-initramfs.sh — build $SOFTROCE_HOME/initramfs.cpio.gz:
# static busybox + the modules needed before the host root can be mounted
# (virtio, 9p, overlay) plus the RDMA stack (loading them here, in dependency
# order with plain insmod, is faster than modprobe over 9p later).
# Called by setup.sh after the kernel is extracted.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd -P)
LAB=${SOFTROCE_HOME:-/var/cache/softroce}
KV=$(cat "$LAB/kver")
OUT=$LAB/initramfs.cpio.gz
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/bin" "$T/proc" "$T/sys" "$T/dev" "$T/lower" "$T/rw" "$T/newroot" "$T/mods"
cp /bin/busybox "$T/bin/busybox"   # from busybox-static: must not need a libc
# virtio_console: stdout/stderr ports; rdma_rxe/ib_uverbs/rdma_ucm: verbs + RDMA CM;
# crc32_generic: rxe's ICRC; dummy/veth: the netdevs of the layouts.
MODS="virtio_pci virtio_mmio 9pnet_virtio 9p overlay ${EXTRA_MODS:-virtio_console rdma_rxe ib_uverbs rdma_ucm crc32_generic dummy veth}"
: > "$T/mods/order"
for m in $MODS; do
  modprobe -d "$LAB/kernel" -S "$KV" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
  b=$(basename "$ko"); cp "$ko" "$T/mods/$b"; echo "$b" >> "$T/mods/order"
done
cp "$HERE/initramfs-init" "$T/init"; chmod +x "$T/init"
# write then rename: a concurrently booting run.sh never sees a partial file
(cd "$T" && find . | cpio -o -H newc --quiet | gzip -1 > "$OUT.tmp.$$") && mv "$OUT.tmp.$$" "$OUT"
echo "softroce: initramfs $(wc -c < "$OUT") bytes, modules: $(tr '\n' ' ' < "$T/mods/order")" >&2
