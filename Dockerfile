# The kube-proxy-rs image: /usr/local/bin/kube-proxy (as deploy/daemonset.yaml and upstream's
# image have it) on Debian bookworm, with the tools the modes run: nft (nftables), iptables and
# ip6tables with both backends (iptables, ipvs, --cleanup), ipset (ipvs), ip (iproute2) and
# conntrack.
#
# The default build compiles the binary in an official Rust image, then copies it into a slim
# Debian runtime:
#
#   podman build -t kube-proxy-rs:latest .          # or: docker build -t kube-proxy-rs:latest .
#
# Around a kube-proxy binary already built on a Debian bookworm (glibc 2.36) host, skipping the
# compile: a context directory holding just that binary, named kube-proxy, and BINARY=prebuilt.
# scripts/image.sh does this (and makes the runtime base from Debian's packages when no
# registry can be reached):
#
#   podman build --build-arg BINARY=prebuilt -f Dockerfile -t kube-proxy-rs:latest DIR
#
# Build arguments:
#   RUST_IMAGE     the build stage's image (Rust >= 1.89, the workspace's rust-version; bookworm,
#                  so the binary links against the runtime's glibc)
#   RUNTIME_IMAGE  the runtime's base: Debian bookworm or a derivative with apt
#   BINARY         where the binary comes from: `build` (compiled here) or `prebuilt`

ARG RUST_IMAGE=docker.io/library/rust:1.89-bookworm
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim
ARG BINARY=build

# --- build: cargo build --release -p kube-proxy ---------------------------------------------
FROM ${RUST_IMAGE} AS build
# The ebpf mode's programs (crates/kp-ebpf/bpf) are compiled by kp-ebpf's build script with
# clang -target bpf, against libbpf's headers.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends clang libbpf-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kube-proxy \
    && install -D -m 0755 target/release/kube-proxy /out/kube-proxy

# --- prebuilt: the binary named kube-proxy at the root of the build context ------------------
FROM scratch AS prebuilt
COPY kube-proxy /out/kube-proxy

# --- the stage chosen by BINARY ---------------------------------------------------------------
FROM ${BINARY} AS binary

# --- runtime ----------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        nftables iptables ipset conntrack iproute2 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=binary /out/kube-proxy /usr/local/bin/kube-proxy
ENTRYPOINT ["/usr/local/bin/kube-proxy"]
