"""The local state and its process snapshots are the user's alone (issue 47, row 3), checked as another user.

The issue's setup: `$XDG_STATE_HOME` in a folder others can enter. A function deployed with a generated key serves
a prompt through the gateway, idles, and is dumped by CRIU with that prompt and its key in memory (the dump held
the key 12 times, mode 0644). Every folder of the state must then be 0700 and every file 0600, and `nobody` must
read none of them, while it can read a file the test leaves beside them (the check itself works).
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import DEMO_FUNCTION
from tests.deploy_local.conftest import FUNCTION, Workspace

pytestmark = pytest.mark.real_model
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
MARKER = "Describe the colour of the private-state-47 teapot."


@pytest.fixture
def shared_state(workspace: Workspace) -> Iterator[Path]:
    """`$XDG_STATE_HOME` in a folder anyone may enter (pytest's own tmp folders are 0700, which would hide all)."""
    folder = Path(tempfile.mkdtemp(prefix="onnxfn-xdg-", dir="/tmp"))
    folder.chmod(0o755)
    workspace.state_root = folder / "onnxfn"  # where the workspace's teardown finds what to stop
    workspace.env["XDG_STATE_HOME"] = str(folder)
    try:
        yield folder
    finally:
        workspace.pkg("gateway", "stop")
        shutil.rmtree(folder, ignore_errors=True)


def as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, *command], capture_output=True, text=True, timeout=30)


def test_every_file_and_folder_of_the_state_and_its_snapshot_is_private(
    workspace: Workspace, shared_state: Path
) -> None:
    demo = (DEMO_FUNCTION / "function.toml").read_text()
    assert demo.rsplit("\n[", 1)[1].startswith("targets.local]")  # its last table: the line below joins it
    spec = demo + "\nidle_timeout = 2\n"
    folder = workspace.add_function(FUNCTION, spec)
    deployed = workspace.pkg("deploy", str(folder), "--target", "local")
    assert deployed.returncode == 0, deployed.stderr
    key = (workspace.state_dir() / "api-key").read_text()
    body = {"model": FUNCTION, "messages": [{"role": "user", "content": MARKER}], "max_tokens": 4}
    answer = httpx.post(f"{workspace.gateway_url}/v1/chat/completions", json=body, timeout=120,
                        headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    # The gateway stops the idle server after 2 s, keeping a snapshot of it: the prompt above is in its memory.
    deadline = time.monotonic() + 120
    while not workspace.state().get("idle_since"):
        assert time.monotonic() < deadline, f"the function did not idle: {workspace.state()}"
        time.sleep(0.5)
    snapshot = workspace.state_dir() / "process-snapshot"
    images = sorted(snapshot.glob("pages-*.img"))
    assert images, sorted(p.name for p in snapshot.iterdir())

    state_root = shared_state / "onnxfn"
    wide = []
    for path in [state_root, *state_root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode != (0o700 if path.is_dir() else 0o600):
            wide.append(f"{oct(mode)} {path.relative_to(shared_state)}")
    assert not wide, "\n".join(wide)
    assert any(key.encode() in image.read_bytes() for image in images), "the dump should hold the key it protects"

    beside = shared_state / "readable.txt"
    beside.write_text("anyone\n")
    beside.chmod(0o644)
    assert as_nobody("cat", str(beside)).stdout == "anyone\n"  # the check can see what is not private
    for secret in (workspace.state_dir() / "api-key", images[0], workspace.state_dir() / "state.json", snapshot):
        refused = as_nobody("cat", str(secret)) if secret.is_file() else as_nobody("ls", str(secret))
        assert refused.returncode != 0 and "Permission denied" in refused.stderr, (secret, refused)
    assert "Permission denied" in as_nobody("ls", str(state_root)).stderr
