#!/bin/sh
# scripts/install-deps.sh — install what CI needs on a fresh Debian bookworm
# machine. Idempotent, and silent when everything is already there.
#   - the Soft-RoCE harness (QEMU, rdma-core, perftest, ucx-utils, the 6.1
#     kernel and initramfs): scripts/softroce/setup.sh
#   - iproute2: network namespaces for the TCP-transport tests on the host
#   - libibverbs-dev, librdmacm-dev + a C/C++ toolchain, python3 and pkg-config:
#     the native addon builds on the host too (node-gyp needs python3/make/g++)
# Node.js itself is not installed (bookworm's nodejs is 18; the project needs
# >= 20.19): use the CI's setup-node / nvm; we only warn.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd -P)
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
PKGS="iproute2 libibverbs-dev librdmacm-dev ibverbs-providers build-essential python3 pkg-config"
missing=
for p in $PKGS; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q ' installed$' || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "install-deps: installing:$missing" >&2
  ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1 || $SUDO apt-get update -q
  # shellcheck disable=SC2086
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing ||
    { $SUDO apt-get update -q   # stale lists: refresh once and retry
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing; }
fi
"$HERE/softroce/setup.sh"
if ! command -v node >/dev/null 2>&1; then
  echo "install-deps: warning: node not found (need >= 20.19; install via setup-node/nvm)" >&2
elif [ "$(node -p 'const [a, b] = process.versions.node.split(".").map(Number); a > 20 || (a === 20 && b >= 19) ? 1 : 0')" = 0 ]; then
  echo "install-deps: warning: node $(node -v) is older than 20.19" >&2
fi
