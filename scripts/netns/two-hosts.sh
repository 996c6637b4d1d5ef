#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces joined by a veth pair,
# a tcp-provider peer serving in one (test/support/seam-peer.ts, serve mode)
# and a client in the other. They move BYTES (default 8 MiB) of checksummed
# data both ways with SEND, RDMA WRITE and RDMA READ, and the script proves
# the traffic crossed the veth by its rx_bytes counters.
#
#   sudo scripts/netns/two-hosts.sh [BYTES]        (after npm run build)
#
# Prints one summary line starting "two-hosts: OK" (exit 0), or
# "two-hosts: FAIL ..." (exit 1), or "two-hosts: SKIP <reason>" (exit 77 when
# not root or `ip netns` is unavailable). Namespaces are removed on exit.
set -euo pipefail

BYTES="${1:-${BYTES:-8388608}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER="$ROOT/dist/test/support/seam-peer.js"
NODE="${NODE:-$(command -v node || true)}"
DEADLINE="${TWO_HOSTS_DEADLINE:-60}" # seconds, per process
export SEAM_PEER_STEP_MS="${SEAM_PEER_STEP_MS:-20000}" # bound of each step inside the peers

skip() { echo "two-hosts: SKIP $*"; exit 77; }
step() { echo "two-hosts: [$(date +%T.%3N)] $*" >&2; }
fail() { echo "two-hosts: FAIL $*"; exit 1; }

[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces (uid $(id -u))"
command -v ip >/dev/null || skip "iproute2 'ip' not found (apt-get install -y iproute2)"
ip netns list >/dev/null 2>&1 || skip "'ip netns' is not usable here: $(ip netns list 2>&1 | head -1)"
[ -n "$NODE" ] || fail "node not found"
[ -f "$PEER" ] || fail "$PEER missing: run npm run build first"

ID=$$
NS_S="ardma-srv-$ID"
NS_C="ardma-cli-$ID"
IF_S="va$ID" # interface names are at most 15 characters
IF_C="vb$ID"
NET="10.99.$((ID % 254 + 1))"
IP_S="$NET.1"
IP_C="$NET.2"
CTL_PORT=18515
TMP="$(mktemp -d /tmp/two-hosts.XXXXXX)"
SERVER_PID=""
CLIENT_PID=""

cleanup() {
  local rc=$?
  for pid in $SERVER_PID $CLIENT_PID; do kill -KILL "$pid" 2>/dev/null || true; done
  ip netns pids "$NS_S" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
  ip netns pids "$NS_C" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
  ip netns del "$NS_S" 2>/dev/null || true # deleting a namespace deletes its end of the veth, and so the pair
  ip netns del "$NS_C" 2>/dev/null || true
  ip link del "$IF_S" 2>/dev/null || true
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step "namespaces $NS_S ($IP_S) and $NS_C ($IP_C), veth $IF_S <-> $IF_C"
ip netns add "$NS_S" 2>"$TMP/err" || skip "cannot create a network namespace: $(cat "$TMP/err")"
ip netns add "$NS_C"
ip link add "$IF_S" type veth peer name "$IF_C"
ip link set "$IF_S" netns "$NS_S"
ip link set "$IF_C" netns "$NS_C"
ip -n "$NS_S" addr add "$IP_S/24" dev "$IF_S"
ip -n "$NS_C" addr add "$IP_C/24" dev "$IF_C"
ip -n "$NS_S" link set lo up
ip -n "$NS_C" link set lo up
ip -n "$NS_S" link set "$IF_S" up
ip -n "$NS_C" link set "$IF_C" up

# Static neighbours: no ARP round trip (or lost ARP probe) on the first packets.
MAC_S=$(ip netns exec "$NS_S" cat "/sys/class/net/$IF_S/address")
MAC_C=$(ip netns exec "$NS_C" cat "/sys/class/net/$IF_C/address")
ip -n "$NS_S" neigh replace "$IP_C" lladdr "$MAC_C" dev "$IF_S" nud permanent
ip -n "$NS_C" neigh replace "$IP_S" lladdr "$MAC_S" dev "$IF_C" nud permanent

rx() { ip netns exec "$1" cat "/sys/class/net/$2/statistics/rx_bytes"; }
RX_S0=$(rx "$NS_S" "$IF_S")
RX_C0=$(rx "$NS_C" "$IF_C")

# Server: announces its control address on stdout (through a FIFO, so we wait for the event, not for time).
mkfifo "$TMP/server.out"
ip netns exec "$NS_S" timeout "$DEADLINE" "$NODE" "$PEER" serve --host "$IP_S" --bytes "$BYTES" --ctl-listen "$IP_S:$CTL_PORT" \
  >"$TMP/server.out" 2>"$TMP/server.err" &
SERVER_PID=$!
step "server started (pid $SERVER_PID)"
exec 3<"$TMP/server.out"
if ! read -r -t 30 -u 3 LISTENING; then
  fail "the server did not start within 30 s: $(cat "$TMP/server.err")"
fi
case "$LISTENING" in *'"listening"'*) ;; *) fail "unexpected server line: $LISTENING" ;; esac
step "server listening: $LISTENING"

T0=$(date +%s%N)
set +e
# In the background, so that `wait` (interruptible) keeps INT/TERM prompt.
ip netns exec "$NS_C" timeout "$DEADLINE" "$NODE" "$PEER" client --server "$IP_S:$CTL_PORT" --host "$IP_C" --bytes "$BYTES" \
  >"$TMP/client.out" 2>"$TMP/client.err" &
CLIENT_PID=$!
wait "$CLIENT_PID"
CLIENT_RC=$?
CLIENT_PID=""
step "client exited with $CLIENT_RC"
# A client that failed early leaves the server waiting: do not wait for its timeout.
if [ "$CLIENT_RC" != 0 ]; then kill -TERM "$SERVER_PID" 2>/dev/null; fi
wait "$SERVER_PID"
SERVER_RC=$?
set -e
SERVER_PID=""
step "server exited with $SERVER_RC"
exec 3<&-
T1=$(date +%s%N)

RX_S1=$(rx "$NS_S" "$IF_S")
RX_C1=$(rx "$NS_C" "$IF_C")
D_S=$((RX_S1 - RX_S0))
D_C=$((RX_C1 - RX_C0))
SUMMARY="$(grep '"type":"summary"' "$TMP/client.out" || true)"
echo "client summary: ${SUMMARY:-<none>}"
echo "veth $IF_S ($NS_S, $IP_S) rx_bytes $RX_S0 -> $RX_S1 (+$D_S); veth $IF_C ($NS_C, $IP_C) rx_bytes $RX_C0 -> $RX_C1 (+$D_C)"
ip -n "$NS_S" -s link show "$IF_S" | sed 's/^/  /'

if [ "$CLIENT_RC" != 0 ] || [ "$SERVER_RC" != 0 ]; then
  echo "--- server stderr"; cat "$TMP/server.err"
  echo "--- client stderr"; cat "$TMP/client.err"
  fail "client exit $CLIENT_RC, server exit $SERVER_RC"
fi
case "$SUMMARY" in *'"ok":true'*) ;; *) fail "the client did not verify every region: ${SUMMARY:-no summary}" ;; esac
# Each side received the other's SENDs and WRITEs and the responses to its READs: 3 × BYTES at least.
MIN=$((3 * BYTES))
[ "$D_S" -ge "$MIN" ] || fail "only $D_S bytes arrived on $IF_S (expected >= $MIN): traffic did not cross the veth"
[ "$D_C" -ge "$MIN" ] || fail "only $D_C bytes arrived on $IF_C (expected >= $MIN): traffic did not cross the veth"

MS=$(((T1 - T0) / 1000000))
echo "two-hosts: OK $BYTES bytes each way x SEND+WRITE+READ, sha256 verified on both hosts; veth rx_bytes server +$D_S client +$D_C (>= $MIN each); ${MS} ms; namespaces $NS_S/$NS_C"
