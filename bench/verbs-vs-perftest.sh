#!/bin/sh
# Ours on real verbs against perftest, inside the Soft-RoCE guest:
#   ib_write_bw / ib_read_bw / ib_send_bw at 64 B, 4 KiB, 64 KiB, 1 MiB   vs  async-rdma perf write_bw / read_bw / send_bw
#   ib_write_lat / ib_read_lat / ib_send_lat / ib_atomic_lat at 8 B       vs  async-rdma perf write_lat / read_lat / send_lat / atomic_lat
# both sides of each comparison in one go (server and client on the guest's
# rxe device), medians over RUNS runs: perftest in a fresh process pair per
# run; ours in one process pair per test running each size RUNS times
# (--sizes), because node's start-up under TCG costs tens of seconds.
# Every client starts when its server has printed
# "Waiting for client to connect" (perftest's banner; `async-rdma perf` prints
# the same words, or {"type":"listening"} with --json), never after a sleep.
#
#   sh bench/verbs-vs-perftest.sh            on the host: calibrates (below), then runs itself in the guest
#   scripts/softroce/run.sh -t 1800 'sh bench/verbs-vs-perftest.sh'     the same without host calibration
#
# Env: RUNS (3), BW_ITERS (2000; 1 MiB uses BW_ITERS_1M, 200), LAT_ITERS (1000),
#      DISCARD (1): passes of each size run first in our process and not counted. The first
#      passes in a process run 2-3x slower while V8 compiles the path (docs/performance.md),
#      so the RUNS passes counted after them show its steady state (DISCARD=0 counts from the first)
#      WARMUP_BW (200) / WARMUP_LAT (100): our warm-up operations per size,
#      OURS_ARGS / OURS_SERVER_ARGS: extra `async-rdma perf` flags (e.g. "--polling busy"),
#      SIZES ("64 4096 65536 1048576"), TESTS (all), OUT (file for the raw log).
#
# Emulation: the guest runs under QEMU TCG, which slows JIT-compiled code
# more than C. The script times the same integer loop as JS and as C
# (bench/lib/calib.c) and md5sum, in the guest and (when started from the
# host) on the host, and prints the JIT penalty F = (JS guest/host) /
# (C guest/host); docs/performance.md explains how the ratios are read with it. A program that reports: never fails on a number.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
cd "$ROOT" || exit 1

calibrate() { # prints "js_ms c_ms md5_ms": one 32-bit multiply-add loop (1e8 steps) as JIT-compiled JS
  # and as C (bench/lib/calib.c, gcc -O1; "n/a" without gcc), and md5sum of 64 MiB (scalar C); best of 3
  js=$(node -e '
    function f(n) { let x = 0; for (let i = 0; i < n; i++) x = (Math.imul(x, 31) + i) | 0; return x; }
    f(1e6);
    let best = Infinity;
    for (let k = 0; k < 3; k++) { const t = process.hrtime.bigint(); f(1e8); best = Math.min(best, Number(process.hrtime.bigint() - t) / 1e6); }
    console.log(best.toFixed(1));')
  c=n/a
  d=$(mktemp -d /tmp/calib.XXXXXX)
  if command -v gcc >/dev/null 2>&1 && gcc -O1 -o "$d/calib" "$ROOT/bench/lib/calib.c" 2>/dev/null; then
    c=$(for k in 1 2 3; do "$d/calib" 100000000; done | sort -g | head -1)
  fi
  m=$(for k in 1 2 3; do
    a=$(date +%s%N); head -c 67108864 /dev/zero | md5sum >/dev/null; b=$(date +%s%N)
    echo $(((b - a) / 1000000))
  done | sort -g | head -1)
  rm -rf "$d"
  echo "$js $c $m"
}

if [ -z "${RXE_DEVS:-}" ]; then
  # On the host: calibrate here, then run this script in the guest with the host's numbers.
  [ -f dist/src/cli/main.js ] || { echo "verbs-vs-perftest: run npm run build first" >&2; exit 1; }
  HOST_CAL=$(calibrate)
  export HOST_CAL
  echo "verbs-vs-perftest: host calibration (js_ms c_ms): $HOST_CAL; starting the Soft-RoCE guest" >&2
  exec scripts/softroce/run.sh -t "${GUEST_TIMEOUT:-2400}" 'sh bench/verbs-vs-perftest.sh'
fi

RUNS=${RUNS:-3}
DISCARD=${DISCARD:-1}
BW_ITERS=${BW_ITERS:-2000}
BW_ITERS_1M=${BW_ITERS_1M:-200}
LAT_ITERS=${LAT_ITERS:-1000}
WARMUP_BW=${WARMUP_BW:-200}
WARMUP_LAT=${WARMUP_LAT:-100}
SIZES=${SIZES:-"64 4096 65536 1048576"}
TESTS=${TESTS:-"write_bw read_bw send_bw write_lat read_lat send_lat atomic_lat"}
DEV=${RXE_DEV:-$(echo "$RXE_DEVS" | cut -d' ' -f1)}
IP=$(echo "${RXE_IPS:-10.77.0.1}" | cut -d' ' -f1)
GID=${RXE_GID_INDEX:-1}
CLI="node dist/src/cli/main.js"
TMP=$(mktemp -d /tmp/vvp.XXXXXX)
OUT=${OUT:-$TMP/raw.log}
T0=$(date +%s)
: >"$OUT"

log() { printf '%s\n' "$*" >&2; }

# run_pair NAME 'server command' 'client command' -> client output in $TMP/cli.out, status in $CRC/$SRC
run_pair() {
  rm -f "$TMP/fifo" "$TMP/srv.out"
  mkfifo "$TMP/fifo"
  sh -c "exec timeout ${PAIR_TIMEOUT:-900} $2" >"$TMP/fifo" 2>&1 &
  SP=$!
  READY=0
  exec 3<"$TMP/fifo"
  while IFS= read -r line <&3; do
    printf '%s\n' "$line" >>"$TMP/srv.out"
    case $line in *"Waiting for client to connect"* | *'"type":"listening"'*) READY=1; break ;; esac
  done
  cat <&3 >>"$TMP/srv.out" &
  CATP=$!
  exec 3<&-
  if [ "$READY" = 1 ]; then
    sh -c "exec timeout ${PAIR_TIMEOUT:-900} $3" >"$TMP/cli.out" 2>&1
    CRC=$?
  else
    CRC=125
    echo "(server exited before it was ready)" >"$TMP/cli.out"
  fi
  wait "$SP"
  SRC=$?
  wait "$CATP" 2>/dev/null
  { echo "== $1: server rc=$SRC: $2"; cat "$TMP/srv.out"; echo "== $1: client rc=$CRC: $3"; cat "$TMP/cli.out"; } >>"$OUT"
  if [ "$CRC" != 0 ]; then
    log "  FAILED: $1 (client rc=$CRC, server rc=$SRC)"
    log "  server said: $(head -c 1500 "$TMP/srv.out")"
    log "  client said: $(tail -c 1500 "$TMP/cli.out")"
  fi
}

# perftest result line: the last line starting with two integers
pt_field() { grep -E '^ *[0-9]+ +[0-9]+ ' "$TMP/cli.out" | tail -1 | tr -s ' \t' ' ' | sed 's/^ //' | cut -d' ' -f"$1"; }
ours_field() { grep '"type":"result"' "$TMP/cli.out" | tail -1 | sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
median() { printf '%s\n' "$@" | grep -E '^[0-9.eE+-]+$' | sort -g | awk '{a[NR]=$1} END { if (NR == 0) print "n/a"; else if (NR % 2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "n/a" || b == "n/a" || b == 0) print "n/a"; else printf "%.3f", a / b }'; }

ROWS=$TMP/rows
CMDS=$TMP/cmds
: >"$ROWS"
: >"$CMDS"

label_of() { # size -> "64 B" / "4 KiB" / "1 MiB"
  if [ "$1" -ge 1048576 ]; then echo "$(($1 / 1048576)) MiB"; elif [ "$1" -ge 1024 ]; then echo "$(($1 / 1024)) KiB"; else echo "$1 B"; fi
}
repeat_list() { # size runs -> "s,s,s"
  out="" i=0
  while [ "$i" -lt "$2" ]; do out="$out${out:+,}$1"; i=$((i + 1)); done
  echo "$out"
}

# ours: one process pair per test (and per iteration count): every size RUNS
# times in one run (--sizes), so the guest pays node's start-up (tens of
# seconds under TCG) once instead of once per run.
# ours_runs TEST ITERS SIZE... -> result lines in $TMP/ours.$TEST
ours_runs() {
  test=$1 iters=$2
  shift 2
  list=""
  r=0
  while [ "$r" -lt "$((RUNS + DISCARD))" ]; do
    for s in "$@"; do list="$list${list:+,}$s"; done
    r=$((r + 1))
  done
  warm=$WARMUP_BW
  case $test in *_lat) warm=$WARMUP_LAT ;; esac
  srv="$CLI perf $test --provider verbs -d $DEV -x $GID -p 18515 --json${OURS_SERVER_ARGS:+ $OURS_SERVER_ARGS}"
  cli="$CLI perf $test $IP --provider verbs -d $DEV -x $GID -p 18515 --json --sizes $list -n $iters --warmup $warm${OURS_ARGS:+ $OURS_ARGS}"
  run_pair "ours $test ($list)" "$srv" "$cli"
  grep '"type":"result"' "$TMP/cli.out" >>"$TMP/ours.$test"
  [ "$CRC" = 0 ] || echo "ours rc=$CRC: $(tail -1 "$TMP/cli.out")" >>"$TMP/ours.$test.err"
  printf '  ours %s (sizes %s):\n    server: %s\n    client: %s\n' "$test" "$list" "$srv" "$cli" >>"$CMDS"
}
ours_vals() { # test size field
  grep "\"bytes\":$2," "$TMP/ours.$1" 2>/dev/null | tail -n +"$((DISCARD + 1))" | sed -n "s/.*\"$3\":\([0-9.eE+-]*\).*/\1/p" | tr '\n' ' '
}

# perftest: a fresh process pair per run, as perftest is used.
# pt_runs TEST TOOL SIZE ITERS -> values in $PT_BW / $PT_MR / $PT_LAT
pt_runs() {
  test=$1 tool=$2 size=$3 iters=$4
  sz="-s $size"
  [ "$test" = atomic_lat ] && sz=""
  srv="stdbuf -oL $tool -d $DEV -x $GID -p 18516 $sz -n $iters"
  cli="$tool -d $DEV -x $GID -p 18516 $sz -n $iters $IP"
  PT_BW="" PT_MR="" PT_LAT="" PT_ERR=""
  r=1
  while [ "$r" -le "$RUNS" ]; do
    run_pair "perftest $tool $size run $r" "$srv" "$cli"
    if [ "$CRC" = 0 ]; then
      case $test in
      *_bw) PT_BW="$PT_BW $(pt_field 4)" PT_MR="$PT_MR $(pt_field 5)" ;;
      *) PT_LAT="$PT_LAT $(pt_field 5)" ;;
      esac
    else
      PT_ERR="perftest rc=$CRC: $(tail -1 "$TMP/cli.out")"
    fi
    r=$((r + 1))
  done
  printf '  perftest %s %s (%s runs):\n    server: %s\n    client: %s\n' "$tool" "$(label_of "$size")" "$RUNS" "$srv" "$cli" >>"$CMDS"
}

g4() { for v in "$@"; do case $v in *[0-9]*) awk -v v="$v" 'BEGIN { printf "%.4g\n", v }' ;; *) echo "$v" ;; esac; done | tr '\n' '/' | sed 's#/$##'; }
row() { # label tool unit ours-values perftest-values errors
  o=$(median $4) p=$(median $5)
  # shellcheck disable=SC2086
  echo "$1|$2|$3|$(g4 $o)|$(g4 $p)|$(ratio "$o" "$p")|$(g4 $4)|$(g4 $5)|$6" >>"$ROWS"
  log "  $1: ours $o, perftest $p ($3)"
}

log "verbs-vs-perftest: device $DEV ($IP, GID $GID), $RUNS runs each; layout ${SOFTROCE_LAYOUT:-?}"
GUEST_CAL=$(calibrate)
log "guest calibration (js_ms c_ms): $GUEST_CAL"
$CLI devices --provider verbs >"$TMP/devices.out" 2>&1
DEV_RC=$?
head -3 "$TMP/devices.out" >&2

for test in $TESTS; do
  case $test in
  write_bw | read_bw | send_bw)
    small="" large=""
    for s in $SIZES; do if [ "$s" -ge 1048576 ]; then large="$large $s"; else small="$small $s"; fi; done
    # shellcheck disable=SC2086
    [ -n "$small" ] && ours_runs "$test" "$BW_ITERS" $small
    # shellcheck disable=SC2086
    [ -n "$large" ] && ours_runs "$test" "$BW_ITERS_1M" $large
    for s in $SIZES; do
      n=$BW_ITERS
      [ "$s" -ge 1048576 ] && n=$BW_ITERS_1M
      pt_runs "$test" "ib_$test" "$s" "$n"
      err="$(cat "$TMP/ours.$test.err" 2>/dev/null | tail -1) $PT_ERR"
      row "$test $(label_of "$s")" "ib_$test" "MB/s avg" "$(ours_vals "$test" "$s" bwAvg)" "$PT_BW" "$err"
      [ "$s" = 64 ] && row "$test 64 B msg rate" "ib_$test" "Mpps" "$(ours_vals "$test" "$s" msgRate)" "$PT_MR" ""
    done
    ;;
  write_lat | read_lat | send_lat | atomic_lat)
    ours_runs "$test" "$LAT_ITERS" 8
    pt_runs "$test" "ib_$test" 8 "$LAT_ITERS"
    err="$(cat "$TMP/ours.$test.err" 2>/dev/null | tail -1) $PT_ERR"
    row "$test 8 B" "ib_$test" "usec typical" "$(ours_vals "$test" 8 tTypical)" "$PT_LAT" "$err"
    ;;
  *) log "unknown test $test" ;;
  esac
done

# node's own floor per operation (bench/lib/verbs-floor.mjs: seam only, synchronous post + busy poll)
FLOOR=""
case " $TESTS " in *_lat*)
  log "floor: node bench/lib/verbs-floor.mjs --device $DEV --gid-index $GID --iters $LAT_ITERS"
  FLOOR=$(timeout "${PAIR_TIMEOUT:-900}" node bench/lib/verbs-floor.mjs --device "$DEV" --gid-index "$GID" --iters "$LAT_ITERS" 2>&1) || log "  floor failed: $FLOOR"
  ;;
esac

T1=$(date +%s)
echo
echo "## async-rdma (verbs provider) vs perftest — Soft-RoCE guest ($DEV, layout ${SOFTROCE_LAYOUT:-?})"
echo
echo "guest: $(uname -r), $(nproc) vCPUs under QEMU TCG; $RUNS runs each, medians (ours: $DISCARD uncounted pass(es) of each size first, in the same process); $((T1 - T0)) s; \`async-rdma devices --provider verbs\` rc=$DEV_RC"
echo
echo "| test | perftest tool | unit | ours | perftest | ours / perftest | ours runs | perftest runs | errors |"
echo "|---|---|---|---|---|---|---|---|---|"
awk -F'|' '{ printf "|"; for (i = 1; i <= NF; i++) printf " %s |", $i; print "" }' "$ROWS"
echo
if [ -n "$FLOOR" ]; then
  echo "node's floor in this guest (\`node bench/lib/verbs-floor.mjs --device $DEV --gid-index $GID --iters $LAT_ITERS\`: one WR posted through the seam and busy-polled in a synchronous loop, both QPs in one process; no agent, no promises, no event loop):"
  echo
  echo "| operation (8 B) | post + completion, µs median | of which the post call, µs |"
  echo "|---|---|---|"
  printf '%s\n' "$FLOOR" | grep '"type":"floor"' | sed -n 's/.*"op":"\([a-z_]*\)".*"usecMedian":\([0-9.eE+-]*\)\(,"postUsecMedian":\([0-9.eE+-]*\)\)\{0,1\}.*/\1 \2 \4/p' |
    awk '{ printf "| %s | %.4g | %s |\n", $1, $2, ($3 == "" ? "" : sprintf("%.4g", $3)) }'
  echo
fi
set -- $GUEST_CAL
echo "calibration (best of 3): the same integer loop as JS ${1} ms and as C ${2} ms; md5sum of 64 MiB ${3} ms (guest)"
if [ -n "${HOST_CAL:-}" ]; then
  set -- $GUEST_CAL $HOST_CAL
  awk -v gj="$1" -v gc="$2" -v gm="$3" -v hj="$4" -v hc="$5" -v hm="$6" 'BEGIN {
    printf "host: JS %s ms, C %s ms, md5sum %s ms\n", hj, hc, hm
    printf "emulation slows JS %.1fx, the C loop %s, md5sum %.1fx\n", gj / hj, (gc + 0 > 0 && hc + 0 > 0) ? sprintf("%.1fx", gc / hc) : "n/a", gm / hm
    if (gc + 0 > 0 && hc + 0 > 0) printf "JIT penalty F = (JS slowdown) / (C slowdown) = %.2f (loop), %.2f (vs md5sum)\n", (gj / hj) / (gc / hc), (gj / hj) / (gm / hm)
    else printf "JIT penalty F = (JS slowdown) / (md5sum slowdown) = %.2f\n", (gj / hj) / (gm / hm)
  }'
fi
echo
echo "commands (server | client; each client started on its server's ready line):"
cat "$CMDS"
echo
echo "raw log: $OUT"
if grep -q 'rc=' "$ROWS"; then
  echo "--- raw log of the failed runs (last 60 lines)"
  tail -60 "$OUT"
fi
rm -f "$TMP/fifo"
exit 0
