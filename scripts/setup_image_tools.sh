#!/usr/bin/env bash
# Install what image builds and their tests need, idempotently: a registry (Debian's docker-registry),
# debootstrap for the offline base rootfs, qemu-user-static for the arm64 variant, podman + runc and
# umoci to run images without a Docker daemon, iproute2 for the edge tests' network namespaces. (The
# `oras` client comes with the packager extra.)
# Needs root for apt-get (CI and these machines run as root). Re-running it is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/apt.sh

PACKAGES=(docker-registry debootstrap podman runc umoci qemu-user-static binfmt-support uidmap iproute2)

apt_install_missing "" "${PACKAGES[@]}"
# The packaged registry starts a system-wide instance listening on all interfaces; tests run their own.
if command -v systemctl >/dev/null && systemctl is-active --quiet docker-registry 2>/dev/null; then
    systemctl stop docker-registry || true
fi

# arm64 images are built by running arm64 binaries through qemu: register it with binfmt_misc.
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || true
fi
if [ -e /proc/sys/fs/binfmt_misc/register ] && [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64 || true
fi
