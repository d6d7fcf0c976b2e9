"""Two `pkg deploy` of one function at once leave one server; a deployment an earlier version recorded under
`build/NAME/local/` is still found, stopped and replaced. Real `pkg` processes and the real demo model."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import pytest

from tests.deploy_local.conftest import FUNCTION, Workspace, pid_alive

pytestmark = pytest.mark.real_model


def test_two_deploys_at_once_leave_one_server_and_destroy_leaves_none(workspace: Workspace) -> None:
    folder = str(workspace.add_function(FUNCTION).relative_to(workspace.root))
    command = workspace.command("deploy", folder, "--target", "local")
    started = [
        subprocess.Popen(
            command, cwd=workspace.root, env=workspace.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in started]
    for process, (_, stderr) in zip(started, outputs, strict=True):
        assert process.returncode == 0, stderr

    # The second waited for the first (naming it), then replaced the server the first had started.
    waited = [i for i, (_, stderr) in enumerate(outputs) if "waiting for another pkg" in stderr]
    assert len(waited) == 1, [stderr for _, stderr in outputs]
    second, other = waited[0], 1 - waited[0]
    assert f"waiting for another pkg (pid {started[other].pid}, deploy)" in outputs[second][1]
    pids = [_summary_pid(stdout) for stdout, _ in outputs]
    first, last = pids[other], pids[second]
    assert re.search(rf"replaced\s+│ pid {first} ", outputs[second][0]), outputs[second][0]
    assert not pid_alive(first) and pid_alive(last)
    state = workspace.state()
    assert state["pid"] == last
    assert httpx.get(f"{state['url']}/health", timeout=5).status_code == 200

    assert workspace.pkg("destroy", folder).returncode == 0
    assert not pid_alive(first) and not pid_alive(last)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{state['url']}/health", timeout=5)


def _summary_pid(stdout: str) -> int:
    found = re.search(r"│ pid\s+│ (\d+)", stdout)
    assert found is not None, stdout
    return int(found[1])


def test_a_deployment_recorded_under_build_by_an_earlier_version_is_found_and_replaced(workspace: Workspace) -> None:
    folder = str(workspace.add_function(FUNCTION).relative_to(workspace.root))
    assert workspace.pkg("deploy", folder).returncode == 0
    # Make it look like an earlier version's deployment: its files under build/NAME/local, none in the state folder.
    legacy = workspace.root / "build" / FUNCTION / "local"
    state_dir = workspace.state_dir()
    record = workspace.state()
    for name in ("state.json", "server.pid", "api-key"):
        shutil.move(state_dir / name, legacy / name)
    key = (legacy / "api-key").read_text()
    record |= {"api_key_location": str(legacy / "api-key"), "exit_file": "", "function_dir": ""}
    (legacy / "state.json").write_text(json.dumps(record))

    status = workspace.pkg("status", folder)
    assert status.returncode == 0 and "ready" in status.stdout, status.stdout
    [process] = json.loads(workspace.pkg("ps", "--json").stdout)  # from the project's root, as before
    assert (process["pid"], process["state"], process["function_dir"]) == (record["pid"], "ready", None)

    redeployed = workspace.pkg("deploy", folder)
    assert redeployed.returncode == 0, redeployed.stderr
    assert f"pid {record['pid']}" in redeployed.stdout  # replaced
    assert not pid_alive(int(str(record["pid"]))) and not (legacy / "state.json").exists()
    assert (state_dir / "api-key").read_text() == key  # its clients keep working
    assert not (legacy / "api-key").exists()
    assert workspace.state()["pid"] != record["pid"]
    assert workspace.pkg("destroy", folder).returncode == 0
