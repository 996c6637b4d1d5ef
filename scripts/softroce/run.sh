#!/bin/sh
# scripts/softroce/run.sh — run a shell command on Soft-RoCE (rxe) devices.
# usage: run.sh [-l single|veth|none] [-m MEM] [-t TIMEOUT_S] [-k] '<shell command>'
#
# The host kernel has no RDMA, so this boots Debian's 6.1 kernel in QEMU (TCG;
# this host's /dev/kvm cannot run a stock kernel) with the host root shared
# read-only (tmpfs overlay on top) and the current directory shared read-write at
# the same path, creates the rxe devices, runs the command as root in the current
# directory with the caller's environment, powers off and exits with the
# command's exit status (124: timeout, 125: no status from the guest).
# The command's stdout/stderr are this script's stdout/stderr.
#   -l layout   single (default): rxe0 10.77.0.1 | veth: rxe0 10.77.0.1 + rxe1 10.77.0.2 | none
#   -m MEM      guest memory (default 2G)    -t SECONDS  timeout (default 600)
#   -k          keep the job dir (console.log, init.log, dmesg.log)
# Env: SOFTROCE_HOME (artifacts, default /var/cache/softroce), SOFTROCE_SMP (2),
#   SOFTROCE_ACCEL, SOFTROCE_MACHINE (pc|microvm), SOFTROCE_APPEND, SOFTROCE_KERNEL.
set -u
HERE=$(cd "$(dirname "$0")" && pwd -P)
LAB=${SOFTROCE_HOME:-/var/cache/softroce}
LAYOUT=single MEM=2G KEEP=0 TMO=600
usage() { echo "usage: $0 [-l single|veth|none] [-m MEM] [-t TIMEOUT_S] [-k] '<shell command>'" >&2; exit 2; }
while getopts l:m:t:k o; do case $o in
  l) LAYOUT=$OPTARG;; m) MEM=$OPTARG;; t) TMO=$OPTARG;; k) KEEP=1;; *) usage;;
esac; done
shift $((OPTIND - 1))
[ $# -ge 1 ] || usage
case $LAYOUT in single|veth|none) ;;
  netns) echo "run.sh: no netns layout: rxe in 6.1 only carries traffic in the initial netns; use -l veth" >&2; exit 2;;
  *) usage;; esac

# (Re)build the guest artifacts when missing or older than the scripts that make them.
if [ ! -f "$LAB/vmlinux" ] || [ ! -f "$LAB/initramfs.cpio.gz" ] ||
   [ -n "$(find "$HERE/initramfs-init" "$HERE/build-initramfs.sh" -newer "$LAB/initramfs.cpio.gz" 2>/dev/null)" ]; then
  "$HERE/setup.sh" >&2 || { echo "run.sh: setup failed" >&2; exit 125; }
fi

CWD=$(pwd -P)
# job paths go on the kernel command line (space separated, no quoting)
case $LAB in *[!A-Za-z0-9/._-]*) echo "run.sh: SOFTROCE_HOME must be a plain path: $LAB" >&2; exit 2;; esac
mkdir -p "$LAB/jobs"
JOB=$(mktemp -d "$LAB/jobs/job.XXXXXX") || exit 125
FIFO=$JOB/fifo
cleanup() { rm -rf "$FIFO"; if [ "$KEEP" = 1 ]; then echo "run.sh: job dir kept: $JOB" >&2; else rm -rf "$JOB"; fi; }
printf '%s\n' "$*" > "$JOB/cmd"
printf '%s\n' "$CWD" > "$JOB/cwd"
printf '%s\n' "$LAYOUT" > "$JOB/layout"
cp "$HERE/guest-init.sh" "$JOB/guest-init.sh"   # snapshot: edits during a run don't matter
# The caller's exported environment, minus what is per-host/per-session or set
# by the guest. Same /bin/sh reads it back in the guest. Private (umask 077);
# the guest deletes it after reading.
( unset PWD OLDPWD SHLVL _ HOSTNAME DISPLAY WAYLAND_DISPLAY XDG_RUNTIME_DIR XDG_SESSION_ID \
    DBUS_SESSION_BUS_ADDRESS SSH_AUTH_SOCK SSH_AGENT_PID SSH_CONNECTION SSH_CLIENT SSH_TTY TMUX TMUX_PANE \
    SOFTROCE_LAYOUT RXE_DEVS RXE_IPS RXE_GID_INDEX 2>/dev/null
  umask 077; export -p > "$JOB/env" )

# Guest stdout/stderr: virtio-serial ports -> host FIFOs -> cat, writing to our
# own fd 1/2 (so a caller's `>>` or `> file` keeps the right file offset).
mkdir "$FIFO" && mkfifo "$FIFO/so.in" "$FIFO/so.out" "$FIFO/se.in" "$FIFO/se.out" || { cleanup; exit 125; }
cat "$FIFO/so.out" & CAT1=$!
cat "$FIFO/se.out" >&2 & CAT2=$!
ACCEL=${SOFTROCE_ACCEL:--accel tcg,thread=multi,tb-size=512 -cpu max}
KERNEL=${SOFTROCE_KERNEL:-$LAB/vmlinux}
case ${SOFTROCE_MACHINE:-pc} in   # microvm: virtio-mmio, no PCI
  microvm) MACH="-M microvm,rtc=on" BUS=device APPEND_M="pci=off";;
  *)       MACH="-M pc" BUS=pci APPEND_M="pci=noacpi";;
esac
qpath() { printf '%s' "$1" | sed 's/,/,,/g'; }   # QEMU option values: ',' doubled
# shellcheck disable=SC2086
timeout "$TMO" qemu-system-x86_64 $MACH $ACCEL -smp "${SOFTROCE_SMP:-2}" -m "$MEM" \
  -nodefaults -no-user-config -display none -no-reboot \
  -serial "file:$(qpath "$JOB")/console.log" \
  -kernel "$KERNEL" -initrd "$LAB/initramfs.cpio.gz" \
  -append "console=ttyS0 loglevel=4 panic=-1 mitigations=off cryptomgr.notests $APPEND_M ${SOFTROCE_APPEND:-} sr_init=$JOB/guest-init.sh sr_home=$LAB sr_job=$JOB" \
  -fsdev "local,id=hr,path=/,security_model=none,readonly=on,multidevs=remap" -device "virtio-9p-$BUS,fsdev=hr,mount_tag=hostroot" \
  -fsdev "local,id=jb,path=$(qpath "$JOB"),security_model=none" -device "virtio-9p-$BUS,fsdev=jb,mount_tag=job" \
  -fsdev "local,id=wk,path=$(qpath "$CWD"),security_model=none,multidevs=remap" -device "virtio-9p-$BUS,fsdev=wk,mount_tag=work" \
  -device "virtio-serial-$BUS" \
  -chardev "pipe,id=so,path=$(qpath "$FIFO")/so" -device virtserialport,chardev=so,name=stdout \
  -chardev "pipe,id=se,path=$(qpath "$FIFO")/se" -device virtserialport,chardev=se,name=stderr \
  < /dev/null &
QPID=$!
# Ctrl-C / kill: background jobs of a non-interactive sh ignore SIGINT, so stop
# QEMU explicitly (timeout forwards TERM to it), then clean up.
stop() { kill "$QPID" 2>/dev/null; wait "$QPID"; wait "$CAT1" "$CAT2"; cleanup; exit "$1"; }
trap 'stop 130' INT; trap 'stop 143' TERM; trap 'stop 129' HUP
wait "$QPID"; qrc=$?
trap - INT TERM HUP
wait "$CAT1" "$CAT2"
if [ "$qrc" = 124 ]; then echo "run.sh: timed out after ${TMO}s" >&2; rc=124; KEEP=1
elif [ -f "$JOB/rc" ]; then rc=$(cat "$JOB/rc")
else
  echo "run.sh: no exit status from the guest (qemu rc=$qrc); console log:" >&2
  tail -n 30 "$JOB/console.log" >&2; rc=125; KEEP=1
fi
cleanup
exit "$rc"
