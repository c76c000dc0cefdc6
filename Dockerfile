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
# The `prebuilt` target skips the compile: it copies a kube-proxy binary already built on a
# Debian bookworm (glibc 2.36) host from bin/kube-proxy in the build context (a directory
# holding just that). scripts/image.sh builds it that way, on a runtime base it makes from
# Debian's packages when no registry can be reached:
#
#   podman build --target prebuilt -f Dockerfile -t kube-proxy-rs:latest DIR
#
# Build arguments:
#   RUST_IMAGE     the build stage's image (Rust >= 1.89, the workspace's rust-version; bookworm,
#                  so the binary links against the runtime's glibc)
#   RUNTIME_IMAGE  the runtime's base: Debian bookworm or a derivative with apt

ARG RUST_IMAGE=docker.io/library/rust:1.89-bookworm
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim

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

# --- runtime: the tools, without the binary ---------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        nftables iptables ipset conntrack iproute2 \
    && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["/usr/local/bin/kube-proxy"]

# --- prebuilt (--target prebuilt): the runtime with the context's bin/kube-proxy -----------
FROM runtime AS prebuilt
COPY bin/kube-proxy /usr/local/bin/kube-proxy

# --- the default: the runtime with the binary compiled in the build stage ---------------------
FROM runtime AS image
COPY --from=build /out/kube-proxy /usr/local/bin/kube-proxy
