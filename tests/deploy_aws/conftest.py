"""AWS deploy tests run `pkg` against a real local AWS endpoint: the shared moto server fixture, started with
`moto_site/sitecustomize.py` on its path (GPU/Inferentia instance types, UpdateEndpoint, a failing endpoint),
and Debian's docker-registry standing in for ECR's registry API. `pkg` gets both from its environment only.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from packager.bench.local_registry import LocalRegistry
from packager.cli import main
from tests.conftest import DEMO_FUNCTION
from tests.fixtures.moto_server import MotoServer, running_moto_server
from tests.image.conftest import image_tools, registry  # noqa: F401  (fixtures)

MOTO_SITE = Path(__file__).resolve().parent / "moto_site"
# The Lambda account quota moto enforces when asked to: reserving more than 900 leaves under 100 unreserved.
LAMBDA_CONCURRENCY_QUOTA = "1000"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """The shared launcher, with our patches loaded into the server process and Lambda's quota enforced."""
    patch = pytest.MonkeyPatch()
    patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(MOTO_SITE), os.environ.get("PYTHONPATH")])))
    patch.setenv("ONNXFN_MOTO_PATCHES", "1")
    patch.setenv("MOTO_LAMBDA_CONCURRENCY_QUOTA", LAMBDA_CONCURRENCY_QUOTA)
    try:
        with running_moto_server(tmp_path_factory.mktemp("moto")) as server:
            patch.undo()
            yield server
    finally:
        patch.undo()


@pytest.fixture(scope="session")
def frozen_bundle(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hard-linked copy of the demo bundle: a rebuild of build/smollm2-chat by another test cannot change it."""
    copy = tmp_path_factory.mktemp("bundle") / "bundle"
    shutil.copytree(demo_bundle, copy, copy_function=os.link)
    return copy


@dataclass
class Workspace:
    """A function folder and a working directory whose build/NAME/bundle is the demo bundle."""

    root: Path
    function_dir: Path
    name: str
    env: dict[str, str]

    def write_spec(self, target_tables: str, *, providers: str | None = None) -> None:
        text = (DEMO_FUNCTION / "function.toml").read_text()
        text = re.sub(r'^name = ".*"$', f'name = "{self.name}"', text, count=1, flags=re.M)
        if providers is not None:
            text = re.sub(r"^providers = .*$", f"providers = {providers}", text, count=1, flags=re.M)
        (self.function_dir / "function.toml").write_text(text + "\n" + target_tables)

    def pkg(self, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
        capsys.readouterr()
        code = main(list(args))
        captured = capsys.readouterr()
        return code, captured.out + captured.err


@pytest.fixture
def workspace(
    tmp_path: Path,
    frozen_bundle: Path,
    moto_server: MotoServer,
    registry: LocalRegistry,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> Iterator[Workspace]:
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:24].strip("-")
    function_dir = tmp_path / "functions" / name
    function_dir.mkdir(parents=True)
    # Hard links, not a symlink: the image's bundle layer is built from this folder's entries.
    shutil.copytree(frozen_bundle, tmp_path / "build" / name / "bundle", copy_function=os.link)
    env = {
        **moto_server.env,
        "ONNXFN_ECR_REGISTRY_URL": f"http://{registry.address}",
        "AWS_EC2_METADATA_DISABLED": "true",  # never ask 169.254.169.254 for credentials
        "COLUMNS": "250",
    }
    for variable in ("AWS_PROFILE", "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.chdir(tmp_path)
    yield Workspace(tmp_path, function_dir, name, env)
    moto_server.reset()


def tags_of(entries: Any) -> dict[str, str]:
    if isinstance(entries, dict):
        return dict(entries)
    return {entry.get("Key", entry.get("key")): entry.get("Value", entry.get("value")) for entry in entries}
