#!/usr/bin/env bash
# The lab demo: kube-proxy-rs in nftables mode in front of three pods, on this machine, inside
# throwaway network namespaces.
#
#   bash scripts/lab.sh [--no-build]
#
# Needs root (it creates network namespaces) on Debian or Ubuntu; installs nftables, iproute2,
# curl, build-essential, pkg-config, clang and libbpf-dev (the ebpf mode's programs are built
# with the binary) with apt-get if any is missing. Rust (cargo) must already
# be installed.
#
# What it does, printing each step as "==> ...":
#   1. builds kube-proxy and kp-echo (release);
#   2. creates a "node" namespace, three "pod" namespaces running kp-echo (pod-a, pod-b, pod-c
#      on TCP 8080) and an outside "client" namespace, addressed as in crates/kp-test/src/lab.rs;
#   3. writes a Service demo/web (ClusterIP 10.96.0.10:80 -> 8080, NodePort 30080), its
#      EndpointSlice and the Node lab-node into a manifest directory, and starts kube-proxy in
#      the node namespace, reading that directory;
#   4. sends 30 requests from a pod to the ClusterIP and 30 from the client to the NodePort,
#      shows the nftables table, removes pod-c from the EndpointSlice and checks that pod-c
#      stops answering, and prints a few sync metrics.
# It exits non-zero if an expectation fails. All traffic stays inside its namespaces, and the
# namespaces are deleted on exit, also after an error or Ctrl-C. Nothing in the machine's own
# network namespace is changed.
#
# Environment: CARGO_TARGET_DIR as for cargo; KUBE_PROXY=PATH runs that kube-proxy binary
# instead of the release build (with --no-build, nothing is built).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BUILD=1
for arg in "$@"; do
    case $arg in
        --no-build) BUILD=0 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "lab.sh: unknown argument '$arg' (try --help)" >&2
            exit 64
            ;;
    esac
done

say() { printf '\n==> %s\n' "$*"; }
die() {
    printf 'lab.sh: %s\n' "$*" >&2
    exit 1
}
FAILURES=0
fail() {
    printf '    FAIL: %s\n' "$*"
    FAILURES=$((FAILURES + 1))
}

[ "$(id -u)" -eq 0 ] || die "needs root, it creates network namespaces: sudo bash scripts/lab.sh"

# --- 1. tools and build ----------------------------------------------------------------------

missing=()
command -v nft >/dev/null || missing+=(nftables)
command -v ip >/dev/null || missing+=(iproute2)
command -v curl >/dev/null || missing+=(curl)
command -v cc >/dev/null || missing+=(build-essential)
command -v pkg-config >/dev/null || missing+=(pkg-config)
# The ebpf mode's programs (crates/kp-ebpf/bpf) are compiled by the binary's build.
command -v clang >/dev/null || missing+=(clang)
[ -f /usr/include/bpf/bpf_helpers.h ] || missing+=(libbpf-dev)
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "missing ${missing[*]}, and no apt-get to install them"
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ "$BUILD" -eq 1 ]; then
    command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (rustup), then run again"
    say "building kube-proxy and kp-echo (cargo build --release)"
    (cd "$ROOT" && cargo build --release -p kube-proxy -p kp-test)
fi
PROXY=${KUBE_PROXY:-$TARGET/release/kube-proxy}
ECHO=$TARGET/release/kp-echo
[ -x "$PROXY" ] || die "no kube-proxy binary at $PROXY"
[ -x "$ECHO" ] || die "no kp-echo binary at $ECHO"

# --- 2. namespaces, removed on any exit -------------------------------------------------------

ID=kplab-$$
NODE=$ID-node
CLIENT=$ID-client
PODS=(pod-a pod-b pod-c)
WORK=$(mktemp -d /tmp/kp-lab.XXXXXX)
CREATED=()
PROXY_PID=

cleanup() {
    local status=$?
    set +e
    trap - EXIT INT TERM
    # Quietly: bash would report every background job it reaps here as "Killed".
    exec 3>&2 2>/dev/null
    if [ -n "$PROXY_PID" ] && kill -0 "$PROXY_PID" 2>/dev/null; then
        # Let it finish cleanly for a moment; its namespace goes away next anyway.
        kill -TERM "$PROXY_PID" 2>/dev/null
        for _ in $(seq 20); do
            kill -0 "$PROXY_PID" 2>/dev/null || break
            sleep 0.1
        done
    fi
    for ns in "${CREATED[@]}"; do
        ip netns pids "$ns" | xargs -r kill -KILL
        ip netns delete "$ns" 2>/dev/null
    done
    wait
    exec 2>&3 3>&-
    if [ "$status" -eq 0 ]; then
        rm -rf "$WORK"
    else
        echo "lab.sh: failed (exit $status); logs and manifests kept in $WORK" >&2
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Namespaces of earlier runs that were killed too hard to clean up (kill -9): their pid is gone.
for ns in $(ip netns list | awk '{print $1}' | grep '^kplab-[0-9]*-' || true); do
    pid=${ns#kplab-}
    pid=${pid%%-*}
    if [ ! -d "/proc/$pid" ]; then
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
        ip netns delete "$ns" 2>/dev/null || true
    fi
done

mkns() {
    CREATED+=("$1")
    ip netns add "$1"
    ip -n "$1" link set lo up
    # IPv6 addresses usable at once, without duplicate address detection.
    ip netns exec "$1" sysctl -q -w net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0
}

say "creating namespaces $NODE, $CLIENT and $ID-pod-{a,b,c}"
mkns "$NODE"
ip netns exec "$NODE" sysctl -q -w net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
mkns "$CLIENT"
ip netns exec "$CLIENT" sysctl -q -w net.ipv4.ip_forward=0 net.ipv6.conf.all.forwarding=0

# node eth0 <-> client eth0 on TEST-NET-1; the peer is created inside the client namespace.
ip -n "$NODE" link add eth0 type veth peer name eth0 netns "$CLIENT"
ip -n "$NODE" addr add 192.0.2.1/24 dev eth0
ip -n "$NODE" addr add 2001:db8::1/64 dev eth0 nodad
ip -n "$NODE" link set eth0 up
ip -n "$CLIENT" addr add 192.0.2.2/24 dev eth0
ip -n "$CLIENT" addr add 2001:db8::2/64 dev eth0 nodad
ip -n "$CLIENT" link set eth0 up
ip -n "$NODE" route add default via 192.0.2.2
ip -n "$NODE" -6 route add default via 2001:db8::2
for dest in 10.96.0.0/16 10.244.0.0/16 198.51.100.0/24 203.0.113.0/24; do
    ip -n "$CLIENT" route add "$dest" via 192.0.2.1
done
for dest in fd00:10:96::/112 fd00:10:244::/48 2001:db8:e::/64 2001:db8:b::/64; do
    ip -n "$CLIENT" -6 route add "$dest" via 2001:db8::1
done

# pod i: eth0 10.244.1.(10+i)/32, routed point-to-point through node's veth<i> (10.244.1.1).
pod_ns() { echo "$ID-$1"; }
pod_ip() { echo "10.244.1.$((10 + $1))"; }
for i in 0 1 2; do
    ns=$(pod_ns "${PODS[$i]}")
    ip4=$(pod_ip "$i")
    ip6=fd00:10:244:1::$((10 + i))
    mkns "$ns"
    ip -n "$ns" link add eth0 type veth peer name "veth$i" netns "$NODE"
    ip -n "$ns" addr add "$ip4/32" dev eth0
    ip -n "$ns" addr add "$ip6/128" dev eth0 nodad
    ip -n "$ns" link set eth0 up
    ip -n "$NODE" addr add 10.244.1.1/32 dev "veth$i"
    ip -n "$NODE" addr add fe80::1/64 dev "veth$i" nodad
    ip -n "$NODE" link set "veth$i" up
    ip -n "$ns" route add 10.244.1.1 dev eth0 scope link
    ip -n "$ns" route add default via 10.244.1.1
    ip -n "$ns" -6 route add default via fe80::1 dev eth0
    ip -n "$NODE" route add "$ip4/32" dev "veth$i"
    ip -n "$NODE" -6 route add "$ip6/128" dev "veth$i"
done

say "starting kp-echo in each pod (TCP 8080)"
for i in 0 1 2; do
    name=${PODS[$i]}
    ip netns exec "$(pod_ns "$name")" "$ECHO" serve --name "$name" --tcp 8080 >"$WORK/$name.log" 2>&1 &
done
for i in 0 1 2; do
    name=${PODS[$i]}
    for _ in $(seq 100); do
        grep -q "ready" "$WORK/$name.log" 2>/dev/null && break
        sleep 0.1
    done
    grep -q "ready" "$WORK/$name.log" || die "kp-echo in $name did not start: $(cat "$WORK/$name.log")"
    echo "    $name listening on $(pod_ip "$i"):8080"
done

say "checking the network without kube-proxy: client -> pod-a's IP directly"
direct=$(ip netns exec "$CLIENT" "$ECHO" request tcp "$(pod_ip 0)" 8080 --timeout-ms 2000)
echo "    $direct"
[ "$direct" = "pod-a 192.0.2.2" ] || die "the lab network is broken: expected 'pod-a 192.0.2.2'"

# --- 3. manifests and kube-proxy --------------------------------------------------------------

MANIFESTS=$WORK/manifests
mkdir -p "$MANIFESTS"

write_slice() { # write_slice FILE POD... : the EndpointSlice of demo/web with these pods
    local file=$1
    shift
    {
        cat <<'EOF'
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-lab01
  namespace: demo
  labels:
    kubernetes.io/service-name: web
    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
addressType: IPv4
ports:
- name: http
  protocol: TCP
  port: 8080
endpoints:
EOF
        local i
        for name in "$@"; do
            for i in 0 1 2; do
                [ "${PODS[$i]}" = "$name" ] || continue
                cat <<EOF
- addresses: ["$(pod_ip "$i")"]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: lab-node
  targetRef: {kind: Pod, namespace: demo, name: $name}
EOF
            done
        done
    } >"$file"
}

cat >"$MANIFESTS/service.yaml" <<'EOF'
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: demo
spec:
  type: NodePort
  selector: {app: web}
  clusterIP: 10.96.0.10
  clusterIPs: ["10.96.0.10"]
  ipFamilies: [IPv4]
  ports:
  - name: http
    protocol: TCP
    port: 80
    targetPort: 8080
    nodePort: 30080
EOF
cat >"$MANIFESTS/node.yaml" <<'EOF'
apiVersion: v1
kind: Node
metadata:
  name: lab-node
spec:
  podCIDR: 10.244.1.0/24
  podCIDRs: ["10.244.1.0/24"]
status:
  addresses:
  - {type: InternalIP, address: 192.0.2.1}
EOF
write_slice "$MANIFESTS/endpointslice.yaml" pod-a pod-b pod-c

say "starting kube-proxy in $NODE (manifests in $MANIFESTS, log in $WORK/kube-proxy.log)"
ip netns exec "$NODE" "$PROXY" --proxy-mode nftables --manifests "$MANIFESTS" \
    --hostname-override lab-node --cluster-cidr 10.244.0.0/16 \
    --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249 \
    --iptables-min-sync-period 100ms -v 2 >"$WORK/kube-proxy.log" 2>&1 &
PROXY_PID=$!

proxy_log_tail() {
    echo "    --- last lines of $WORK/kube-proxy.log ---"
    tail -n 30 "$WORK/kube-proxy.log" | sed 's/^/    /'
}

say "waiting for http://127.0.0.1:10256/healthz in the node namespace (up to 20 s)"
code=000
for _ in $(seq 40); do
    if ! kill -0 "$PROXY_PID" 2>/dev/null; then
        wait "$PROXY_PID" && proxy_status=0 || proxy_status=$?
        proxy_log_tail
        die "kube-proxy exited early (status $proxy_status)"
    fi
    code=$(ip netns exec "$NODE" curl -s -o /dev/null -w '%{http_code}' --max-time 1 \
        http://127.0.0.1:10256/healthz || true)
    [ "$code" = 200 ] && break
    sleep 0.5
done
if [ "$code" != 200 ]; then
    proxy_log_tail
    die "kube-proxy not healthy after 20 s (last /healthz status: $code)"
fi
echo "    healthy"

# --- 4. the demo ------------------------------------------------------------------------------

# requests NS HOST PORT: 30 TCP requests from NS; prints the spread and leaves the answering
# backends, one per line, in $WORK/backends (failures appear as timeout, refused, ...).
requests() {
    ip netns exec "$1" "$ECHO" request tcp "$2" "$3" --count 30 --timeout-ms 2000 >"$WORK/answers"
    awk '{print $1}' "$WORK/answers" >"$WORK/backends"
    echo "    answers by backend:"
    sort "$WORK/backends" | uniq -c | sed 's/^ */      /'
    echo "    source address the backends saw:"
    awk 'NF == 2 {print $2}' "$WORK/answers" | sort | uniq -c | sed 's/^ */      /'
}
seen() { grep -cx "$1" "$WORK/backends" || true; }
failed() { grep -cvx 'pod-[abc]' "$WORK/backends" || true; }

expect_all_three() {
    local name
    for name in "${PODS[@]}"; do
        [ "$(seen "$name")" -gt 0 ] || fail "$name never answered"
    done
    [ "$(failed)" -eq 0 ] || fail "$(failed) of 30 requests got no answer"
}

say "(a) 30 requests from pod-a to the ClusterIP http://10.96.0.10:80"
requests "$(pod_ns pod-a)" 10.96.0.10 80
expect_all_three

say "(b) 30 requests from the client to the NodePort http://192.0.2.1:30080"
requests "$CLIENT" 192.0.2.1 30080
expect_all_three

say "(c) the nftables table kube-proxy wrote (nft list table ip kube-proxy, first 40 lines)"
if ip netns exec "$NODE" nft list table ip kube-proxy >"$WORK/table.nft" 2>&1; then
    head -n 40 "$WORK/table.nft" | sed 's/^/    /'
    echo "    ... ($(wc -l <"$WORK/table.nft") lines in all)"
else
    sed 's/^/    /' "$WORK/table.nft"
    fail "no table ip kube-proxy in the node namespace"
fi

say "(d) removing pod-c from the EndpointSlice, waiting 2 s, then 30 more requests from pod-a"
# Written beside the directory and renamed into it, so kube-proxy never reads half a file.
write_slice "$WORK/endpointslice.yaml.new" pod-a pod-b
mv "$WORK/endpointslice.yaml.new" "$MANIFESTS/endpointslice.yaml"
sleep 2
requests "$(pod_ns pod-a)" 10.96.0.10 80
[ "$(seen pod-c)" -eq 0 ] || fail "pod-c still answered $(seen pod-c) times after its removal"
[ "$(seen pod-a)" -gt 0 ] || fail "pod-a never answered"
[ "$(seen pod-b)" -gt 0 ] || fail "pod-b never answered"
[ "$(failed)" -eq 0 ] || fail "$(failed) of 30 requests got no answer"

say "(e) sync metrics (http://127.0.0.1:10249/metrics in the node namespace)"
if ip netns exec "$NODE" curl -sf --max-time 2 http://127.0.0.1:10249/metrics >"$WORK/metrics"; then
    if grep '^kubeproxy_sync' "$WORK/metrics" >"$WORK/sync-metrics"; then
        head -n 12 "$WORK/sync-metrics" | sed 's/^/    /'
    else
        fail "no kubeproxy_sync* metrics"
    fi
else
    fail "the metrics endpoint did not answer"
fi

if [ "$FAILURES" -gt 0 ]; then
    proxy_log_tail
    say "$FAILURES expectation(s) failed"
    exit 1
fi
say "all expectations met; removing the namespaces"
