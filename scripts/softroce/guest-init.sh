#!/bin/sh
# scripts/softroce/guest-init.sh — PID 1 inside the Soft-RoCE guest.
# run.sh copies this file into the job dir and names it on the kernel command
# line; it runs from the host root (virtio-9p, read-only, under a tmpfs overlay).
# Kernel command line: sr_home=<$SOFTROCE_HOME>  sr_job=<job dir>
# Job dir (host dir, shared read-write as 9p tag "job"):
#   cmd     the shell command        cwd     host dir to run it in (9p tag "work")
#   layout  single|veth|none         env     the caller's exported environment
#   -> rc (exit status), init.log, dmesg.log
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
for a in $(cat /proc/cmdline); do case $a in
  sr_home=*) LAB=${a#sr_home=};; sr_job=*) JOB=${a#sr_job=};;
esac; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none job "$JOB"
t() { echo "[init $(cut -d' ' -f1 /proc/uptime)] $*" >> "$JOB/init.log"; }
CWD=$(cat "$JOB/cwd"); LAYOUT=$(cat "$JOB/layout")
t "start layout=$LAYOUT cwd=$CWD"

# Fresh writable tmpfs for /tmp and /run (the overlay would otherwise show the
# host's /tmp and its stale sockets/pid files). Mounted before the work dir so a
# work dir under /tmp is mounted on top, not hidden.
mount -t tmpfs -o mode=1777 tmp /tmp
mount -t tmpfs -o mode=755 run /run
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
# The caller's cwd, read-write at the same path, so relative paths, build
# outputs and node_modules work unchanged. cache=mmap: coherent with the host
# and still mmap()able (node / dlopen of .node addons need that).
if [ -n "$CWD" ] && [ "$CWD" != / ]; then
  mkdir -p "$CWD" && mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=mmap work "$CWD" || t "mount work FAILED"
fi
# modprobe looks in /lib/modules/<kver>: point it at the extracted Debian kernel
KV=$(uname -r)
mkdir -p /usr/lib/modules && ln -sfn "$LAB/kernel/lib/modules/$KV" "/usr/lib/modules/$KV"
hostname softroce
ip link set lo up
# normally insmod'ed by the initramfs already; a no-op then
[ -d /sys/module/rdma_rxe ] && [ -d /sys/module/rdma_ucm ] && [ -d /sys/module/virtio_console ] ||
  modprobe -a virtio_console rdma_rxe ib_uverbs rdma_ucm crc32_generic dummy veth || t "modprobe FAILED"
t "modules loaded"

# Layouts. There is deliberately no "two network namespaces" layout: rxe in 6.1
# only serves the initial namespace (devices get created in another netns, but
# every work request completes with status 2, LOC_QP_OP_ERR). Use veth instead.
# RDMA CM on rxe over lo fails (rdma_resolve_route: No such device), hence the
# dummy/veth netdevs with their own addresses.
case $LAYOUT in
single)
  # one rxe device on a dummy netdev; traffic to its own address loops inside rxe.
  # MTU 4500 so the RoCE active MTU is 4096.
  ip link add eth_rxe type dummy
  ip link set eth_rxe mtu 4500 up 2>/dev/null || ip link set eth_rxe up
  ip addr add 10.77.0.1/24 dev eth_rxe
  rdma link add rxe0 type rxe netdev eth_rxe || t "rdma link add rxe0 FAILED"
  SOFTROCE_LAYOUT=single RXE_DEVS="rxe0" RXE_IPS="10.77.0.1"
  ;;
veth)
  # two rxe devices on the ends of a veth pair, both in the initial netns.
  # Both addresses are local, so by default the kernel would route between them
  # over lo; policy routing (local table moved after our rules, accept_local,
  # no rp_filter) forces the packets over the veth wire instead.
  ip link add veth_a type veth peer name veth_b
  for d in all default veth_a veth_b; do
    echo 1 > /proc/sys/net/ipv4/conf/$d/accept_local 2>/dev/null
    echo 0 > /proc/sys/net/ipv4/conf/$d/rp_filter 2>/dev/null
  done
  ip link set veth_a mtu 4500 up; ip link set veth_b mtu 4500 up
  ip addr add 10.77.0.1/24 dev veth_a; ip addr add 10.77.0.2/24 dev veth_b
  ip rule add pref 100 lookup local && ip rule del pref 0 lookup local
  ip route add 10.77.0.2/32 dev veth_a src 10.77.0.1 table 100
  ip route add 10.77.0.1/32 dev veth_b src 10.77.0.2 table 101
  ip rule add pref 10 iif lo to 10.77.0.2 lookup 100
  ip rule add pref 11 iif lo to 10.77.0.1 lookup 101
  rdma link add rxe0 type rxe netdev veth_a || t "rdma link add rxe0 FAILED"
  rdma link add rxe1 type rxe netdev veth_b || t "rdma link add rxe1 FAILED"
  SOFTROCE_LAYOUT=veth RXE_DEVS="rxe0 rxe1" RXE_IPS="10.77.0.1 10.77.0.2"
  ;;
*) SOFTROCE_LAYOUT=none RXE_DEVS= RXE_IPS= ;;
esac
t "rxe ready"

# The command's environment: the caller's exported variables (run.sh wrote them
# with `export -p`, same /bin/sh), so PATH (nvm/volta node), NODE_OPTIONS, CI,
# DEBUG etc. carry over. The file is deleted once read (it may hold secrets).
if [ -f "$JOB/env" ]; then . "$JOB/env"; rm -f "$JOB/env"; fi
# rdma/ip live in sbin, which a non-root caller's PATH may lack
PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin
# a TMPDIR under the host's /tmp does not exist in the fresh guest /tmp
[ -z "${TMPDIR:-}" ] || mkdir -p "$TMPDIR" 2>/dev/null
export SOFTROCE_LAYOUT RXE_DEVS RXE_IPS
export RXE_GID_INDEX=1   # GID 1 = ::ffff:<IPv4>, the RoCE v2 GID
ulimit -l unlimited      # verbs pin memory
ulimit -n 65536
# virtio-serial ports named stdout / stderr are the host's stdout / stderr
OUT=/dev/console ERR=/dev/console
for p in /sys/class/virtio-ports/vport*; do
  [ -e "$p/name" ] || continue
  case $(cat "$p/name") in stdout) OUT=/dev/${p##*/};; stderr) ERR=/dev/${p##*/};; esac
done
cd "${CWD:-/}" || t "cd $CWD FAILED"
sh -c "$(cat "$JOB/cmd")" > "$OUT" 2> "$ERR" < /dev/null
rc=$?
t "command exited rc=$rc"
dmesg > "$JOB/dmesg.log" 2>&1
echo $rc > "$JOB/rc"
sync
umount "$JOB" 2>/dev/null
/bin/busybox poweroff -f 2>/dev/null || echo o > /proc/sysrq-trigger
