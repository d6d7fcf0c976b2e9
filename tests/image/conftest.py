"""Real parts for image tests: Debian's docker-registry on a free 127.0.0.1 port (our own config: the
packaged one listens on all interfaces), podman with runc, and the demo image built once per session
from the demo bundle (its base layers come from the onnxfn cache after the first build)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from packager.image import ImageResult, build_image
from packager.image.run import Podman
from packager.progress import StepProgress
from packager.spec import FunctionSpec, load_spec

with warnings.catch_warnings():  # deprecated in 3.11, gone in 3.13: only for bcrypt htpasswd entries here
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("docker-registry", "debootstrap", "podman", "runc")
USER, PASSWORD = "onnxfn", "s3cret-test-password"


@dataclass(frozen=True)
class LocalRegistry:
    address: str  # 127.0.0.1:PORT
    storage: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def run_registry(directory: Path, *, htpasswd: bool = False) -> Iterator[LocalRegistry]:
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    auth = ""
    if htpasswd:
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
        deadline = time.monotonic() + 20
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


@pytest.fixture(scope="session")
def image_tools() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run scripts/setup_image_tools.sh")


@pytest.fixture(scope="session")
def registry(image_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    with run_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@pytest.fixture(scope="session")
def auth_registry(image_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    with run_registry(tmp_path_factory.mktemp("auth-registry"), htpasswd=True) as running:
        yield running


@pytest.fixture(scope="session")
def demo_spec() -> FunctionSpec:
    return load_spec(REPO / "functions" / "smollm2-chat")


@pytest.fixture(scope="session")
def demo_image(
    image_tools: None, demo_bundle: Path, demo_spec: FunctionSpec, tmp_path_factory: pytest.TempPathFactory
) -> ImageResult:
    out = tmp_path_factory.mktemp("demo-image")
    return build_image(demo_bundle, demo_spec, progress=StepProgress(), out_dir=out)


@pytest.fixture(scope="session")
def podman(image_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    tool = Podman(tmp_path_factory.mktemp("podman"), private_storage=True)
    yield tool
    subprocess.run(tool.command("rm", "--all", "--force"), env=tool.environment(), capture_output=True)
    subprocess.run(tool.command("rmi", "--all", "--force"), env=tool.environment(), capture_output=True)
