#!/usr/bin/env bash
# Builds the kube-proxy-rs container image with Debian's podman, where no container registry can
# be reached: the runtime base is made locally from Debian's packages, and the binary is one
# built on this machine (the Dockerfile's `prebuilt` path; the default path, for machines that
# can pull images, is a plain `podman build .`, which compiles the binary in the Rust image).
#
#   bash scripts/image.sh [--binary PATH] [--tag TAG]
#
# Needs root on Debian bookworm (or a host whose glibc is no newer than bookworm's 2.36: the
# binary runs in the image against bookworm's libraries). Steps, each printed as "==> ...":
#   1. installs podman, mmdebstrap and runc with apt-get if any is missing;
#   2. unless podman already holds it, makes the base image $BASE: a minimal bookworm
#      (mmdebstrap --variant=minbase, from deb.debian.org or $DEBIAN_MIRROR) imported into
#      podman, with no documentation;
#   3. builds the Dockerfile's target `prebuilt` with RUNTIME_IMAGE=$BASE around PATH (default:
#      the release build in $CARGO_TARGET_DIR or target/, built first if it is missing), and
#      tags it TAG (default kube-proxy-rs:latest, the image deploy/daemonset.yaml runs).
# Its RUN step runs chrooted (--isolation chroot: no OCI runtime, no cgroups) and its apt-get uses
# the host's network (--network host), so podman sets up no bridge and no firewall rules on this
# machine. The image's name is printed last, on its own line. Also installs runc, which the
# smoke test (kube-proxy/tests/image_smoke.rs) runs containers with.
#
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian; its -security suite is
# taken from deb.debian.org/debian-security), BASE (default localhost/kube-proxy-rs-base:bookworm).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BINARY=
TAG=kube-proxy-rs:latest
BASE=${BASE:-localhost/kube-proxy-rs-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case $1 in
        --binary) BINARY=${2:?--binary needs a path}; shift 2 ;;
        --tag) TAG=${2:?--tag needs a name}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "image.sh: unknown argument '$1' (try --help)" >&2; exit 64 ;;
    esac
done

say() { printf '==> %s\n' "$*" >&2; }
die() {
    printf 'image.sh: %s\n' "$*" >&2
    exit 1
}

[ "$(id -u)" -eq 0 ] || die "needs root (podman's storage and the base image): sudo bash scripts/image.sh"

# --- 1. tools ---------------------------------------------------------------------------------
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
# Containers are run with runc (crun refuses hosts with hybrid cgroups; see the README).
command -v runc >/dev/null || missing+=(runc)
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "missing ${missing[*]}, and no apt-get to install them"
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The binary, checked before the slow steps.
if [ -z "$BINARY" ]; then
    BINARY=$TARGET/release/kube-proxy
    if [ ! -x "$BINARY" ]; then
        command -v cargo >/dev/null || die "no binary at $BINARY and no cargo to build it"
        say "building kube-proxy (cargo build --release -p kube-proxy)"
        (cd "$ROOT" && cargo build --release --locked -p kube-proxy)
    fi
fi
[ -x "$BINARY" ] || die "no kube-proxy binary at $BINARY"

# --- 2. the base image ------------------------------------------------------------------------
if podman image exists "$BASE"; then
    say "base image $BASE: already in podman's storage"
else
    say "making the base image $BASE (mmdebstrap --variant=minbase bookworm from $MIRROR)"
    # Streamed from mmdebstrap into podman: no tarball on disk. The mirrors are given on the
    # command line (mmdebstrap would otherwise read them from a non-terminal stdin). Tagged only
    # once the whole stream was imported, so a failed run leaves no half base behind its name.
    if ! id=$(mmdebstrap --quiet --variant=minbase --mode=root \
        --aptopt='Acquire::Languages "none"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-include=/usr/share/locale/locale.alias' \
        bookworm - \
        "deb $MIRROR bookworm main" \
        "deb $MIRROR bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main" </dev/null |
        podman import --quiet --change 'CMD ["/bin/bash"]' -); then
        [ -z "${id:-}" ] || podman rmi "$id" >/dev/null 2>&1 || true
        die "making the base image failed (mmdebstrap's or podman import's error is above)"
    fi
    podman tag "$id" "$BASE"
fi

# --- 3. the image -----------------------------------------------------------------------------
# A context holding only the binary, where the `prebuilt` target copies it from.
CONTEXT=$(mktemp -d /tmp/kp-image.XXXXXX)
trap 'rm -rf "$CONTEXT"' EXIT
mkdir "$CONTEXT/bin"
cp "$BINARY" "$CONTEXT/bin/kube-proxy"
say "building $TAG around $BINARY (runtime base $BASE)"
podman build --quiet --isolation chroot --network host --pull=never \
    --build-arg RUNTIME_IMAGE="$BASE" --target prebuilt \
    --file "$ROOT/Dockerfile" --tag "$TAG" "$CONTEXT" >/dev/null
podman image exists "$TAG" || die "podman build did not tag $TAG"
echo "$TAG"
