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
#
# perf samples the process and every child it starts (nft, iptables-restore), user and kernel
# code, with the cpu-clock event (this VM has no hardware counters). Change profiles start with
# sampling off; the measure example turns it on through perf's control fifo (KP_PERF_CTL) once
# its full sync is done, so they hold the changes alone. Each file holds the command,
# the share of samples per program and shared object, and the hottest symbols. Needs root (the
# measurements work in throwaway network namespaces), perf and heaptrack (installed with
# apt-get if missing). Run it on a quiet machine: a profile's shares hold on a busy one, its
# seconds do not.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=$ROOT/bench/profiles
BUILD=1
NAMES=()
ALL=(nftables-full-10k nftables-full-30k nftables-change-30k
    iptables-nft-full-10k iptables-legacy-full-10k
    iptables-nft-change-10k iptables-legacy-change-10k
    iptables-nft-memory-10k iptables-legacy-memory-10k)
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
if [ ${#missing[@]} -gt 0 ]; then
    echo "==> apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
fi

if [ $BUILD -eq 1 ]; then
    echo "==> building the measure examples (release)"
    (cd "$ROOT" && cargo build --release --locked -p kp-nftables --example measure \
        -p kp-iptables --example iptables-measure)
fi
NFT_MEASURE=$TARGET/release/examples/measure
IPT_MEASURE=$TARGET/release/examples/iptables-measure
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# header NAME COMMAND...: the first lines of a profile file.
header() {
    local name=$1
    shift
    {
        echo "# profile: $name"
        echo "# recorded: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -r), $(nproc) CPUs, commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo "# command: $*"
        echo "# reproduce: bash scripts/profile.sh $name"
    } >"$OUT/$name.txt"
}

# perf_profile NAME [--changes] ENV... -- COMMAND...: perf record of COMMAND and its children,
# summarised; with --changes, only from the moment COMMAND enables it through KP_PERF_CTL.
perf_profile() {
    local name=$1
    shift
    local control=() envs=()
    if [ "$1" = "--changes" ]; then
        shift
        mkfifo "$WORK/$name.ctl"
        control=(-D -1 --control "fifo:$WORK/$name.ctl")
        envs+=(KP_PERF_CTL="$WORK/$name.ctl")
    fi
    while [ "$1" != "--" ]; do
        envs+=("$1")
        shift
    done
    shift
    echo "==> $name: perf record -- ${envs[*]} $*"
    header "$name" "${envs[*]} $*"
    env "${envs[@]}" perf record -q -F 999 -g "${control[@]}" \
        -o "$WORK/$name.data" -- "$@" \
        >"$WORK/$name.out" 2>&1
    {
        echo "#"
        echo "# the measurement's own output:"
        sed 's/^/#   /' "$WORK/$name.out" | tail -n 25 || true
        echo
        echo "## share of samples by program"
        perf report -i "$WORK/$name.data" --stdio --no-children --sort comm \
            --percent-limit 1 -g none 2>/dev/null | grep -E '^ +[0-9]' || true
        echo
        echo "## share of samples by program and shared object"
        perf report -i "$WORK/$name.data" --stdio --no-children --sort comm,dso \
            --percent-limit 1 -g none 2>/dev/null | grep -E '^ +[0-9]' || true
        echo
        echo "## hottest symbols (self time)"
        perf report -i "$WORK/$name.data" --stdio --no-children --sort comm,dso,sym \
            --percent-limit 0.7 -g none 2>/dev/null | grep -E '^ +[0-9]' | sed -n '1,40p' || true
        echo
        echo "## hottest call chains (including callees), kernel entry points and our code"
        perf report -i "$WORK/$name.data" --stdio --children --sort sym \
            --percent-limit 5 -g none 2>/dev/null | grep -E '^ +[0-9]' \
            | grep -v '\[\.\] 0x' | sed -n '1,30p' || true
    } >>"$OUT/$name.txt"
    echo "    wrote bench/profiles/$name.txt"
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
    local file
    file=$(ls "$WORK/$name".*zst "$WORK/$name".*gz 2>/dev/null | head -n 1)
    {
        echo "#"
        echo "# the measurement's own output:"
        grep -v '^heaptrack' "$WORK/$name.out" | sed 's/^/#   /' | tail -n 25
        echo
        heaptrack_print -f "$file" --print-peaks 1 --print-allocators 0 --print-leaks 0 \
            --print-temporary 0 --print-histogram 0 --peak-limit 12 --sub-peak-limit 3 \
            2>/dev/null | sed -n '/MOST MEMORY CONSUMING/,$p' | sed -n '1,120p' || true
    } >>"$OUT/$name.txt"
    echo "    wrote bench/profiles/$name.txt"
}

for name in "${NAMES[@]}"; do
    case $name in
        nftables-full-10k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 -- "$NFT_MEASURE" 10000 10 ;;
        nftables-full-30k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 -- "$NFT_MEASURE" 30000 10 ;;
        nftables-change-30k)
            perf_profile "$name" --changes -- "$NFT_MEASURE" 30000 10 ;;
        iptables-nft-full-10k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 KP_MEASURE_VERIFY=0 -- \
                "$IPT_MEASURE" 10000 10 nft ;;
        iptables-legacy-full-10k)
            perf_profile "$name" KP_MEASURE_ONLY_FULL=1 KP_MEASURE_VERIFY=0 -- \
                "$IPT_MEASURE" 10000 10 legacy ;;
        iptables-nft-change-10k)
            perf_profile "$name" --changes KP_MEASURE_VERIFY=0 -- "$IPT_MEASURE" 10000 10 nft ;;
        iptables-legacy-change-10k)
            perf_profile "$name" --changes KP_MEASURE_VERIFY=0 -- \
                "$IPT_MEASURE" 10000 10 legacy ;;
        iptables-nft-memory-10k)
            heap_profile "$name" KP_MEASURE_VERIFY=1 -- "$IPT_MEASURE" 10000 10 nft ;;
        iptables-legacy-memory-10k)
            heap_profile "$name" KP_MEASURE_VERIFY=1 -- "$IPT_MEASURE" 10000 10 legacy ;;
    esac
done
echo "==> done: bench/profiles/ (bench report redraws BENCHMARKS.md with them)"
