"""The `local` target's process snapshots, with the real CRIU (scripts/setup_criu.sh) and the real demo model.

The first deploy starts the server and dumps it once warm; later deploys resume that dump, unless anything
it depends on changed or the restore fails, and then start fresh and dump again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import time
from pathlib import Path

import openai
import pytest

from packager.targets.local.process_snapshot import Criu, SnapshotKey, SnapshotUnavailable
from tests.deploy_local.conftest import FUNCTION, Workspace, client_for, pid_alive

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "Name three primary colours."}]


def deploy(space: Workspace, folder: Path) -> dict[str, object]:
    result = space.pkg("deploy", str(folder), "--target", "local")
    assert result.returncode == 0, result.stderr
    state = space.state()
    state["stdout"] = result.stdout
    return state


def greedy_reply(state: dict[str, object], space: Workspace) -> str:
    key = (space.state_dir() / "api-key").read_text()
    reply = client_for(state, key).chat.completions.create(
        model=FUNCTION, messages=QUESTION, max_tokens=24, temperature=0
    )
    return reply.choices[0].message.content or ""


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def snapshot_meta(space: Workspace) -> Path:
    return space.state_dir() / "process-snapshot" / "snapshot.json"


def test_a_redeploy_resumes_the_snapshot_and_answers_like_a_fresh_start(workspace: Workspace) -> None:
    folder = workspace.add_function(FUNCTION)
    first = deploy(workspace, folder)
    assert first["start"] == "fresh"
    assert "process snapshot taken" in str(first["stdout"]) and snapshot_meta(workspace).is_file()
    # The weights are mapped from the prepacked graphs, so the dump holds none of them (717 MiB before, 121 now).
    prepacked = workspace.root / "build" / FUNCTION / "local" / "prepacked"
    assert "--prepacked" in list(first["command"]) and (prepacked / "prepacked.json").is_file()  # type: ignore[call-overload]
    dumped = sum(path.stat().st_size for path in snapshot_meta(workspace).parent.iterdir())
    assert dumped < 200 << 20, f"{dumped >> 20} MiB"
    fresh_reply = greedy_reply(first, workspace)
    old_key = (workspace.state_dir() / "api-key").read_text()

    assert workspace.pkg("destroy", str(folder), "--target", "local").returncode == 0
    assert not pid_alive(int(str(first["pid"])))
    second = deploy(workspace, folder)
    assert second["start"] == "restored", second["stdout"]
    assert "resumed the process snapshot" in str(second["stdout"])
    assert second["url"] == first["url"]  # the listening socket comes back with the process
    assert second["pid"] != first["pid"] and pid_alive(int(str(second["pid"])))
    assert greedy_reply(second, workspace) == fresh_reply
    # destroy removed the generated key and this deploy wrote a new one: the resumed server re-read it.
    with pytest.raises(openai.AuthenticationError):
        client_for(second, old_key).models.list()
    log = (workspace.state_dir() / "server.log").read_text()
    assert "restored from a snapshot: generators reseeded" in log

    # status and destroy treat the resumed process like any other deployment.
    status = workspace.pkg("status", str(folder))
    assert status.returncode == 0 and "ready" in status.stdout
    assert workspace.pkg("destroy", str(folder), "--target", "local").returncode == 0
    assert not pid_alive(int(str(second["pid"])))
    # Nobody waits on a resumed process, so nothing records how it ends: status says so and shows its log.
    assert workspace.pkg("deploy", str(folder)).returncode == 0
    third = workspace.state()
    assert third["start"] == "restored" and third["exit_file"] == ""
    os.kill(int(str(third["pid"])), signal.SIGKILL)
    wait_gone(int(str(third["pid"])))
    gone = workspace.pkg("status", str(folder))
    assert gone.returncode == 1 and "it was resumed from a process snapshot" in gone.stdout


def test_a_snapshot_that_no_longer_matches_is_ignored_and_replaced(workspace: Workspace) -> None:
    folder = workspace.add_function(FUNCTION)
    first = deploy(workspace, folder)
    reference = greedy_reply(first, workspace)
    meta = snapshot_meta(workspace)
    recorded = json.loads(meta.read_text())
    meta.write_text(json.dumps({**recorded, "bundle_digest": "sha256:" + "0" * 64}))

    second = deploy(workspace, folder)
    assert second["start"] == "fresh"
    assert "the process snapshot was not used (its bundle digest differs)" in " ".join(str(second["stdout"]).split())
    assert json.loads(meta.read_text())["bundle_digest"] == recorded["bundle_digest"]  # taken again
    assert greedy_reply(second, workspace) == reference


def test_a_restore_that_fails_falls_back_to_a_fresh_start(workspace: Workspace) -> None:
    folder = workspace.add_function(FUNCTION)
    first = deploy(workspace, folder)
    assert workspace.pkg("destroy", str(folder), "--target", "local").returncode == 0
    # Something else now listens on the snapshot's port: the restored socket cannot bind.
    with socket.socket() as squatter:
        # SO_REUSEADDR, as the server binds: the stopped server's closed connections may still be in TIME_WAIT.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", int(str(first["port"]))))
        squatter.listen()
        second = deploy(workspace, folder)
    assert second["start"] == "fresh"
    assert "criu restore failed" in " ".join(str(second["stdout"]).split())
    assert second["port"] != first["port"] and pid_alive(int(str(second["pid"])))
    assert greedy_reply(second, workspace)


def test_without_a_usable_criu_the_deploy_starts_normally_and_says_why(
    workspace: Workspace,
    tmp_path: Path,
) -> None:
    old_criu = tmp_path / "criu-3.17"
    old_criu.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old_criu.chmod(old_criu.stat().st_mode | stat.S_IXUSR)
    workspace.env["ONNXFN_CRIU"] = str(old_criu)
    folder = workspace.add_function(FUNCTION)
    state = deploy(workspace, folder)
    said = " ".join(str(state["stdout"]).split())
    assert state["start"] == "fresh"
    assert "no process snapshot" in said and "is not CRIU >= 4.1" in said and "scripts/setup_criu.sh" in said
    assert not snapshot_meta(workspace).exists()
    assert greedy_reply(state, workspace)


def test_a_snapshot_key_names_the_first_difference() -> None:
    key = SnapshotKey("sha256:a", ("python", "-m", "runtime"), "r1", "python 3.11", "4.1.1", "boot-1", "")
    assert key.mismatch(key) is None
    moved = SnapshotKey("sha256:a", ("python", "-m", "runtime"), "r1", "python 3.11", "4.1.1", "boot-2", "")
    assert key.mismatch(moved) == "its boot id differs (snapshot: 'boot-2', now: 'boot-1')"
    rekeyed = SnapshotKey("sha256:a", ("python", "-m", "runtime"), "r1", "python 3.11", "4.1.1", "boot-1", "d")
    assert key.mismatch(rekeyed) == "its api key env digest differs"  # digests are not shown
    moved_port = SnapshotKey("sha256:a", ("python", "--port", "1"), "r1", "python 3.11", "4.1.1", "boot-1", "")
    now = SnapshotKey(
        "sha256:a", ("python", "--port", "2", "--prepacked", "p"), "r1", "python 3.11", "4.1.1", "boot-1", ""
    )
    assert now.mismatch(moved_port) == "its command differs (now with 2 --prepacked p; no more 1)"
    repacked = SnapshotKey("sha256:a", ("python", "-m", "runtime"), "r1", "python 3.11", "4.1.1", "boot-1", "", "x")
    assert key.mismatch(repacked) == "its prepacked digest differs"


def test_criu_missing_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ONNXFN_CRIU", str(tmp_path / "no-such-criu"))
    with pytest.raises(SnapshotUnavailable, match="no-such-criu is not executable: run scripts/setup_criu.sh"):
        Criu.find()
    monkeypatch.delenv("ONNXFN_CRIU")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SnapshotUnavailable, match="CRIU is not installed: run scripts/setup_criu.sh"):
        Criu.find()
