#!/bin/sh
# async-rdma cp against rsync --whole-file (to an rsync daemon, rsync://, no
# ssh) and a plain Node stream pipe: a 2 GiB file and a tree of 10,000 files
# of 4 KiB, on loopback; A/B alternating, medians of 3; MB/s and CPU seconds
# (user + sys) of both ends. See bench/cp-vs-rsync.mjs for the options.
#
#   sh bench/cp-vs-rsync.sh [--runs 3] [--size 2g] [--files 10000] [--provider tcp] [--dir /var/tmp]
set -eu
cd "$(dirname "$0")/.."
if ! command -v rsync >/dev/null; then
  apt-get update && apt-get install -y rsync
fi
[ -f dist/src/cli/main.js ] || npx tsc -p tsconfig.json
exec node bench/cp-vs-rsync.mjs "$@"
