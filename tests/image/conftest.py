"""Real parts for image tests: Debian's docker-registry on a free 127.0.0.1 port (packager/bench/local_registry.py),
podman with runc, and the demo image built once per session from the demo bundle (its base layers come from the
onnxfn cache after the first build)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from packager.bench.local_registry import LocalRegistry, run_registry
from packager.image import ImageResult, build_image
from packager.image.run import Podman
from packager.progress import StepProgress
from packager.spec import FunctionSpec, load_spec

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("docker-registry", "debootstrap", "podman", "runc")


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
