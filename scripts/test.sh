#!/usr/bin/env bash
# The whole test suite: the README's second command, and what CI (.ci/run) runs.
#
#   bash scripts/test.sh
#
# Installs the system packages the tests use (apt-get, only what is missing), checks that the
# pure crates stay pure, checks formatting, and runs every test. Tests that program the kernel
# are marked `#[ignore = "needs root"]` and run here with --include-ignored; each creates its own
# uniquely named network namespaces and deletes them, also when it fails. Without root they are
# skipped with a loud message.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf '==> %s\n' "$*"; }

need=()
for pair in nft:nftables ip:iproute2 curl:curl conntrack:conntrack iptables:iptables cc:build-essential; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
# The benchmark harness's plots (checked by its smoke test) use this font.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        say "installing ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        say "missing ${need[*]} and not root: kernel tests will be skipped"
    fi
fi

say "checking that the pure core and planners use no tokio, kube or process spawning"
for crate in kp-core kp-nftables-plan kp-iptables-plan kp-flows; do
    if cargo tree -q -p "$crate" -e normal --prefix none | grep -E '^(tokio|kube|kube-client|hyper|axum) ' >/dev/null; then
        echo "error: $crate depends on an I/O crate:" >&2
        cargo tree -q -p "$crate" -e normal --prefix none | grep -E '^(tokio|kube|kube-client|hyper|axum) ' >&2
        exit 1
    fi
    if grep -rn 'std::process' "crates/$crate/src" >/dev/null; then
        echo "error: $crate uses std::process" >&2
        exit 1
    fi
done

say "checking formatting"
cargo fmt --all -- --check

say "building"
cargo build --workspace --all-targets --locked

if [ "$(id -u)" -eq 0 ]; then
    say "running every test, including the ones that need root (network namespaces)"
    cargo test --workspace --locked -- --include-ignored
else
    banner=$(printf '!%.0s' $(seq 72))
    printf '%s\nNOT ROOT: kernel tests (network namespaces) are SKIPPED.\nRun as root for the full suite.\n%s\n' "$banner" "$banner" >&2
    cargo test --workspace --locked
fi
