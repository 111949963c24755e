#!/usr/bin/env bash
# N "nodes" on one Linux machine, each a network namespace with its own address on a private bridge, for
# testing what crosses a node boundary (Ray heads and workers, rendezvous, weight broadcasts) without a cluster.
# Needs root (or CAP_NET_ADMIN) and iproute2. The namespaces share the machine's file system and processes;
# only the network is their own.
#
#   netns_cluster.sh up N       create nodes 1..N: namespace PREFIX-N, address SUBNET.N/24, loopback up
#   netns_cluster.sh down       kill every process left in the nodes, delete them and the bridge
#   netns_cluster.sh exec K CMD...   run CMD on node K
#   netns_cluster.sh addr K     print node K's address
#   netns_cluster.sh list       print "K NAMESPACE ADDRESS" per node
#   netns_cluster.sh link K up|down   connect node K to the bridge or cut it off (its packets are dropped
#                               silently, as behind a failed switch port); `link K` prints the link's host end,
#                               whose /sys/class/net/NAME/statistics count the node's traffic
#   netns_cluster.sh kill K     kill every process in node K (a crash of the node; its address stays)
#
# QURL_NETNS_PREFIX (default qurl-node) and QURL_NETNS_SUBNET (default 10.231.7) choose the names and the
# private /24; nothing else on the machine is touched. `down` is safe to run when nothing is up.
set -euo pipefail

prefix=${QURL_NETNS_PREFIX:-qurl-node}
subnet=${QURL_NETNS_SUBNET:-10.231.7}
bridge="${prefix:0:10}-br"  # interface names hold at most 15 characters

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "netns_cluster.sh: $*" >&2; exit 1; }
nodes() { ip netns list | awk -v p="$prefix-" 'index($1, p) == 1 {print substr($1, length(p) + 1)}' | sort -n; }
node_ns() { [[ "$1" =~ ^[0-9]+$ ]] || die "node '$1' is not a number"; echo "$prefix-$1"; }
up_ns() {  # the namespace of node $1, which must be up
  local ns
  ns=$(node_ns "$1") || exit 1  # (errexit does not reach into a command substitution)
  ip netns list | grep -qw "^$ns" || die "node $ns is not up (netns_cluster.sh up N)"
  echo "$ns"
}
host_end() { echo "${prefix:0:8}-$1"; }  # the host end of node $1's veth, on the bridge

list() { local k; for k in $(nodes); do echo "$k $prefix-$k $subnet.$k"; done; }

down() {
  local k ns
  for k in $(nodes); do
    ns="$prefix-$k"
    # every process still in the node: its network dies with it, so nothing outside can miss it
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns delete "$ns"
  done
  # host ends of the nodes' links: a namespace that something still references (a socket) outlives its
  # deletion with its link, which would block the next `up`
  local link
  for link in $(ip -o link show | awk -F': ' -v h="${prefix:0:8}-" 'index($2, h) == 1 {split($2, a, "@"); print a[1]}'); do
    ip link delete "$link" 2>/dev/null || true
  done
  if ip link show "$bridge" >/dev/null 2>&1; then ip link delete "$bridge"; fi
}

up() {
  local n=$1 k ns host
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 250 ]] || die "up needs a node count in 1..250, got '$n'"
  command -v ip >/dev/null || die "iproute2's ip is not installed"
  [[ -z "$(nodes)" ]] || die "nodes of prefix $prefix are up already; run down first"
  trap 'down' ERR  # a half-built cluster is taken down again
  ip link add "$bridge" type bridge
  ip link set "$bridge" up
  for k in $(seq 1 "$n"); do
    ns="$prefix-$k"
    host=$(host_end "$k")
    ip netns add "$ns"
    ip link add "$host" type veth peer name eth0 netns "$ns"
    ip link set "$host" master "$bridge" up
    ip -n "$ns" addr add "$subnet.$k/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  trap - ERR
  list
}

cmd=${1:-}; [[ -n "$cmd" ]] || usage; shift
case "$cmd" in
  up) [[ $# -eq 1 ]] || usage; up "$1" ;;
  down) down ;;
  exec)
    [[ $# -ge 2 ]] || usage
    ns=$(up_ns "$1"); shift
    exec ip netns exec "$ns" "$@"
    ;;
  link)
    [[ $# -eq 1 || ( $# -eq 2 && ( $2 == up || $2 == down ) ) ]] || usage
    up_ns "$1" >/dev/null
    if [[ $# -eq 1 ]]; then host_end "$1"; else ip link set "$(host_end "$1")" "$2"; fi
    ;;
  kill)
    [[ $# -eq 1 ]] || usage
    ns=$(up_ns "$1")
    ip netns pids "$ns" | xargs -r kill -KILL 2>/dev/null || true
    ;;
  addr) [[ $# -eq 1 ]] || usage; node_ns "$1" >/dev/null; echo "$subnet.$1" ;;
  list) list ;;
  *) usage ;;
esac
