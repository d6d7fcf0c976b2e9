"""A full disk under a function's state (found by scripts/chaos.py): its record, log and process snapshot have
nowhere to go. The demo deployed with its state folder on a small tmpfs (root mounts it), then the tmpfs filled.

Before: `pkg deploy` died with a traceback from the record write and left the new server running with no record
knowing it; an idle stop terminated the server, then failed to record it, so the function looked crashed. Now the
deploy fails with what to do, the running version serves on and no stray server is left; an idle stop that
cannot record the stop leaves the server running; with space again, both work.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import DEMO_FUNCTION
from tests.deploy_local.conftest import FUNCTION, Workspace, pid_alive

pytestmark = pytest.mark.real_model

TMPFS = "160m"  # the record, the log and the demo's ~90 MB process snapshot


@pytest.fixture
def small_disk(workspace: Workspace) -> Iterator[Path]:
    """The function's state folder, on a tmpfs of its own; unmounted after its processes are gone."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    toml = (DEMO_FUNCTION / "function.toml").read_text().replace("port = 0", "port = 0\nidle_timeout = 0")
    workspace.add_function(FUNCTION, toml)
    state = workspace.state_dir()
    state.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS}", "tmpfs", str(state)], check=True)
    try:
        yield state
    finally:
        for record in [
            *workspace.state_root.glob("functions/*/state.json"),
            *workspace.state_root.glob("gateway/*.json"),
        ]:
            with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
                os.killpg(json.loads(record.read_text())["pid"], signal.SIGKILL)
        time.sleep(0.5)
        if subprocess.run(["umount", str(state)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(state)], check=True)


def fill(folder: Path) -> Path:
    """Take every free page of the tmpfs (a MiB at a time, then a page at a time)."""
    filler = folder / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    os.write(descriptor, b"\0" * size)
    finally:
        os.close(descriptor)
    return filler


def servers_of(space: Workspace) -> list[int]:
    """The processes serving the demo bundle for this workspace (its XDG_STATE_HOME in their environment)."""
    mark = f"XDG_STATE_HOME={space.state_root.parent}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "cmdline").read_bytes().split(b"\0")[1:4] != [
                b"-m",
                b"runtime",
                b"serve",
            ]:
                continue
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def wait_idle(space: Workspace, pid: int) -> None:
    deadline = time.monotonic() + 30
    while space.state()["idle_since"] is None or pid_alive(pid):
        assert time.monotonic() < deadline, "the function never went idle"
        time.sleep(0.2)


def chat(space: Workspace) -> int:
    key = (space.state_dir() / "api-key").read_text()
    body = {"model": FUNCTION, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{space.gateway_url}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code


def test_a_full_disk_fails_a_redeploy_cleanly_and_the_running_version_serves_on(
    workspace: Workspace, small_disk: Path
) -> None:
    folder = str(workspace.root / "functions" / FUNCTION)
    assert workspace.pkg("deploy", folder).returncode == 0
    first = workspace.state()
    assert chat(workspace) == 200

    filler = fill(small_disk)
    refused = workspace.pkg("deploy", folder)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    said = " ".join(refused.stderr.split())
    assert "No space left on device" in said and "free space there and try again" in said
    assert workspace.state()["pid"] == first["pid"] and pid_alive(int(str(first["pid"])))
    assert servers_of(workspace) == [first["pid"]]  # the new server it started is gone with the deploy
    assert chat(workspace) == 200
    [row] = json.loads(workspace.pkg("ps", "--json").stdout)
    assert row["state"] == "ready" and row["pid"] == first["pid"]

    filler.unlink()
    assert workspace.pkg("deploy", folder).returncode == 0
    assert workspace.state()["pid"] != first["pid"] and chat(workspace) == 200


def test_an_idle_stop_that_cannot_be_recorded_leaves_the_server_running(workspace: Workspace, small_disk: Path) -> None:
    toml = workspace.root / "functions" / FUNCTION / "function.toml"
    toml.write_text(toml.read_text().replace("idle_timeout = 0", "idle_timeout = 2"))
    folder = str(workspace.root / "functions" / FUNCTION)
    assert workspace.pkg("deploy", folder).returncode == 0
    pid = int(str(workspace.state()["pid"]))
    assert chat(workspace) == 200

    filler = fill(small_disk)
    time.sleep(8)  # idle for long enough, several times over: each stop is tried and given up
    assert pid_alive(pid) and workspace.state()["idle_since"] is None
    assert chat(workspace) == 200  # served by the same server, never stopped
    assert workspace.state()["pid"] == pid

    filler.unlink()
    wait_idle(workspace, pid)  # with space, the next idle stop goes through
    assert chat(workspace) == 200  # and it is woken again
