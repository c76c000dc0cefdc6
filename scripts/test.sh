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
# The real API server (../shared/k8s/apiserver.sh; kp_test::kube_apiserver, the benchmark's
# smoke test) needs etcd, openssl and xz; a proxy in a namespace reaches it through socat.
for pair in nft:nftables ip:iproute2 curl:curl conntrack:conntrack iptables:iptables cc:build-essential clang:clang etcd:etcd-server socat:socat openssl:openssl xz:xz-utils; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
# The container image's smoke test (kube-proxy/tests/image_smoke.rs, through scripts/image.sh):
# podman builds the Dockerfile on a base mmdebstrap makes from Debian's packages; containers run
# with runc.
for pair in podman:podman mmdebstrap:mmdebstrap runc:runc; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
# The eBPF programs (crates/kp-ebpf/bpf) include libbpf's bpf_helpers.h.
[ -f /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
# The benchmark harness's plots (checked by its smoke test) use this font.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
# IPVS is tested in a qemu guest (crates/kp-vm): Debian's kernel, whose modules include ip_vs
# (this machine's kernel has no IPVS), a static busybox for the guest's init, modinfo/modprobe,
# ipvsadm to cross-check our listing, and ipset (the mode loads its sets with `ipset restore`).
# Installed with their recommends (qemu's ROMs), as tried here.
vm=()
for pair in qemu-system-x86_64:qemu-system-x86 busybox:busybox-static modinfo:kmod ipvsadm:ipvsadm ipset:ipset; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || vm+=("${pair#*:}")
done
# The guest also runs ebpf mode (its pairs with ipvs in the switching test), whose tc path
# needs Linux 6.8 or later (BPF_FIB_LOOKUP_SRC): bookworm's own kernel is 6.1, so on bookworm
# the kernel comes from bookworm-backports (kp-vm boots the newest kernel with IPVS).
guest_kernel=
for m in /lib/modules/*/kernel/net/netfilter/ipvs/ip_vs.ko*; do
    v=${m#/lib/modules/}
    v=${v%%/*}
    if [ -e "/boot/vmlinuz-$v" ] && printf '%s\n' 6.8 "$v" | sort -V -C; then
        guest_kernel=$v
    fi
done
kernel=()
kernel_suite=
if [ -z "$guest_kernel" ]; then
    kernel=(linux-image-amd64)
    if grep -q '^VERSION_CODENAME=bookworm$' /etc/os-release 2>/dev/null; then
        kernel_suite=bookworm-backports
    fi
fi
if [ ${#need[@]} -gt 0 ] || [ ${#vm[@]} -gt 0 ] || [ ${#kernel[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        say "installing ${need[*]} ${vm[*]} ${kernel[*]}${kernel_suite:+ (from $kernel_suite)}"
        export DEBIAN_FRONTEND=noninteractive
        if [ -n "$kernel_suite" ] && ! grep -rqs "$kernel_suite" /etc/apt/sources.list /etc/apt/sources.list.d; then
            printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
                "$kernel_suite" >/etc/apt/sources.list.d/kube-proxy-rs-backports.sources
        fi
        apt-get update -qq
        if [ ${#need[@]} -gt 0 ]; then
            apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
        fi
        if [ ${#vm[@]} -gt 0 ]; then
            apt-get install -y -qq "${vm[@]}" >/dev/null
        fi
        if [ ${#kernel[@]} -gt 0 ]; then
            apt-get install -y -qq ${kernel_suite:+-t "$kernel_suite"} "${kernel[@]}" >/dev/null
        fi
    else
        say "missing ${need[*]} ${vm[*]} ${kernel[*]} and not root: kernel tests will be skipped"
    fi
fi

say "checking that the pure core and planners do no I/O (no tokio, kube, processes, sockets or files)"
for crate in kp-core kp-nftables-plan kp-iptables-plan kp-userspace-plan kp-ipvs-plan kp-ebpf-plan kp-flows; do
    deps=$(cargo tree -q -p "$crate" -e normal --prefix none)
    if grep -E '^(tokio|kube|kube-client|hyper|axum|nix|netlink-sys|socket2|mio) ' <<<"$deps" >&2; then
        echo "error: $crate depends on the I/O crates above" >&2
        exit 1
    fi
    # kp-netlink's framing is pure; its socket layer is a feature the pure crates must not pull.
    if cargo tree -q -p "$crate" -e normal,features --prefix none | grep -F 'kp-netlink feature "socket"' >&2; then
        echo "error: $crate pulls kp-netlink's socket layer" >&2
        exit 1
    fi
    if grep -rnE 'std::process|std::fs|std::os::|std::net::(TcpStream|TcpListener|UdpSocket)|std::env::(var|set_var|current_dir)|File::(open|create)' "crates/$crate/src" >&2; then
        echo "error: $crate does I/O (processes, files, sockets or the environment) at the lines above" >&2
        exit 1
    fi
done

# A one-shot build: incremental compilation state would only take disk (gigabytes) and time.
export CARGO_INCREMENTAL=0

say "checking formatting"
cargo fmt --all -- --check

say "building"
cargo build --workspace --all-targets --locked

if [ "$(id -u)" -eq 0 ]; then
    say "running every test, including the ones that need root (network namespaces)"
    cargo test --workspace --locked -- --include-ignored
    say "the reliability suite, short form (its table ends the output)"
    bash scripts/reliability.sh --short
else
    banner=$(printf '!%.0s' $(seq 72))
    printf '%s\nNOT ROOT: kernel tests (network namespaces) are SKIPPED.\nRun as root for the full suite.\n%s\n' "$banner" "$banner" >&2
    cargo test --workspace --locked
fi
