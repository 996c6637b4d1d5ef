#!/bin/sh
# Memory-safety run of the native addons: builds them with AddressSanitizer
# (and UBSan) in a separate directory (build-asan/, the normal build in build/
# is untouched and stays the default), then runs tests on the verbs provider
# inside the Soft-RoCE guest with libasan preloaded into every node process.
# Any ASan/UBSan report aborts that process and fails the run.
#
# Usage: scripts/softroce/memcheck.sh [single|veth ...] [-- test filters...]
#   default: layout single, filters "conformance verbs/" (test/verbs/ holds the
#   lifetime cases: native-lifetime.test.js runs each of its scenarios in a
#   child process and worker threads, which inherit LD_PRELOAD and the
#   instrumented addons through the environment, so their reports fail the run)
# Env: MEMCHECK_KEEP_BUILD=1 keeps build-asan/ afterwards (default: removed).
#
# Why ASan and not valgrind: under TCG emulation node alone is 4-7x slower;
# valgrind would add another 20-50x. ASan costs about 2x.
# V8/node are not instrumented: only allocations and accesses of the addons
# are checked (malloc/free everywhere are intercepted, so a use-after-free of
# addon memory by anyone is caught). Leak checking is off: V8 and node keep
# memory until exit by design (detect_leaks=0).
set -u
HERE=$(cd "$(dirname "$0")" && pwd -P)
ROOT=$(cd "$HERE/../.." && pwd -P)
cd "$ROOT"
LAYOUTS=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do LAYOUTS="$LAYOUTS $1"; shift; done
[ "${1:-}" = "--" ] && shift
FILTERS=${*:-"conformance verbs/"}
LAYOUTS=${LAYOUTS:-single}

CC=${CC:-gcc}
LIBASAN=$($CC -print-file-name=libasan.so)
[ -f "$LIBASAN" ] || { echo "memcheck: libasan.so not found ($CC -print-file-name=libasan.so); apt-get install -y gcc" >&2; exit 1; }
[ -d dist/test ] || { echo "memcheck: run 'npm run build' first" >&2; exit 1; }

# node-gyp and node's headers, as scripts/build-native.mjs finds them.
NODE=$(command -v node)
PREFIX=$(dirname "$(dirname "$NODE")")
GYP=${npm_config_node_gyp:-}
for g in "$GYP" "$ROOT/node_modules/node-gyp/bin/node-gyp.js" "$PREFIX/lib/node_modules/npm/node_modules/node-gyp/bin/node-gyp.js"; do
  [ -n "$g" ] && [ -f "$g" ] && { GYP=$g; break; }
done
[ -f "$GYP" ] || { echo "memcheck: node-gyp not found" >&2; exit 1; }
NODEDIR=""
[ -f "$PREFIX/include/node/node_api.h" ] && NODEDIR="--nodedir=$PREFIX"

# A copy of the sources in build-asan/ (node-gyp always builds into ./build).
B=$ROOT/build-asan
rm -rf "$B" && mkdir -p "$B" && cp -r binding.gyp native "$B/" || exit 1
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
echo "=== memcheck: building the addons with $SAN in $B ==="
( cd "$B" && CFLAGS="$SAN" LDFLAGS="-fsanitize=address,undefined" "$NODE" "$GYP" rebuild $NODEDIR >"$B/build.log" 2>&1 ) || {
  echo "memcheck: ASan build failed (log: $B/build.log)" >&2; tail -20 "$B/build.log" >&2; exit 1; }
nm -D "$B/build/Release/async_rdma_verbs.node" | grep -q __asan_report || { echo "memcheck: the addon is not instrumented (CFLAGS not applied?)" >&2; exit 1; }

ASAN_ENV="ASYNC_RDMA_NATIVE=$B/build/Release/async_rdma_verbs.node"
[ -f "$B/build/Release/async_rdma_cm.node" ] && ASAN_ENV="$ASAN_ENV ASYNC_RDMA_NATIVE_CM=$B/build/Release/async_rdma_cm.node"
# abort_on_error: a report kills the process (the test fails); halt_on_error stops at the first.
ASAN_ENV="$ASAN_ENV LD_PRELOAD=$LIBASAN ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=0:allow_user_segv_handler=1:print_summary=1"
ASAN_ENV="$ASAN_ENV UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1"

rc=0
for layout in $LAYOUTS; do
  echo "=== memcheck: layout $layout, tests: $FILTERS ==="
  start=$(date +%s)
  "$HERE/run.sh" -l "$layout" -m 3G -t 2400 "{ env $ASAN_ENV ASYNC_RDMA_PROVIDER=verbs TEST_CONCURRENCY=1 ASYNC_RDMA_TEST_SLOW=10 node scripts/run-tests.mjs $FILTERS; echo \$? > /tmp/memcheck.rc; } 2>&1 | tee /tmp/memcheck.log; r=\$(cat /tmp/memcheck.rc); if grep -q 'ERROR: AddressSanitizer\|runtime error:' /tmp/memcheck.log; then echo 'memcheck: sanitizer reports above'; exit 1; fi; exit \$r"
  r=$?
  echo "=== memcheck layout $layout: exit $r after $(( $(date +%s) - start )) s ==="
  [ $r = 0 ] || rc=1
done
[ "${MEMCHECK_KEEP_BUILD:-0}" = 1 ] || rm -rf "$B"
exit $rc
