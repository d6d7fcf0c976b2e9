"""The `local` target's test workspace: a folder of its own holding `functions/NAME`, `build/NAME/bundle` and the
per-user state folder (`$XDG_STATE_HOME`) its `pkg` commands use."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from packager.gateway.control import PORT_ENV
from packager.paths import function_state_dir
from packager.spec import load_spec
from packager.targets.local.server_process import free_port
from tests.conftest import DEMO_FUNCTION

FUNCTION = "smollm2-chat"
KEY_ENV = "ONNXFN_API_KEY"


class Workspace:
    def __init__(self, root: Path, bundle: Path) -> None:
        self.root = root
        self.bundle = bundle
        self.state_root = root / "xdg-state" / "onnxfn"
        # A wide terminal, so rich does not wrap the messages the tests look for.
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        # Its own gateway port: the user's gateway (8420) or another test's never answers for this workspace.
        self.gateway_port = free_port("127.0.0.1")
        self.env = {
            **env, "COLUMNS": "250", "XDG_STATE_HOME": str(self.state_root.parent), PORT_ENV: str(self.gateway_port)
        }  # fmt: skip

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def add_function(self, name: str, toml: str | None = None, bundle: Path | None = None) -> Path:
        folder = self.root / "functions" / name
        folder.mkdir(parents=True)
        spec = (DEMO_FUNCTION / "function.toml").read_text() if toml is None else toml
        (folder / "function.toml").write_text(spec)
        build = self.root / "build" / name
        build.mkdir(parents=True)
        (build / "bundle").symlink_to(bundle or self.bundle)
        return folder

    def pkg(self, *args: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args), cwd=cwd or self.root, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "packager.cli", *args]

    def state_dir(self, name: str = FUNCTION) -> Path:
        """The function's per-user state folder, as `pkg` computes it."""
        return function_state_dir(load_spec(self.root / "functions" / name), root=self.state_root)

    def state(self, name: str = FUNCTION) -> dict[str, object]:
        return json.loads((self.state_dir(name) / "state.json").read_text())


@pytest.fixture
def workspace(tmp_path: Path, demo_bundle: Path) -> Iterator[Workspace]:
    space = Workspace(tmp_path, demo_bundle.resolve())
    yield space
    # Never leave a server or a gateway behind, whatever the test did (records of earlier versions included).
    records = [*space.state_root.glob("functions/*/state.json"), *tmp_path.glob("build/*/local/state.json")]
    for state_file in [*records, *space.state_root.glob("gateway/gateway.json")]:
        pid = json.loads(state_file.read_text())["pid"]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def client_for(state: dict[str, object], key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{state['url']}/v1", api_key=key, max_retries=0, timeout=60)
