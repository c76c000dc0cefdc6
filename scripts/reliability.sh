#!/usr/bin/env bash
# The reliability suite: fuzzing, injected faults, restarts under traffic and a churn soak,
# ending with one table of figures. Which modes each part covers:
#   fuzzing   every mode's renderer: nftables, iptables, userspace, ipvs, ebpf
#   faults    nftables, iptables (nft and legacy), userspace, ebpf (tampering only: it runs no
#             tool), ipvs (in the kp-vm qemu guest: this kernel has no IPVS)
#   restarts  kill -9: nftables, iptables (nft and legacy), ebpf, ipvs (qemu guest); userspace:
#             SIGTERM (a rolling restart; kill -9 ends the relays the dead process held)
#   churn     nftables
#
#   bash scripts/reliability.sh            # the long run (1M fuzzed objects, 10k-Service churn)
#   bash scripts/reliability.sh --short    # what CI runs (scripts/test.sh): minutes, not hours
#
# Needs root for everything but the fuzzer (network namespaces; nothing touches the machine's
# own namespace). Each part's output goes to target/reliability/PART.log; the table says where a
# part failed, and the script exits non-zero if any did.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

short=false
[ "${1:-}" = "--short" ] && short=true
if $short; then
    fuzz_objects=10000
    # Results of the short churn stay under target/, not in bench/results/.
    churn_args=(--services 1000 --rate 200 --seconds 20 --root target/reliability)
    profile=()
    bench=target/debug/bench
else
    fuzz_objects=1000000
    churn_args=(--services 10000 --rate 1000 --seconds 300)
    profile=(--release)
    bench=target/release/bench
fi
logs=target/reliability
mkdir -p "$logs"
say() { printf '==> %s\n' "$*"; }
rows=()
passed=0
failed=0
row() {
    rows+=("$(printf '%-30s %-8s %s' "$1" "$2" "$3")")
    if [ "$2" = ok ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
}

# Test binaries' closing lines: "test result: ok. N passed; M failed; ...".
passed_in() { grep -hoE 'test result: [a-zA-Z]+\. [0-9]+ passed' "$1" | awk '{s += $4} END {print s + 0}'; }
failed_in() { grep -hoE '[0-9]+ failed;' "$1" | awk '{s += $1} END {print s + 0}'; }

say "fuzzing $fuzz_objects generated objects through decoding, validation, conversion and every renderer (nftables, iptables, userspace, ipvs, ebpf)"
if cargo run -q "${profile[@]}" -p kp-fuzz -- --objects "$fuzz_objects" --seed 1 >"$logs/fuzz.log" 2>&1; then
    row "objects fuzzed" ok "$(grep '^final:' "$logs/fuzz.log" | tail -n 1 | sed 's/^final: //')"
else
    row "objects fuzzed" FAILED "see $logs/fuzz.log"
fi

if [ "$(id -u)" -ne 0 ]; then
    printf '%s\nNOT ROOT: faults, restarts and churn need network namespaces and are SKIPPED.\n%s\n' \
        "$(printf '!%.0s' $(seq 72))" "$(printf '!%.0s' $(seq 72))" >&2
else
    say "faults: failing kernel tools (nftables, iptables nft/legacy, userspace, ipvs in a qemu guest), tampering (those and ebpf), API server drops, 410s, stalls and outages, a vanishing manifest directory"
    cargo test -q --locked -p kube-proxy --test faults_e2e --test apiserver_e2e -- --include-ignored \
        >"$logs/faults.log" 2>&1
    cargo test -q --locked -p kp-source --test fake_apiserver >>"$logs/faults.log" 2>&1
    cargo test -q --locked -p kp-nftables --test failures -- --include-ignored >>"$logs/faults.log" 2>&1
    n=$(passed_in "$logs/faults.log"); f=$(failed_in "$logs/faults.log")
    if [ "$f" -eq 0 ] && [ "$n" -gt 0 ]; then
        row "faults injected and survived" ok "$n scenarios, 0 failed"
    else
        row "faults injected and survived" FAILED "$n passed, $f failed: see $logs/faults.log"
    fi

    say "restarts under traffic: kill -9 and a new kube-proxy (nftables, iptables nft/legacy, ebpf, ipvs in a qemu guest); userspace: SIGTERM and a new kube-proxy"
    cargo test --locked -p kube-proxy --test restart_e2e -- --include-ignored --test-threads=1 \
        --nocapture >"$logs/restarts.log" 2>&1
    n=$(grep -c 'none failed' "$logs/restarts.log"); f=$(failed_in "$logs/restarts.log")
    # Each run's line starts with its mode ("iptables" twice: nft and legacy backends).
    runs=$(grep 'none failed' "$logs/restarts.log" \
        | grep -oE '(nftables|iptables|ebpf|ipvs \(guest\)|userspace \(SIGTERM\)): ' | tr -d ':' | sed 's/ $//' \
        | paste -sd, - | sed 's/,/, /g')
    gap=$(grep -oE 'longest gap [0-9.]+[mµn]?s' "$logs/restarts.log" | awk '{print $3}' | sort -V | tail -n 1)
    if [ "$f" -eq 0 ] && [ "$n" -gt 0 ]; then
        row "restarts without a reset" ok "$n runs ($runs): 0 reset, 0 refused, longest gap ${gap:-?}"
    else
        row "restarts without a reset" FAILED "see $logs/restarts.log"
    fi

    say "churn: ${churn_args[*]} through the API source"
    cargo build -q --locked "${profile[@]}" -p kube-proxy -p kp-bench >"$logs/churn.log" 2>&1
    # The soak exits non-zero when the kernel differs from the plan at quiescence or the proxy
    # died; whether the rate was held is a figure (timings never gate CI).
    if "$bench" churn "${churn_args[@]}" >>"$logs/churn.log" 2>&1; then
        line=$(grep '^churn:' "$logs/churn.log" | tail -n 1 | sed 's/^churn: //')
        row "churn rate held" ok "$line"
    else
        row "churn rate held" FAILED "see $logs/churn.log"
    fi
fi

echo
printf '%-30s %-8s %s\n' "reliability suite ($($short && echo short || echo long))" result figures
printf '%s\n' "${rows[@]}"
echo
echo "reliability: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
