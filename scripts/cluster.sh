#!/usr/bin/env bash
# A cluster of N "nodes" on this machine, for tests and benchmarks (Linux, root):
# each node is a network namespace with its own address, loopback and hostname (a UTS
# namespace), linked to one bridge that lives in a namespace of its own, so nothing of the
# host's network is touched and only the addresses made here are used.
#
#   scripts/cluster.sh up N [--rate R]   make nodes 0..N-1 (R: each node's link, e.g. 200mbit; both ways)
#   scripts/cluster.sh down              remove them (killing what runs in them)
#   scripts/cluster.sh exec K CMD...     run CMD on node K (its network, hostname and /etc/hosts)
#   scripts/cluster.sh addr K            node K's address
#   scripts/cluster.sh rate K R|none     re-limit node K's link (a trickle: 8kbit)
#   scripts/cluster.sh cut K | heal K    partition node K (its switch port down: packets dropped silently)
#   scripts/cluster.sh kill K            SIGKILL every process on node K (the node lost)
#   scripts/cluster.sh pids K            the processes on node K
#   scripts/cluster.sh hostfile N        an mpirun hostfile of N nodes (slots from --slots S, default 4)
#   scripts/cluster.sh rsh HOST CMD...   mpirun's rsh agent: CMD on the node called HOST
#   scripts/cluster.sh check             exit 0 when this machine can make a cluster (else why, on stderr)
set -euo pipefail

PREFIX=${GW_CLUSTER_PREFIX:-gw}
SUBNET=${GW_CLUSTER_SUBNET:-10.231.77}   # node K is $SUBNET.(K+11)
STATE=/run/gridweave-cluster-$PREFIX
SWITCH=$PREFIX-switch

node() { echo "$PREFIX-node$1"; }
addr() { echo "$SUBNET.$(($1 + 11))"; }
die() { echo "cluster.sh: $*" >&2; exit 2; }
need_node() {
  [[ "${1:-}" =~ ^[0-9]+$ ]] || die "a node number is needed, got '${1:-}'"
  [ -e "/run/netns/$(node "$1")" ] || die "no node $1 (scripts/cluster.sh up N first)"
}

check() {
  [ "$(uname -s)" = Linux ] || { echo "not Linux" >&2; return 1; }
  [ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; return 1; }
  for t in ip tc nsenter unshare; do
    command -v $t >/dev/null || { echo "no $t on PATH" >&2; return 1; }
  done
  local probe="$PREFIX-probe$$"
  ip netns add "$probe" 2>/dev/null || { echo "cannot create a network namespace" >&2; return 1; }
  local ok=0
  ip -n "$probe" link add name gwa type veth peer name gwb 2>/dev/null || ok=1
  [ $ok = 0 ] && { ip -n "$probe" link add name gwbr type bridge 2>/dev/null || ok=1; }
  [ $ok = 0 ] && { ip -n "$probe" link set gwa up && tc -n "$probe" qdisc add dev gwa root tbf rate 1mbit burst 32kb \
    latency 100ms 2>/dev/null || ok=1; }
  ip netns del "$probe"
  [ $ok = 0 ] || echo "no veth, bridge or tbf in this kernel" >&2
  return $ok
}

limit() {  # limit NS DEV RATE: tbf on DEV's egress (none: remove)
  tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
  if [ "$3" != none ]; then
    # burst: at least one full-size packet plus a few ms at the rate; latency bounds the queue
    tc -n "$1" qdisc add dev "$2" root tbf rate "$3" burst 64kb latency 200ms
  fi
}

set_rate() {  # both ways: the node's egress and the switch port's egress towards it
  limit "$(node "$1")" eth0 "$2"
  limit "$SWITCH" "$PREFIX-p$1" "$2"
}

up() {
  local n=${1:-}; shift || true
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "up N: N from 1 to 200, got '$n'"
  local rate=none
  while [ $# -gt 0 ]; do
    case "$1" in
      --rate) rate=${2:?--rate needs a value, e.g. 200mbit}; shift 2 ;;
      *) die "up: unknown argument $1" ;;
    esac
  done
  [ -e "/run/netns/$SWITCH" ] && die "a cluster '$PREFIX' is up already (scripts/cluster.sh down first)"
  mkdir -p "$STATE" "/etc/netns"
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add name br0 type bridge
  ip -n "$SWITCH" link set br0 up
  local hosts="127.0.0.1 localhost"$'\n'
  for ((k = 0; k < n; k++)); do hosts+="$(addr $k) $(node $k)"$'\n'; done
  for ((k = 0; k < n; k++)); do
    local ns; ns=$(node $k)
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$SWITCH" link add name "$PREFIX-p$k" type veth peer name eth0 netns "$ns"
    ip -n "$SWITCH" link set "$PREFIX-p$k" master br0 up
    ip -n "$ns" addr add "$(addr $k)/24" dev eth0
    ip -n "$ns" link set eth0 up
    # ip netns exec bind-mounts /etc/netns/NAME/* over /etc/*: every node resolves every node
    mkdir -p "/etc/netns/$ns"
    printf '%s' "$hosts" > "/etc/netns/$ns/hosts"
    echo "$ns" > "/etc/netns/$ns/hostname"
    # no name server: names resolve from the hosts file at once (a reverse lookup of a node's
    # address would otherwise wait for the host's resolver, which the node cannot reach)
    echo "# gridweave cluster node: names from /etc/hosts" > "/etc/netns/$ns/resolv.conf"
    touch "$STATE/uts$k"
    unshare --uts="$STATE/uts$k" hostname "$ns"
    set_rate $k "$rate"
  done
  echo "$n" > "$STATE/nodes"
  echo "cluster '$PREFIX': $n nodes $(addr 0)..$(addr $((n - 1))), link ${rate}"
}

down() {
  [ -e "$STATE/nodes" ] || { [ -e "/run/netns/$SWITCH" ] && ip netns del "$SWITCH"; return 0; }
  local n; n=$(cat "$STATE/nodes")
  for ((k = 0; k < n; k++)); do
    local ns; ns=$(node $k)
    if [ -e "/run/netns/$ns" ]; then
      ip netns pids "$ns" | xargs -r kill -9 2>/dev/null || true
      ip netns del "$ns" || true
    fi
    umount "$STATE/uts$k" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  ip netns del "$SWITCH" 2>/dev/null || true
  rm -rf "$STATE"
}

run_on() {  # run_on K CMD...: the node's UTS namespace, then its network (ip netns exec: /etc/hosts)
  local k=$1; shift
  exec nsenter --uts="$STATE/uts$k" ip netns exec "$(node "$k")" "$@"
}

cmd=${1:-}; shift || true
case "$cmd" in
  check) check ;;
  up) up "$@" ;;
  down) down ;;
  exec) need_node "${1:-}"; k=$1; shift; [ $# -gt 0 ] || die "exec K CMD..."; run_on "$k" "$@" ;;
  addr) need_node "${1:-}"; addr "$1" ;;
  rate) need_node "${1:-}"; set_rate "$1" "${2:?rate K R|none}" ;;
  cut) need_node "${1:-}"; ip -n "$SWITCH" link set "$PREFIX-p$1" down ;;
  heal) need_node "${1:-}"; ip -n "$SWITCH" link set "$PREFIX-p$1" up ;;
  kill) need_node "${1:-}"; ip netns pids "$(node "$1")" | xargs -r kill -9 2>/dev/null || true ;;
  pids) need_node "${1:-}"; ip netns pids "$(node "$1")" ;;
  hostfile)
    n=${1:?hostfile N}; slots=4
    [ "${2:-}" = --slots ] && slots=${3:?--slots S}
    for ((k = 0; k < n; k++)); do echo "$(node $k) slots=$slots"; done ;;
  rsh)  # mpirun -mca plm_rsh_agent "cluster.sh rsh": HOST [ssh options] CMD...
    host=${1:?rsh HOST CMD}; shift
    while [ $# -gt 0 ] && [[ "$1" == -* ]]; do shift; done  # ssh flags OpenMPI may add (-x)
    [[ "$host" =~ ^$PREFIX-node([0-9]+)$ ]] || die "rsh: $host is not a node of cluster '$PREFIX'"
    k=${BASH_REMATCH[1]}
    need_node "$k"
    # OpenMPI passes one shell command line, as ssh would
    run_on "$k" /bin/sh -c "$*" ;;
  *) sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
