#!/bin/sh
# Our tcp provider against UCX over TCP: ucx_perftest with UCX_TLS=tcp
# (ucp_put_bw at 64 B, 4 KiB, 64 KiB, 1 MiB; ucp_put_lat and tag_lat at 8 B)
# against `async-rdma perf write_bw / write_lat / send_lat --provider tcp`,
# both sides of each comparison in one go, medians over --runs runs, and a
# ratio table (ours / ucx). The work is in bench/lib/tcp-vs-ucx.mjs.
#
#   sh bench/tcp-vs-ucx.sh [--runs 3] [--netns] [--json] [--sizes 64,4096,65536,1048576]
#
# --netns: servers in one network namespace, clients in another, over veth
# (bench/netns.sh; root). Needs `npm run build` first. Installs Debian's
# ucx-utils when ucx_perftest is missing (apt-get, root).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v ucx_perftest >/dev/null 2>&1; then
  echo "tcp-vs-ucx: ucx_perftest not found; installing ucx-utils" >&2
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y ucx-utils >&2 || { apt-get update >&2 && apt-get install -y ucx-utils >&2; }
  else
    echo "tcp-vs-ucx: cannot install (needs root and apt-get): apt-get install -y ucx-utils" >&2
    exit 1
  fi
fi
command -v stdbuf >/dev/null 2>&1 || { echo "tcp-vs-ucx: stdbuf (coreutils) is needed to see ucx_perftest's ready line" >&2; exit 1; }
exec node "$ROOT/bench/lib/tcp-vs-ucx.mjs" "$@"
