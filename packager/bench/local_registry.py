"""Debian's `docker-registry` on a free 127.0.0.1 port, for the image tests and the bench at size.

Our own config, not the packaged one (which listens on all interfaces), storage under the given folder, and
optionally htpasswd (basic) auth. The process is stopped when the context ends.
"""

from __future__ import annotations

import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from packager.targets.local.server_process import free_port

USER, PASSWORD = "onnxfn", "s3cret-test-password"  # the htpasswd registry's one account
START_TIMEOUT = 20.0


@dataclass(frozen=True)
class LocalRegistry:
    address: str  # 127.0.0.1:PORT
    storage: Path


@contextmanager
def run_registry(directory: Path, *, htpasswd: bool = False) -> Iterator[LocalRegistry]:
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    auth = ""
    if htpasswd:
        with warnings.catch_warnings():  # deprecated in 3.11, gone in 3.13: only for bcrypt htpasswd entries
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt
        # docker-registry reads bcrypt entries only; glibc's crypt makes them (cost 4: checked on every request).
        entry = crypt.crypt(PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
        (directory / "htpasswd").write_text(f"{USER}:{entry}\n")
        auth = f"auth:\n  htpasswd:\n    realm: onnxfn-test\n    path: {directory / 'htpasswd'}\n"
    config = directory / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {directory / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  secret: onnxfn-test-secret\n{auth}"
    )
    log = (directory / "registry.log").open("wb")
    process = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                requests.get(f"http://127.0.0.1:{port}/v2/", timeout=1)
                break
            except requests.ConnectionError as exc:
                if process.poll() is not None or time.monotonic() > deadline:
                    log_text = (directory / "registry.log").read_text()
                    raise RuntimeError(f"docker-registry did not start: {log_text}") from exc
                time.sleep(0.05)
        yield LocalRegistry(f"127.0.0.1:{port}", directory / "data")
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()
