#!/usr/bin/env bash
# Build CRIU for the `local` target's process snapshots, once per machine: `criu` >= 4.1 on PATH.
#
# Debian 12 ships CRIU 3.17, which cannot read this kernel's vDSO layout ("Unexpected rt vDSO area
# bounds"), and CRIU 4.1.1 fails to dump a listening TCP socket on recent kernels, which answer
# EOPNOTSUPP for SO_PASSCRED on non-unix sockets. So: Debian's CRIU 4.1.1 source (pinned by hash), one
# patch (scripts/criu/so-passcred.patch), built with Debian 12's libraries into /usr/local/bin/criu.
# Needs root (apt-get; CRIU itself runs as root). Re-running it is a no-op. Without it, deploys start
# the server normally and say why they did not use a process snapshot.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/apt.sh

VERSION=4.1.1
SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
URL="http://deb.debian.org/debian/pool/main/c/criu/criu_${VERSION}.orig.tar.xz"
TARGET=/usr/local/bin/criu
PATCH="$PWD/scripts/criu/so-passcred.patch"
STAMP="/usr/local/share/onnxfn/criu-${VERSION}-$(sha256sum "$PATCH" | cut -c1-12)"

if [ -x "$TARGET" ] && [ -e "$STAMP" ]; then
    exit 0
fi
BUILD_DEPS=(build-essential pkg-config libbsd-dev libcap-dev libnet1-dev libnl-3-dev libprotobuf-c-dev
            libprotobuf-dev protobuf-c-compiler protobuf-compiler uuid-dev libgnutls28-dev python3-protobuf
            curl xz-utils)
apt_install_missing "to build CRIU" "${BUILD_DEPS[@]}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building CRIU ${VERSION} (about 2 minutes on 2 cores)" >&2
curl -fsSL "$URL" -o "$work/criu.tar.xz"
echo "$SHA256  $work/criu.tar.xz" | sha256sum -c --quiet
tar -xf "$work/criu.tar.xz" -C "$work"
cd "$work/criu-${VERSION}"
patch -p1 --quiet < "$PATCH"
make -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
install -m 0755 criu/criu "$TARGET"
mkdir -p "$(dirname "$STAMP")"
touch "$STAMP"
"$TARGET" check >/dev/null 2>&1 || echo "warning: 'criu check' reports missing kernel features; process snapshots may not work here" >&2
