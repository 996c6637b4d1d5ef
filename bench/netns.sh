#!/bin/sh
# Two "hosts" on one machine for the benchmarks: two network namespaces joined
# by a veth pair (the approach of scripts/netns/two-hosts.sh).
#
#   sh bench/netns.sh up                 creates them; prints NS_S= NS_C= IP_S= IP_C= lines
#   sh bench/netns.sh down NS_S NS_C     removes them (and so the veth pair)
#   sh bench/netns.sh check              exit 0 if namespaces can be made here (root, iproute2)
#
# Run a program in one:  ip netns exec "$NS_S" node ...
set -eu

check() {
  [ "$(id -u)" = 0 ] || { echo "netns: needs root (uid $(id -u))" >&2; return 1; }
  command -v ip >/dev/null || { echo "netns: iproute2 'ip' not found (apt-get install -y iproute2)" >&2; return 1; }
  ip netns list >/dev/null 2>&1 || { echo "netns: 'ip netns' is not usable here" >&2; return 1; }
}

case "${1:-}" in
check) check ;;
up)
  check
  ID=$$
  NS_S="ardma-bs-$ID"
  NS_C="ardma-bc-$ID"
  IF_S="ba$ID" # interface names are at most 15 characters
  IF_C="bb$ID"
  NET="10.98.$((ID % 254 + 1))"
  ip netns add "$NS_S"
  ip netns add "$NS_C" || { ip netns del "$NS_S"; exit 1; }
  if ! { ip link add "$IF_S" type veth peer name "$IF_C" &&
    ip link set "$IF_S" netns "$NS_S" &&
    ip link set "$IF_C" netns "$NS_C" &&
    ip -n "$NS_S" addr add "$NET.1/24" dev "$IF_S" &&
    ip -n "$NS_C" addr add "$NET.2/24" dev "$IF_C" &&
    ip -n "$NS_S" link set lo up &&
    ip -n "$NS_C" link set lo up &&
    ip -n "$NS_S" link set "$IF_S" up &&
    ip -n "$NS_C" link set "$IF_C" up; }; then
    ip netns del "$NS_S" 2>/dev/null || true
    ip netns del "$NS_C" 2>/dev/null || true
    exit 1
  fi
  # Static neighbours: no ARP round trip inside the first measurement.
  MAC_S=$(ip -n "$NS_S" -o link show "$IF_S" | sed -n 's/.*link\/ether \([0-9a-f:]*\).*/\1/p')
  MAC_C=$(ip -n "$NS_C" -o link show "$IF_C" | sed -n 's/.*link\/ether \([0-9a-f:]*\).*/\1/p')
  [ -n "$MAC_C" ] && ip -n "$NS_S" neigh replace "$NET.2" lladdr "$MAC_C" dev "$IF_S" nud permanent || true
  [ -n "$MAC_S" ] && ip -n "$NS_C" neigh replace "$NET.1" lladdr "$MAC_S" dev "$IF_C" nud permanent || true
  echo "NS_S=$NS_S"
  echo "NS_C=$NS_C"
  echo "IP_S=$NET.1"
  echo "IP_C=$NET.2"
  ;;
down)
  shift
  for ns in "$@"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true # deleting a namespace deletes its veth end, and so the pair
  done
  ;;
*)
  echo "usage: sh bench/netns.sh up | down NS_S NS_C | check" >&2
  exit 2
  ;;
esac
