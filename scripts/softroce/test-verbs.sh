#!/bin/sh
# npm run test:verbs — the whole conformance, API, lifetime/memory and fuzz suite on the verbs provider,
# on real libibverbs against Soft-RoCE inside the QEMU guest:
#   1. layout "single": one rxe device, both ends on it;
#   2. layout "veth":   rxe0 and rxe1 joined by a veth wire (two "hosts").
# In each layout's one guest boot: the suite with the TCP side channel, then
# the API suite again with RDMA CM establishing the connections
# (ASYNC_RDMA_CM=rdmacm: servers bind and clients dial the rxe IP).
# The same test files as on tcp (ASYNC_RDMA_PROVIDER=verbs selects the provider);
# a missing device or addon makes the tests FAIL, never skip.
# Usage: scripts/softroce/test-verbs.sh [layouts...] [-- test filters...]
#   TEST_VERBS_CM="filters" (default: the API files that establish connections,
#   plus rdmacm.test; lab and README examples use the side channel either way);
#   TEST_VERBS_CM=none skips the RDMA CM run.
set -u
HERE=$(cd "$(dirname "$0")" && pwd -P)
ROOT=$(cd "$HERE/../.." && pwd -P)
cd "$ROOT"
LAYOUTS=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do LAYOUTS="$LAYOUTS $1"; shift; done
[ "${1:-}" = "--" ] && shift
# Default filters per layout: cp's suites (the slowest under emulation, ~13 minutes) run in the
# veth layout only, where client and server are on two devices as on two hosts; every other file
# runs in both. Filters given after -- apply to every layout.
FILTERS=${*:-}
DEFAULT_FILTERS="conformance api verbs/ fuzz/ rpc/ net/ agent/reuse"
LAYOUTS=${LAYOUTS:-"single veth"}
CM_FILTERS=${TEST_VERBS_CM:-"api/connection api/data api/peer-death api/rdmacm api/auth api/send-copy api/staging rpc/ net/"}
if ! ls build/Release/*.node >/dev/null 2>&1; then
  echo "test-verbs: the native addon is not built (build/Release/*.node missing): run 'npm run build:native' (needs libibverbs-dev, librdmacm-dev)" >&2
  exit 1
fi
rc=0
for layout in $LAYOUTS; do
  echo "=== verbs suite, layout $layout ==="
  start=$(date +%s)
  # Timeouts in the tests scale up 5x in the guest (TCG emulation is 4-7x slower for JIT code).
  # One boot per layout runs both: exit bit 1 = side-channel run failed, bit 2 = RDMA CM run failed.
  f=$FILTERS
  if [ -z "$f" ]; then
    f=$DEFAULT_FILTERS
    [ "$layout" = veth ] && f="$f cli/cp"
  fi
  cmd="r=0; ASYNC_RDMA_PROVIDER=verbs TEST_CONCURRENCY=1 node scripts/run-tests.mjs $f || r=1"
  if [ "$CM_FILTERS" != none ]; then
    cmd="$cmd; echo '=== layout $layout: API suite over RDMA CM (ASYNC_RDMA_CM=rdmacm) ==='; ASYNC_RDMA_PROVIDER=verbs ASYNC_RDMA_CM=rdmacm TEST_CONCURRENCY=1 node scripts/run-tests.mjs $CM_FILTERS || r=\$((r | 2))"
  fi
  # 3000 s: a layout took 22 minutes on a quiet host and 45 on a busy one (the guest is emulated).
  "$HERE/run.sh" -l "$layout" -m 3G -t 3000 "$cmd; exit \$r"
  r=$?
  echo "=== layout $layout: exit $r after $(( $(date +%s) - start )) s ==="
  [ $r = 0 ] || rc=1
done
exit $rc
