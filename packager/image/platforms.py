"""Target platforms: the names each tool uses for one architecture (OCI, Debian, Python wheels)."""

from __future__ import annotations

import platform as host
from dataclasses import dataclass

from packager.errors import UserError

_GLIBC_MINOR = 36  # bookworm's glibc 2.36: the newest manylinux tag its python can load


@dataclass(frozen=True)
class Platform:
    oci: str  # linux/amd64
    debian_arch: str  # amd64
    machine: str  # x86_64, as in wheel tags and `uname -m`

    @property
    def architecture(self) -> str:
        return self.oci.split("/")[1]

    @property
    def variant(self) -> str | None:
        """The OCI platform variant: arm64 images say `v8`, as registries and runtimes expect."""
        return "v8" if self.architecture == "arm64" else None

    @property
    def foreign(self) -> bool:
        """True when this host cannot run the platform's binaries natively (debootstrap needs qemu)."""
        return host.machine() != self.machine

    @property
    def wheel_tags(self) -> list[str]:
        """Every manylinux tag the image's glibc accepts, newest first, as pip's `--platform` wants them."""
        tags = [f"manylinux_2_{minor}_{self.machine}" for minor in range(_GLIBC_MINOR, 16, -1)]
        return [*tags, f"manylinux2014_{self.machine}"]


PLATFORMS = {
    "linux/amd64": Platform("linux/amd64", "amd64", "x86_64"),
    "linux/arm64": Platform("linux/arm64", "arm64", "aarch64"),
}


def parse_platforms(names: tuple[str, ...] | list[str]) -> tuple[Platform, ...]:
    unknown = [name for name in names if name not in PLATFORMS]
    if unknown or not names:
        raise UserError(f"image platforms {list(names)}: use one or more of {sorted(PLATFORMS)}", exit_code=2)
    return tuple(PLATFORMS[name] for name in dict.fromkeys(names))
