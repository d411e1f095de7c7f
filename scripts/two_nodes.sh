#!/usr/bin/env bash
# Two emulated nodes with a real link between them, on one Linux machine (issue 35).
#
#   scripts/two_nodes.sh run [--id ID] [--rate RATE] -- COMMAND...
#       Make two network namespaces joined by a veth pair (node 0: 10.213.N.1, node 1:
#       10.213.N.2), optionally throttle the link to RATE (tc's tbf, e.g. 200mbit; both
#       directions), and run COMMAND once in each namespace, with
#         NODE_RANK      0 or 1
#         MASTER_ADDR    node 0's address on the link (the rendezvous and the c10d store)
#         MASTER_PORT    a port for them
#         GLOO_SOCKET_IFNAME  the link's interface in that namespace (gloo's traffic between
#                        the nodes goes over it; ranks of one node talk over loopback)
#         TWO_NODES_ID   ID, for `throttle` / `unthrottle` while it runs
#       COMMAND runs under `bash -c`, so it may name these variables, e.g.
#         scripts/two_nodes.sh run -- 'torchrun --nnodes 2 --node-rank $NODE_RANK \
#             --nproc-per-node 2 --master-addr $MASTER_ADDR --master-port $MASTER_PORT \
#             launch/train.py cluster.nodes=2 cluster.gpus_per_node=2 ...'
#       Node 1's output is prefixed "[node 1]"; the exit status is the first nonzero of the
#       two. Everything is removed when the command ends, fails or is interrupted.
#   scripts/two_nodes.sh throttle --id ID RATE     throttle the running link to RATE (tbf)
#   scripts/two_nodes.sh unthrottle --id ID        lift the throttle
#   scripts/two_nodes.sh check                     can namespaces be made here? (exit 0/1,
#                                                  the reason on stderr)
#
# Needs root (CAP_NET_ADMIN), `ip` and `tc`. The kernel here has no netem, but tbf works on a
# veth. Measured on this machine: a gloo all-reduce across the veth ran at 805 MiB/s free and
# 23 MiB/s under `tbf rate 200mbit`.
set -euo pipefail

die() { echo "two_nodes.sh: $*" >&2; exit 2; }

names() {   # ID -> the namespaces and interfaces
    NS0="mds${1}a"; NS1="mds${1}b"; IF0="mdv${1}a"; IF1="mdv${1}b"
    local n=$(( ${1} % 250 + 1 ))
    ADDR0="10.213.${n}.1"; ADDR1="10.213.${n}.2"
}

tbf() {     # tbf() add|change|del IFACE-IN-NS NS RATE
    local op=$1 ns=$2 dev=$3 rate=${4:-}
    if [[ $op == del ]]; then
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    else
        # burst: at least rate/250 (the kernel's HZ) or 32 kbit; latency bounds the queue
        ip netns exec "$ns" tc qdisc "$op" dev "$dev" root tbf rate "$rate" burst 64kbit \
            latency 2000ms
    fi
}

check() {
    [[ $(id -u) == 0 ]] || { echo "not root: network namespaces need CAP_NET_ADMIN" >&2; return 1; }
    command -v ip >/dev/null || { echo "no 'ip' command (iproute2)" >&2; return 1; }
    command -v tc >/dev/null || { echo "no 'tc' command (iproute2)" >&2; return 1; }
    local t="mdschk$$"
    if ! ip netns add "$t" 2>/tmp/two_nodes_check.$$; then
        echo "cannot make a network namespace: $(cat /tmp/two_nodes_check.$$)" >&2
        rm -f /tmp/two_nodes_check.$$; return 1
    fi
    ip netns del "$t"; rm -f /tmp/two_nodes_check.$$
}

teardown() {
    set +e
    for p in ${PIDS:-}; do kill -TERM -- "-$p" 2>/dev/null; done
    sleep 0.5
    for p in ${PIDS:-}; do kill -KILL -- "-$p" 2>/dev/null; done
    ip netns pids "$NS0" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
    ip netns pids "$NS1" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
    ip link del "$IF0" 2>/dev/null
    ip netns exec "$NS0" ip link del "$IF0" 2>/dev/null
    ip netns del "$NS0" 2>/dev/null
    ip netns del "$NS1" 2>/dev/null
}

run() {
    local id=$$ rate=""
    while [[ $# -gt 0 ]]; do
        case $1 in
            --id) id=$2; shift 2;;
            --rate) rate=$2; shift 2;;
            --) shift; break;;
            *) die "run: unknown option $1 (usage: run [--id ID] [--rate RATE] -- COMMAND)";;
        esac
    done
    [[ $# -gt 0 ]] || die "run: no COMMAND after --"
    [[ $id =~ ^[0-9]+$ ]] || die "run: --id must be a number, got '$id'"
    check || exit 3
    names "$id"
    if ip netns list | grep -qw -e "$NS0" -e "$NS1"; then
        # left by a run that was killed (SIGKILL skips the teardown): remove them when no
        # process runs in them; a live run with this id is refused
        if [[ -n $(ip netns pids "$NS0" 2>/dev/null; ip netns pids "$NS1" 2>/dev/null) ]]; then
            die "run: a run with id $id is going (its namespaces hold processes): use another --id"
        fi
        PIDS=""; teardown; set -e
    fi
    PIDS=""
    trap teardown EXIT
    trap 'exit 130' INT TERM
    ip netns add "$NS0"; ip netns add "$NS1"
    ip link add "$IF0" type veth peer name "$IF1"
    ip link set "$IF0" netns "$NS0"; ip link set "$IF1" netns "$NS1"
    ip -n "$NS0" addr add "$ADDR0/24" dev "$IF0"; ip -n "$NS1" addr add "$ADDR1/24" dev "$IF1"
    for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
    ip -n "$NS0" link set "$IF0" up; ip -n "$NS1" link set "$IF1" up
    if [[ -n $rate ]]; then tbf add "$NS0" "$IF0" "$rate"; tbf add "$NS1" "$IF1" "$rate"; fi
    local port=$(( 20000 + id % 20000 ))
    local cmd="$*"
    for node in 0 1; do
        local ns=$NS0 ifc=$IF0
        [[ $node == 1 ]] && ns=$NS1 ifc=$IF1
        if [[ $node == 0 ]]; then
            setsid env NODE_RANK=0 MASTER_ADDR="$ADDR0" MASTER_PORT="$port" \
                GLOO_SOCKET_IFNAME="$ifc" TWO_NODES_ID="$id" \
                ip netns exec "$ns" bash -c "$cmd" &
        else
            setsid bash -c 'env NODE_RANK=1 MASTER_ADDR="$0" MASTER_PORT="$1" \
                GLOO_SOCKET_IFNAME="$2" TWO_NODES_ID="$3" ip netns exec "$4" bash -c "$5" 2>&1 \
                | sed -u "s/^/[node 1] /"' "$ADDR0" "$port" "$ifc" "$id" "$ns" "$cmd" &
        fi
        PIDS="$PIDS $!"
        [[ $node == 0 ]] && sleep 1        # node 0 hosts the store: let it listen first
    done
    local rc=0 r
    for p in $PIDS; do
        r=0; wait "$p" || r=$?
        [[ $rc == 0 ]] && rc=$r
    done
    exit "$rc"
}

case ${1:-} in
    run) shift; run "$@";;
    throttle|unthrottle)
        op=$1; shift
        [[ ${1:-} == --id ]] || die "$op: usage: $op --id ID${op/unthrottle/}${op/throttle/ RATE}"
        names "$2"; shift 2
        ip netns list | grep -qw "$NS0" || die "$op: no running link with id ${NS0#mds}"
        if [[ $op == throttle ]]; then
            [[ $# -eq 1 ]] || die "throttle: give one RATE (e.g. 200mbit)"
            for pair in "$NS0 $IF0" "$NS1 $IF1"; do
                set -- $pair "$1"
                tbf change "$1" "$2" "$3" 2>/dev/null || tbf add "$1" "$2" "$3"
                set -- "$3"
            done
        else
            tbf del "$NS0" "$IF0"; tbf del "$NS1" "$IF1"
        fi;;
    check) check;;
    *) die "usage: two_nodes.sh run [--id ID] [--rate RATE] -- COMMAND | throttle --id ID RATE | unthrottle --id ID | check";;
esac
