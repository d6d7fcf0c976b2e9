"""Run an image without a Docker daemon: podman with runc, configured by a `containers.conf` of our own.

crun fails on these hosts' hybrid cgroups and podman's default ulimits exceed what the host grants,
so the configuration selects runc and lowers `default_ulimits`. Storage can be private (`root`), which
keeps test images out of the machine's podman store.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from packager.errors import UserError

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=8192:8192"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


@dataclass(frozen=True)
class Podman:
    """podman with our configuration in `state_dir`, and storage there too when `private_storage`."""

    state_dir: Path
    private_storage: bool = False

    def command(self, *args: str) -> list[str]:
        binary = shutil.which("podman")
        if binary is None:
            raise UserError(
                "podman is not installed: run scripts/setup_image_tools.sh (or apt-get install podman runc)"
            )
        storage = (
            ["--root", str(self.state_dir / "storage"), "--runroot", str(self.state_dir / "run")]
            if self.private_storage
            else []
        )
        return [binary, *storage, "--runtime", "runc", *args]

    def environment(self) -> dict[str, str]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        conf = self.state_dir / "containers.conf"
        if not conf.is_file() or conf.read_text() != CONTAINERS_CONF:
            conf.write_text(CONTAINERS_CONF)
        return {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Run a podman command to completion; a failure raises UserError with podman's own message."""
        result = subprocess.run(
            self.command(*args), env=self.environment(), capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            raise UserError(f"podman {' '.join(args[:2])} failed (exit {result.returncode}): {result.stderr.strip()}")
        return result

    def start(self, *args: str, log: Path) -> subprocess.Popen[bytes]:
        """Start a long-running podman command (e.g. `run`), its output going to `log`."""
        with log.open("wb") as sink:
            return subprocess.Popen(self.command(*args), env=self.environment(), stdout=sink, stderr=subprocess.STDOUT)


def load_layout(podman: Podman, layout: Path, tag: str, name: str) -> str:
    """Copy the image tagged `tag` in an OCI layout into podman's store as `name`; returns its image id."""
    podman.run("pull", "--quiet", f"oci:{layout.resolve()}:{tag}")
    # A layout pull is named after the directory; give it the function's name.
    podman.run("tag", f"{layout.resolve().name}:{tag}", name)
    return podman.run("image", "inspect", "--format", "{{.Id}}", name).stdout.strip()


def pull_registry(podman: Podman, reference: str, *, insecure: bool) -> str:
    """Pull from a registry (podman checks every digest); returns the image id."""
    podman.run("pull", "--quiet", f"--tls-verify={'false' if insecure else 'true'}", reference)
    return podman.run("image", "inspect", "--format", "{{.Id}}", reference).stdout.strip()
