#!/usr/bin/env bash
# Profiles behind BENCHMARKS.md: where the time (or memory) goes for each benchmark target that
# is missed. Each profile is written to bench/profiles/<name>.txt; `bench report` embeds their
# summaries in BENCHMARKS.md.
#
#   bash scripts/profile.sh [--no-build] [NAME ...]
#
# NAME is one of the profiles below (default: all of them):
#   nftables-full-10k          perf of the first full sync, nftables mode, 10k Services x 10
#   nftables-full-30k          the same at 30k
#   nftables-change-30k        perf of the one-endpoint changes at 30k (not the full sync)
#   iptables-nft-full-10k      perf of the first full sync, iptables mode, iptables-nft backend
#   iptables-legacy-full-10k   the same, iptables-legacy backend
#   iptables-nft-change-10k    perf of the one-endpoint changes at 10k, iptables-nft backend
#   iptables-legacy-change-10k the same, iptables-legacy backend
#   iptables-nft-memory-10k    heaptrack of one full sync + changes, iptables-nft backend, 10k
#   iptables-legacy-memory-10k the same, iptables-legacy backend
#   nftables-datapath-vip-30k    perf of every CPU during bench's new-connection runs through the
#                                ClusterIP, nftables mode, 30k Services x 10 installed
#   nftables-datapath-direct-30k the same during the runs straight to the pod IP
#   userspace-datapath-vip-30k   the same in userspace mode (the relays are bench's own
#                                `kp-userspace` threads)
#   userspace-datapath-direct-30k the same during userspace mode's runs straight to the pod IP
#   userspace-bulk-vip-30k       perf of every CPU during bench's bulk transfers through the
#                                ClusterIP, userspace mode, 30k Services x 10 installed
#   userspace-bulk-direct-30k    the same during the bulk transfers straight to the pod IP
#   userspace-memory-10k         heaptrack of the kube-proxy binary in userspace mode on bench's
#                                10k x 10 manifests, in a namespace of its own, until a few
#                                seconds after its first full sync
#   nftables-memory-kube-apiserver-10k  the same in nftables mode reading a real API server
#                                loaded with the 10k x 10 cluster (bench kube-apiserver)
#   nftables-memory-kube-apiserver-30k  the same at 30k
#   nftables-startup-kube-apiserver-10k perf of the same binary, from its start to a few seconds
#                                after its first full sync (where the list and first sync go)
#   nftables-startup-kube-apiserver-30k the same at 30k
#   nftables-startup-yaml-10k    the same reading bench's 10k x 10 cluster as YAML manifests
#   nftables-full-100k           perf of bench's in-process first full sync (planning and
#                                applying), nftables mode, 100k Services x 10
#   nftables-change-100k         perf of bench's in-process one-endpoint changes at 100k (the
#                                partial syncs alone)
#   ebpf-full-10k                perf of bench's in-process first full sync, ebpf mode, 10k x 10
#                                (its hooks on a cgroup and its pins on a bpffs of bench's own)
#   ebpf-datapath-vip-30k        the data-path profile above in ebpf mode (the clients in
#                                bench's cgroup, under the socket hooks)
#   ebpf-datapath-direct-30k     the same during the runs straight to the pod IP
#   ebpf-memory-10k              heaptrack of the kube-proxy binary in ebpf mode on bench's 10k x 10
#                                manifests, its hooks on a cgroup and its pins on a bpffs this
#                                script makes (removed afterwards), never the machine's own
#
# perf samples the process and every child it starts (nft, iptables-restore), user and kernel
# code, with the cpu-clock event (this VM has no hardware counters). Change profiles start with
# sampling off; the measure example turns it on through perf's control fifo (KP_PERF_CTL) once
# its full sync is done, so they hold the changes alone. The data-path profiles run `bench
# --modes nftables --sizes 30000 --skip-proxy --repeats 1` into a scratch --root (the repository's
# BENCHMARKS.md and results are left alone) with KP_PERF_TARGET=vip or direct: bench turns perf's
# cpu-clock event on for the measured seconds of that target's two connect runs alone, waiting
# for perf's acknowledgement each time (KP_PERF_CTL=CTL,ACK, KP_PERF_EVENT=cpu-clock; switching
# the one event keeps perf tracking the processes started in between). They sample every CPU
# (perf record -a): a connection's work is split between the client (threads `kp-connect`), the
# server (`kp-accept`), softirqs that run in whichever task or idle loop the CPU was in, and
# ksoftirqd, and a sample of the idle loop is as telling as a busy one on two cores. They also
# hold the run's measured connect latencies (both targets, from its results), how busy the CPUs
# were (with a warning when other processes took over 5%), the netfilter functions' CPU time per
# connection and the call chains into the hottest symbols. Each file holds the command, the load
# average before it ran, the share of samples per program and shared object, and the hottest
# symbols. Needs root (the measurements work in throwaway network namespaces), perf and
# heaptrack (installed with apt-get if missing). Run it on a quiet machine: a profile's shares
# hold on a busy one, its seconds do not.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=$ROOT/bench/profiles
BUILD=1
NAMES=()
ALL=(nftables-full-10k nftables-full-30k nftables-change-30k
    iptables-nft-full-10k iptables-legacy-full-10k
    iptables-nft-change-10k iptables-legacy-change-10k
    iptables-nft-memory-10k iptables-legacy-memory-10k
    nftables-datapath-vip-30k nftables-datapath-direct-30k
    userspace-datapath-vip-30k userspace-datapath-direct-30k
    userspace-bulk-vip-30k userspace-bulk-direct-30k userspace-memory-10k
    nftables-memory-kube-apiserver-10k nftables-memory-kube-apiserver-30k
    nftables-startup-kube-apiserver-10k nftables-startup-kube-apiserver-30k
    nftables-startup-yaml-10k nftables-full-100k nftables-change-100k
    ebpf-full-10k ebpf-datapath-vip-30k ebpf-datapath-direct-30k ebpf-memory-10k)
for arg in "$@"; do
    case $arg in
        --no-build) BUILD=0 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        -*)
            echo "profile.sh: unknown option '$arg' (try --help)" >&2
            exit 2
            ;;
        *) NAMES+=("$arg") ;;
    esac
done
[ ${#NAMES[@]} -eq 0 ] && NAMES=("${ALL[@]}")
for n in "${NAMES[@]}"; do
    if ! printf '%s\n' "${ALL[@]}" | grep -qx -- "$n"; then
        echo "profile.sh: unknown profile '$n' (try --help)" >&2
        exit 2
    fi
done

if [ "$(id -u)" -ne 0 ]; then
    echo "profile.sh: needs root (it works in its own network namespaces)" >&2
    exit 1
fi
missing=()
command -v perf >/dev/null || missing+=(linux-perf)
command -v heaptrack >/dev/null || missing+=(heaptrack)
command -v nft >/dev/null || missing+=(nftables)
command -v iptables-legacy-restore >/dev/null || missing+=(iptables)
command -v conntrack >/dev/null || missing+=(conntrack)
command -v jq >/dev/null || missing+=(jq)
if [ ${#missing[@]} -gt 0 ]; then
    echo "==> apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
fi

if [ $BUILD -eq 1 ]; then
    echo "==> building the measure examples and bench (release)"
    (cd "$ROOT" && cargo build --release --locked -p kp-nftables --example measure \
        -p kp-iptables --example iptables-measure -p kp-bench --bin bench &&
        cargo build --release --locked -p kube-proxy &&
        CARGO_TARGET_DIR=$TARGET/system-allocator CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
            cargo build --release --locked -p kube-proxy --features system-allocator)
fi
NFT_MEASURE=$TARGET/release/examples/measure
IPT_MEASURE=$TARGET/release/examples/iptables-measure
BENCH=$TARGET/release/bench
PROXY=$TARGET/release/kube-proxy
# The binary's allocator is mimalloc, which heaptrack (it watches malloc) cannot see: memory
# profiles run a build with glibc's malloc, with line tables so that heaptrack can name the
# inlined functions an allocation comes from (without them most of the peak is one bare address).
PROXY_SYSTEM_ALLOCATOR=$TARGET/system-allocator/release/kube-proxy
# perf's sampling frequency (per CPU): one sample is 1/FREQ s of CPU time.
FREQ=999
mkdir -p "$OUT"
WORK=$(mktemp -d)
PROFILE_NS=
KUBE_FDS=()
KUBE_PIDS=()
trap 'drop_profile_ns; drop_ebpf_scratch; stop_kube_servers; rm -rf "$WORK"' EXIT

# header NAME COMMAND...: the first lines of a profile file.
header() {
    local name=$1
    shift
    {
        echo "# profile: $name"
        echo "# recorded: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -r), $(nproc) CPUs, commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo "# command: $*"
        echo "# reproduce: bash scripts/profile.sh $name"
        echo "# load average before (1, 5, 15 min): $(cut -d' ' -f1-3 /proc/loadavg)"
    } >"$OUT/$name.txt"
}

# datapath_numbers RESULTS: the connect figures of a bench results file, one line per target.
datapath_numbers() {
    jq -r '.runs[] | select(.datapath != null) | .mode as $m | .services as $n | .datapath
        | (["ClusterIP", .vip], ["direct", .direct], ["no rules", .unloaded])
          | select(.[1] != null)
          | "    \($m) \($n)  \(.[0] | . + " " * (9 - length))  \(.[1].latency_us.n) connections, \(.[1].per_second | round)/s, p50 \(.[1].latency_us.p50 * 10 | round / 10) µs, p90 \(.[1].latency_us.p90 * 10 | round / 10) µs, p99 \(.[1].latency_us.p99 * 10 | round / 10) µs, max \(.[1].latency_us.max | round) µs, \(.[1].errors) failed"' "$1"
    jq -r '.runs[] | select(.datapath != null) | .mode as $m | .services as $n | .datapath
        | "    \($m) \($n)  ClusterIP ÷ direct: p50 \(.latency_ratio_p50 * 100 | round / 100)×, p99 \(.latency_ratio_p99 * 100 | round / 100)×, connections/s \(.rate_ratio * 100 | round / 100)×"' "$1"
}

# The data path's own threads: the client's connecting threads, the server's accepting one, the
# bulk sender and receivers, the userspace mode's relays (bench runs them in its own process),
# the idle loop (softirqs run in it) and ksoftirqd. Everything else is another process on the
# machine (bench's own main threads only wait: another `bench` is someone else's run).
DATAPATH_COMMS=kp-connect,kp-accept,kp-bulk,kp-userspace,swapper$(for ((c = 0; c < $(nproc); c++)); do
    printf ',ksoftirqd/%s' $c
done)

# datapath_shares DATA CONNECTIONS: how busy the CPUs were and with what, and the data path's
# CPU time per measured connection (CONNECTIONS).
datapath_shares() {
    local data=$1 conns=$2
    perf report -i "$data" --stdio --no-children -n --sort comm,sym -g none --percent-limit 0 \
        2>/dev/null | awk -v comms="$DATAPATH_COMMS" -v conns="$conns" -v freq="$FREQ" '
            BEGIN { n = split(comms, c, ","); for (i = 1; i <= n; i++) ours[c[i]] = 1 }
            /^ +[0-9.]+%/ {
                total += $2
                if ($3 == "swapper" && $5 ~ /safe_halt|default_idle|poll_idle|intel_idle|acpi_idle|cpuidle/) idle += $2
                else if ($3 in ours) busy += $2
                else other += $2
            }
            END {
                if (total == 0) { print "    no samples"; exit }
                printf "    %d samples (%d Hz per CPU, every CPU), %d measured connections\n", total, freq, conns
                printf "    idle loop %.1f%%, the data path (%s) %.1f%%, other processes %.1f%%\n", 100 * idle / total, comms, 100 * busy / total, 100 * other / total
                if (other > total / 20) printf "    WARNING: other processes took %.0f%% of the CPUs while sampling: this run'"'"'s latencies are not a quiet machine'"'"'s\n", 100 * other / total
                if (conns > 0) printf "    per measured connection: %.1f µs of CPU in the data path'"'"'s threads, %.1f µs of both CPUs'"'"' time whoever used it\n", busy / freq / conns * 1e6, total / freq / conns * 1e6
            }'
}

# Functions whose time per connection the data-path profiles show: netfilter, conntrack, NAT;
# and the TCP/IP path around them, for scale.
NETFILTER_FUNCTIONS='^(nf_|nft_|__nf_|ipv4_conntrack|ipv4_confirm|hash_conntrack)'
# (__cgroup_bpf_run_filter_sock_addr: the socket hooks of ebpf mode, on connect and getpeername.)
PATH_FUNCTIONS='^(__sys_connect|tcp_v4_connect|__cgroup_bpf_run_filter_sock_addr|ip_output|veth_xmit|net_rx_action|__netif_receive_skb_one_core|ip_rcv|ip_forward|tcp_v4_rcv|inet_csk_accept|__x64_sys_close|do_syscall_64)$'

# per_connection DATA CONNECTIONS REGEX: CPU time (including callees) of the functions matching
# REGEX in the data path's threads (DATAPATH_COMMS), per measured connection.
per_connection() {
    local data=$1 conns=$2 regex=$3 total
    if [ "$conns" -eq 0 ]; then
        echo "    no measured connection (see the measurement's output)"
        return
    fi
    total=$(perf report -i "$data" --stdio --no-children -n --sort comm -g none \
        --percent-limit 0 2>/dev/null | awk '/^ +[0-9.]+%/ { s += $2 } END { print s + 0 }')
    # Sorted by program and symbol, summed here over the data path's programs (perf's own
    # --comms filter does not split the callee totals by program).
    perf report -i "$data" --stdio --children --sort comm,sym -g none --percent-limit 0 \
        2>/dev/null | awk -v comms="$DATAPATH_COMMS" -v re="$regex" '
            BEGIN { n = split(comms, c, ","); for (i = 1; i <= n; i++) ours[c[i]] = 1 }
            /^ +[0-9.]+%/ && ($3 in ours) && $5 ~ re { pct = $1; sub(/%/, "", pct); sum[$5] += pct }
            END { for (f in sum) print sum[f], f }' \
        | sort -rn | awk -v total="$total" -v conns="$conns" -v freq="$FREQ" '
            { printf "    %7.2f%%  %6.2f µs/connection  %s\n", $1, $1 / 100 * total / freq / conns * 1e6, $2 }' \
        | sed -n '1,30p'
}

# hot_chains DATA: how the data path's threads reach their hottest kernel symbols (self time): for
# each symbol over 1.5% of the samples, its most frequent call chains, as sample counts and the
# innermost frames.
hot_chains() {
    perf report -i "$1" --stdio --no-children --sort comm,sym --comms "$DATAPATH_COMMS" \
        -g folded,0.5,caller,count --percent-limit 1.5 2>/dev/null | awk '
            /^ +[0-9.]+%/ { print; chains = 0; next }
            /^[0-9]+ .*;/ && chains < 4 {
                n = split($2, f, ";"); from = n > 7 ? n - 7 : 1; s = f[from]
                for (i = from + 1; i <= n; i++) s = s ";" f[i]
                printf "        %5d  %s%s\n", $1, (from > 1 ? "…;" : ""), s
                chains++
            }' | sed -n '1,60p'
}

# perf_profile NAME [--controlled] [--datapath TARGET RESULTS] ENV... -- COMMAND...: perf record
# of COMMAND and its children, summarised. With --controlled, only from the moment COMMAND
# enables it through KP_PERF_CTL. With --datapath (bench's connect runs to TARGET, vip or
# direct): of every CPU, while bench's runs to TARGET have it on (control and acknowledgement
# fifos, the cpu-clock event alone switched so that perf keeps track of the processes started in
# between), and the file also holds the connect figures of the bench results file RESULTS and
# the CPU time per measured connection.
# perf_shares DATA: where a perf recording's samples fell: by program, by program and shared
# object, the hottest symbols, and the hottest call chains (including callees).
perf_shares() {
    local data=$1
    echo "## share of samples by program"
    perf report -i "$data" --stdio --no-children --sort comm \
        --percent-limit 1 -g none 2>/dev/null | grep -E '^ +[0-9]' || true
    echo
    echo "## share of samples by program and shared object"
    perf report -i "$data" --stdio --no-children --sort comm,dso \
        --percent-limit 1 -g none 2>/dev/null | grep -E '^ +[0-9]' || true
    echo
    echo "## hottest symbols (self time)"
    perf report -i "$data" --stdio --no-children --sort comm,dso,sym \
        --percent-limit 0.7 -g none 2>/dev/null | grep -E '^ +[0-9]' | sed -n '1,40p' || true
    echo
    echo "## hottest call chains (including callees), kernel entry points and our code"
    perf report -i "$data" --stdio --children --sort sym \
        --percent-limit 5 -g none 2>/dev/null | grep -E '^ +[0-9]' \
        | grep -v '\[\.\] 0x' | sed -n '1,30p' || true
}

perf_profile() {
    local name=$1
    shift
    local control=() envs=() scope=() target="" results=""
    while :; do
        case $1 in
            --controlled)
                mkfifo "$WORK/$name.ctl"
                control=(-D -1 --control "fifo:$WORK/$name.ctl")
                envs+=(KP_PERF_CTL="$WORK/$name.ctl")
                ;;
            --datapath)
                target=$2
                results=$3
                shift 2
                mkfifo "$WORK/$name.ctl" "$WORK/$name.ack"
                control=(-D -1 --control "fifo:$WORK/$name.ctl,$WORK/$name.ack")
                scope=(-a -e cpu-clock)
                envs+=(KP_PERF_CTL="$WORK/$name.ctl,$WORK/$name.ack" KP_PERF_EVENT=cpu-clock
                    KP_PERF_TARGET="$target")
                ;;
            *) break ;;
        esac
        shift
    done
    while [ "$1" != "--" ]; do
        envs+=("$1")
        shift
    done
    shift
    echo "==> $name: perf record ${scope[*]} -- ${envs[*]} $*"
    header "$name" "perf record -F $FREQ -g ${scope[*]} ${control[*]} -- ${envs[*]} $*"
    local status=0
    env "${envs[@]}" perf record -q -F "$FREQ" -g "${scope[@]}" "${control[@]}" \
        -o "$WORK/$name.data" -- "$@" \
        >"$WORK/$name.out" 2>&1 || status=$?
    {
        echo "#"
        echo "# the measurement's own output:"
        sed 's/^/#   /' "$WORK/$name.out" | tail -n 25 || true
        echo
        if [ -n "$results" ]; then
            if [ ! -f "$results" ] || jq -e '[.runs[].errors[]] | length > 0' "$results" >/dev/null; then
                # bench records a failed phase in the results and goes on: so does this.
                if [ $status -eq 0 ]; then status=1; fi
            fi
            echo "## connect latency measured in this run (both targets; only one was sampled)"
            [ -f "$results" ] && datapath_numbers "$results"
            echo
            local conns
            conns=$(jq --arg t "$target" \
                '[.runs[].datapath | select(. != null) | .[$t].latency_us.n] | add // 0' \
                "$results" 2>/dev/null || echo 0)
            echo "## where the CPUs were while sampling"
            datapath_shares "$WORK/$name.data" "$conns"
            echo
            echo "## netfilter, conntrack and NAT: CPU time per measured connection (including callees; the data path's threads)"
            per_connection "$WORK/$name.data" "$conns" "$NETFILTER_FUNCTIONS"
            echo
            echo "## the TCP/IP path around them, for scale: CPU time per measured connection (including callees)"
            per_connection "$WORK/$name.data" "$conns" "$PATH_FUNCTIONS"
            echo
            echo "## how the data path's threads reach their hottest kernel symbols (samples per call chain, innermost frames)"
            hot_chains "$WORK/$name.data"
            echo
        fi
        perf_shares "$WORK/$name.data"
    } >>"$OUT/$name.txt"
    if [ $status -ne 0 ]; then
        echo "profile.sh: $name: the measurement failed (exit $status); see bench/profiles/$name.txt" >&2
        exit 1
    fi
    echo "    wrote bench/profiles/$name.txt"
}

# datapath_profile NAME TARGET [MODE]: perf of every CPU during the connect runs of bench to
# TARGET (vip or direct) at 30k Services in MODE (default nftables), in a scratch root.
datapath_profile() {
    local name=$1 target=$2 mode=${3:-nftables}
    local root=$WORK/$name-root
    mkdir -p "$root"
    perf_profile "$name" --datapath "$target" "$root/bench/results/latest.json" -- \
        "$BENCH" --modes "$mode" --sizes 30000 --skip-proxy --repeats 1 --root "$root"
}

# sync_profile NAME TARGET SERVICES [MODE]: perf of bench's in-process dataplane of MODE (default
# nftables; bench's own allocator) at SERVICES x 10, while it samples TARGET: `full-sync` (the
# first full sync) or `changes` (the one-endpoint changes), in a scratch root.
sync_profile() {
    local name=$1 target=$2 services=$3 mode=${4:-nftables}
    local root=$WORK/$name-root
    mkdir -p "$root"
    perf_profile "$name" --controlled KP_PERF_TARGET="$target" -- "$BENCH" --modes "$mode" \
        --sizes "$services" --skip-proxy --skip-datapath --repeats 1 --changes 200 --root "$root"
}

# heap_profile NAME ENV... -- COMMAND...: heaptrack of COMMAND, summarised.
heap_profile() {
    local name=$1
    shift
    local envs=()
    while [ "$1" != "--" ]; do
        envs+=("$1")
        shift
    done
    shift
    echo "==> $name: heaptrack -- ${envs[*]} $*"
    header "$name" "${envs[*]} $*"
    (cd "$WORK" && env "${envs[@]}" heaptrack -o "$WORK/$name" "$@" >"$WORK/$name.out" 2>&1)
    heap_summary "$name"
}

# heap_summary NAME: appends the measurement's output ($WORK/NAME.out) and heaptrack's peak
# heap_by_our_code FILE: the heap at its peak (heaptrack's folded stacks, cost `peak`), each
# stack charged to its innermost three frames in a source file of this repository (file names
# that dependencies share, such as mod.rs, are left out), largest first.
heap_by_our_code() {
    local file=$1 folded=$WORK/heap.folded ours
    heaptrack_print -f "$file" --print-peaks 0 --print-allocators 0 --print-leaks 0 \
        --print-temporary 0 -F "$folded" --flamegraph-cost-type peak >/dev/null 2>&1 || return 0
    ours=$(cd "$ROOT" && find crates kube-proxy -name '*.rs' -printf '%f\n' | sort -u |
        grep -vxE 'mod.rs|lib.rs|main.rs|tests.rs|map.rs|iter.rs|node.rs|set.rs|list.rs|client.rs|service.rs|error.rs|types.rs|io.rs|sync.rs')
    awk -v ours="$ours" '
        BEGIN { n = split(ours, a, "\n"); for (i = 1; i <= n; i++) mine[a[i]] = 1 }
        {
            cost = $NF; line = $0; sub(/ [0-9]+$/, "", line)
            k = split(line, f, ";"); chain = ""; depth = 0
            for (i = k; i >= 1 && depth < 3; i--) {
                if (match(f[i], /\([^()]+\.rs\)$/)) {
                    file = substr(f[i], RSTART + 1, RLENGTH - 2)
                    if (file in mine) { chain = chain (depth ? " <- " : "") f[i]; depth++ }
                }
            }
            if (chain == "") chain = "(no frame of ours: the runtime, TLS, HTTP)"
            total += cost; by[chain] += cost
        }
        END {
            for (c in by) if (by[c] >= total / 1000)
                printf "    %7.2f MB %5.1f%%  %s\n", by[c] / 1e6, 100 * by[c] / total, c
        }' "$folded" | sort -rn | head -n 30
}

# summary of $WORK/NAME.* to the profile file.
heap_summary() {
    local name=$1 file
    file=$(ls "$WORK/$name".*zst "$WORK/$name".*gz 2>/dev/null | head -n 1 || true)
    {
        echo "#"
        echo "# the measurement's own output:"
        grep -v '^heaptrack' "$WORK/$name.out" | sed 's/^/#   /' | tail -n 25
        echo
        heaptrack_print -f "$file" --print-peaks 1 --print-allocators 0 --print-leaks 0 \
            --print-temporary 0 --peak-limit 12 --sub-peak-limit 3 \
            >"$WORK/$name.print" 2>/dev/null || true
        echo "## totals"
        grep -E '^(total runtime|calls to allocation|temporary memory|peak heap memory|peak RSS|total memory leaked)' \
            "$WORK/$name.print" | sed 's/^/    /' || true
        echo
        echo "## the heap peak by our code (innermost frame in this repository's sources, <- its"
        echo "## callers of ours; with line tables, inlined frames count)"
        heap_by_our_code "$file"
        echo
        # The section's title differs between heaptrack releases.
        sed -n '/MOST MEMORY CONSUMING\|PEAK MEMORY CONSUMERS/,$p' "$WORK/$name.print" | sed -n '1,160p'
    } >>"$OUT/$name.txt"
    echo "    wrote bench/profiles/$name.txt"
}

# kube_server SERVICES: a real API server loaded with bench's cluster of SERVICES x 10 and a
# namespace bridged to it (`bench kube-apiserver`), started once per size and held until this
# script exits (its input is a fifo held open on a descriptor of this shell; closing it at exit
# stops the server, which removes its namespace and state). WORK/kube-SERVICES.served holds
# `namespace=` and `kubeconfig=`.
kube_server() {
    local services=$1 waited=0
    local hold=$WORK/kube-$services.hold served=$WORK/kube-$services.served
    [ -p "$hold" ] && return 0
    mkfifo "$hold"
    echo "==> a real API server with $services Services x 10 (bench kube-apiserver)"
    "$BENCH" kube-apiserver --services "$services" <"$hold" >"$served" 2>"$WORK/kube-$services.log" &
    local server=$!
    # A descriptor per size, held open until exit.
    exec {fd}>"$hold"
    KUBE_FDS+=("$fd")
    KUBE_PIDS+=("$server")
    until grep -q '^kubeconfig=' "$served"; do
        if [ $waited -ge 1800 ] || ! kill -0 "$server" 2>/dev/null; then
            echo "profile.sh: the API server did not come up; see $WORK/kube-$services.log" >&2
            tail -n 20 "$WORK/kube-$services.log" >&2
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "    up and loaded after ${waited} s"
}

# Stops the real API servers (closing their input) and waits for them to clean up.
stop_kube_servers() {
    local fd pid
    for fd in "${KUBE_FDS[@]}"; do exec {fd}>&-; done
    for pid in "${KUBE_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    KUBE_FDS=()
    KUBE_PIDS=()
}

# binary_profile TOOL NAME MODE SERVICES [SOURCE]: TOOL (heaptrack, or perf: every process of
# the namespace's kube-proxy, user and kernel code) of the kube-proxy binary in MODE (bench's
# name) on bench's cluster of SERVICES x 10 endpoints, with the flags bench gives it, in a network
# namespace, from its start until SIGTERM a few seconds after it logs its first full sync (40 s
# for heaptrack, so that the first periodic check is in it). The peak is the binary's own, source
# and dataplane together. SOURCE is `manifests` (default: a
# JSON manifest directory, in a namespace of its own), `manifests-yaml` (the same as YAML, 100
# Services per file) or `kube-apiserver` (`bench kube-apiserver`: a real API server loaded with
# the cluster, read with --kubeconfig from the namespace bridged to it; the binary's "listed"
# lines tell the list's time apart from the API server's answer).
binary_profile() {
    local tool=$1 name=$2 mode=$3 services=$4 source=${5:-manifests}
    local dir=$WORK/$name-manifests log=$WORK/$name.out flags pid waited=0 args described
    local format=json wrapper
    [ "$source" = manifests-yaml ] && format=yaml
    mapfile -t flags < <("$BENCH" manifests --services "$services" --mode "$mode" --out "$dir" \
        --format "$format")
    local proxy=$PROXY
    if [ "$tool" = perf ]; then
        wrapper=(perf record -q -F "$FREQ" -g -o "$WORK/$name.data" --)
    else
        wrapper=(heaptrack -o "$WORK/$name")
        proxy=$PROXY_SYSTEM_ALLOCATOR
    fi
    if [ "$mode" = ebpf ]; then
        # Its hooks on a cgroup of this script's, bind-mounted where `ip netns exec` (which
        # remounts /sys) lets the binary see it, and its pins on a bpffs of its own.
        # (in place of the paths `bench manifests` names, bench's own scratch).
        ebpf_scratch "$name"
        local kept=() skip=0 f
        for f in "${flags[@]}"; do
            if [ $skip -eq 1 ]; then skip=0; continue; fi
            case $f in
                --bpf-cgroup-root | --bpf-pin-dir) skip=1 ;;
                --bpf-cgroup-root=* | --bpf-pin-dir=*) ;;
                *) kept+=("$f") ;;
            esac
        done
        flags=("${kept[@]}" --bpf-cgroup-root="$EBPF_SCRATCH/cgroup"
            --bpf-pin-dir="$EBPF_SCRATCH/bpf/pins")
    fi
    if [ "$source" = kube-apiserver ]; then
        kube_server "$services"
        PROFILE_NS=$(sed -n 's/^namespace=//p' "$WORK/kube-$services.served")
        # Each profile starts from a node without rules (an earlier one at this size left its).
        ip netns exec "$PROFILE_NS" nft flush ruleset
        args=(--kubeconfig "$(sed -n 's/^kubeconfig=//p' "$WORK/kube-$services.served")")
        described="--kubeconfig KUBECONFIG (bench kube-apiserver --services $services: a real API server, system:kube-proxy's kubeconfig, in the namespace bridged to it)"
    else
        PROFILE_NS=kpprof-$$-$name
        ip netns add "$PROFILE_NS"
        ip -n "$PROFILE_NS" link set lo up
        args=(--manifests "$dir")
        described="--manifests DIR (bench manifests --services $services --mode $mode --out DIR --format $format), in a namespace of its own"
    fi
    echo "==> $name: ${wrapper[*]} kube-proxy ${flags[*]} ${args[0]} ... (namespace $PROFILE_NS)"
    header "$name" "${wrapper[*]} kube-proxy ${flags[*]} $described"
    ip netns exec "$PROFILE_NS" env -u KUBECONFIG -u KUBERNETES_SERVICE_HOST HOME=/nonexistent \
        "${wrapper[@]}" "$proxy" "${flags[@]}" "${args[@]}" >"$log" 2>&1 &
    pid=$!
    until grep -q "programmed the kernel" "$log"; do
        if [ $waited -ge 600 ] || ! kill -0 $pid 2>/dev/null; then
            echo "profile.sh: $name: no full sync within ${waited} s; see $log" >&2
            tail -n 20 "$log" >&2
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    # A memory profile holds a periodic check too (30 s after the first sync): its read-back of
    # every element is the binary's peak.
    local hold=3
    [ "$tool" = heaptrack ] && hold=40
    echo "    first full sync logged after ~${waited} s; stopping in ${hold} s"
    sleep "$hold"
    for p in $(ip netns pids "$PROFILE_NS"); do
        if [ "$(cat "/proc/$p/comm" 2>/dev/null)" = kube-proxy ]; then
            kill -TERM "$p"
        fi
    done
    wait $pid || true
    if [ "$source" = kube-apiserver ]; then
        # The namespace is the server's (kept for the next profile at this size).
        PROFILE_NS=
    else
        drop_profile_ns
    fi
    drop_ebpf_scratch
    if [ "$tool" = perf ]; then
        {
            echo "#"
            echo "# the measurement's own output:"
            sed 's/^/#   /' "$log" | tail -n 25
            echo
            perf_shares "$WORK/$name.data"
        } >>"$OUT/$name.txt"
        echo "    wrote bench/profiles/$name.txt"
    else
        heap_summary "$name"
    fi
}

# ebpf_scratch NAME: a child cgroup of the cgroup v2 root (never the root itself), bind-mounted on
# $WORK/NAME-ebpf/cgroup, and a bpffs on $WORK/NAME-ebpf/bpf; EBPF_SCRATCH names the directory.
# drop_ebpf_scratch removes both (the pins first, which detaches the programs).
ebpf_scratch() {
    local root
    root=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
    [ -n "$root" ] || { echo "profile.sh: no cgroup v2 hierarchy is mounted" >&2; exit 1; }
    EBPF_CGROUP=$root/kpprof-$$-$1
    EBPF_SCRATCH=$WORK/$1-ebpf
    mkdir "$EBPF_CGROUP"
    mkdir -p "$EBPF_SCRATCH/cgroup" "$EBPF_SCRATCH/bpf"
    mount --bind "$EBPF_CGROUP" "$EBPF_SCRATCH/cgroup"
    mount -t bpf bpf "$EBPF_SCRATCH/bpf"
}

drop_ebpf_scratch() {
    [ -n "${EBPF_SCRATCH:-}" ] || return 0
    rm -rf "$EBPF_SCRATCH/bpf/pins" 2>/dev/null || true
    umount "$EBPF_SCRATCH/bpf" "$EBPF_SCRATCH/cgroup" 2>/dev/null || true
    xargs -r kill -KILL <"$EBPF_CGROUP/cgroup.procs" 2>/dev/null || true
    sleep 0.2
    rmdir "$EBPF_CGROUP" 2>/dev/null || true
    rm -rf "$EBPF_SCRATCH"
    EBPF_SCRATCH=
}

# Deletes the namespace a profile made, with anything still running in it.
drop_profile_ns() {
    [ -n "${PROFILE_NS:-}" ] || return 0
    ip netns pids "$PROFILE_NS" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns del "$PROFILE_NS" 2>/dev/null || true
    PROFILE_NS=
}

for name in "${NAMES[@]}"; do
    case $name in
        nftables-full-10k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 -- "$NFT_MEASURE" 10000 10 ;;
        nftables-full-30k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 -- "$NFT_MEASURE" 30000 10 ;;
        nftables-change-30k)
            perf_profile "$name" --controlled -- "$NFT_MEASURE" 30000 10 ;;
        iptables-nft-full-10k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 KP_MEASURE_VERIFY=0 -- \
                "$IPT_MEASURE" 10000 10 nft ;;
        iptables-legacy-full-10k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 KP_MEASURE_VERIFY=0 -- \
                "$IPT_MEASURE" 10000 10 legacy ;;
        iptables-nft-change-10k)
            perf_profile "$name" --controlled KP_MEASURE_VERIFY=0 -- "$IPT_MEASURE" 10000 10 nft ;;
        iptables-legacy-change-10k)
            perf_profile "$name" --controlled KP_MEASURE_VERIFY=0 -- \
                "$IPT_MEASURE" 10000 10 legacy ;;
        iptables-nft-memory-10k)
            heap_profile "$name" KP_MEASURE_VERIFY=1 -- "$IPT_MEASURE" 10000 10 nft ;;
        iptables-legacy-memory-10k)
            heap_profile "$name" KP_MEASURE_VERIFY=1 -- "$IPT_MEASURE" 10000 10 legacy ;;
        nftables-datapath-vip-30k) datapath_profile "$name" vip ;;
        nftables-datapath-direct-30k) datapath_profile "$name" direct ;;
        userspace-datapath-vip-30k) datapath_profile "$name" vip userspace ;;
        userspace-datapath-direct-30k) datapath_profile "$name" direct userspace ;;
        userspace-bulk-vip-30k) datapath_profile "$name" vip-bulk userspace ;;
        userspace-bulk-direct-30k) datapath_profile "$name" direct-bulk userspace ;;
        userspace-memory-10k) binary_profile heaptrack "$name" userspace 10000 ;;
        nftables-memory-kube-apiserver-10k)
            binary_profile heaptrack "$name" nftables 10000 kube-apiserver ;;
        nftables-memory-kube-apiserver-30k)
            binary_profile heaptrack "$name" nftables 30000 kube-apiserver ;;
        nftables-startup-kube-apiserver-10k)
            binary_profile perf "$name" nftables 10000 kube-apiserver ;;
        nftables-startup-kube-apiserver-30k)
            binary_profile perf "$name" nftables 30000 kube-apiserver ;;
        nftables-startup-yaml-10k)
            binary_profile perf "$name" nftables 10000 manifests-yaml ;;
        nftables-full-100k) sync_profile "$name" full-sync 100000 ;;
        nftables-change-100k) sync_profile "$name" changes 100000 ;;
        ebpf-full-10k) sync_profile "$name" full-sync 10000 ebpf ;;
        ebpf-datapath-vip-30k) datapath_profile "$name" vip ebpf ;;
        ebpf-datapath-direct-30k) datapath_profile "$name" direct ebpf ;;
        ebpf-memory-10k) binary_profile heaptrack "$name" ebpf 10000 ;;
    esac
done
echo "==> done: bench/profiles/ (bench report redraws BENCHMARKS.md with them)"
