"""`pkg deploy|status|invoke|destroy --target local`, run as a user would: the real CLI in a subprocess.

Each test works in its own folder holding `functions/NAME/function.toml`, `build/NAME/bundle` (a link to
the demo bundle) and its own `$XDG_STATE_HOME`, so deployments never touch the repository's `build/` or the
user's state.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import DEMO_FUNCTION
from tests.deploy_local.conftest import FUNCTION, KEY_ENV, Workspace, client_for, pid_alive

pytestmark = pytest.mark.real_model


def test_deploy_invoke_redeploy_destroy(workspace: Workspace) -> None:
    folder = str(workspace.add_function(FUNCTION).relative_to(workspace.root))

    nothing = workspace.pkg("invoke", folder, "Hello")
    assert nothing.returncode == 1
    assert f"{FUNCTION} is not deployed" in nothing.stderr
    assert "Traceback" not in nothing.stderr

    deployed = workspace.pkg("deploy", folder, "--target", "local")
    assert deployed.returncode == 0, deployed.stderr
    assert "packed the weights for this CPU into" in deployed.stderr  # once per bundle and machine
    first = workspace.state()
    assert str(first["url"]) in deployed.stdout
    assert "generated into" in deployed.stdout
    key_file = Path(str(first["api_key_location"]))
    assert key_file.parent == workspace.state_dir()
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_text()  # no trailing newline: `open(path).read()` is the key
    assert key == key.strip() and len(key) > 30

    # The spec reached the server: its name is the model id, its defaults (greedy) make replies repeatable.
    client = client_for(first, key)
    assert [m.id for m in client.models.list().data] == [FUNCTION]
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    reply = client.chat.completions.create(model=FUNCTION, messages=question, max_tokens=8)
    again = client.chat.completions.create(model=FUNCTION, messages=question, max_tokens=8)
    assert reply.choices[0].message.content == again.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        client_for(first, "not-the-key").models.list()

    invoked = workspace.pkg("invoke", folder, "What is 2 + 2?", "--max-tokens", "8")
    assert invoked.returncode == 0, invoked.stderr
    assert invoked.stdout == f"{reply.choices[0].message.content}\n"
    assert "completion tokens" in invoked.stderr

    logs = workspace.pkg("logs", folder, "--tail", "200")
    assert logs.returncode == 0, logs.stderr
    assert "Application startup complete" in logs.stdout

    # Clients go through the gateway the deploy started: it routes by model to the server's own port.
    assert f"{workspace.gateway_url}/v1" in deployed.stdout
    status = workspace.pkg("status", folder)
    assert status.returncode == 0
    assert "ready" in status.stdout and workspace.gateway_url in status.stdout and "0/1" in status.stdout
    [row] = json.loads(workspace.pkg("status", folder, "--json").stdout)
    gateway = workspace.gateway_url
    assert (row["target"], row["state"], row["pid"], row["endpoint"]) == ("local", "ready", first["pid"], gateway)
    assert row["scaling"] == [0, 1] and abs(row["last_deploy"] - float(str(first["started_at"]))) < 1

    # From any folder: the state is the user's, keyed by the function folder's absolute path.
    elsewhere = workspace.root / "elsewhere"
    elsewhere.mkdir()
    absolute = str(workspace.root / folder)
    assert workspace.pkg("status", absolute, "--base-url", cwd=elsewhere).stdout == f"{gateway}/v1\n"
    assert workspace.pkg("status", absolute, "--api-key", cwd=elsewhere).stdout == f"{key}\n"
    [process] = json.loads(workspace.pkg("ps", "--json", cwd=elsewhere).stdout)
    assert (process["name"], process["state"], process["pid"]) == (FUNCTION, "ready", first["pid"])
    assert (process["function_dir"], process["url"], process["model"]) == (absolute, gateway, FUNCTION)
    assert (process["server_url"], process["wake"]) == (first["url"], None)
    assert process["bundle_digest"] == first["bundle_digest"] and process["state_dir"] == str(workspace.state_dir())
    assert process["rss_bytes"] > 50 << 20 and 0 < process["uptime_seconds"] < 600
    assert process["requests"] >= 4  # /v1/models twice (one refused), two chat completions, pkg invoke
    table = workspace.pkg("ps", cwd=elsewhere)
    assert table.returncode == 0 and FUNCTION in table.stdout and "ready" in table.stdout and "MiB" in table.stdout

    # Redeploy with the key now in the environment: the old server goes, the generated key goes.
    workspace.env[KEY_ENV] = "key-from-the-environment"
    redeployed = workspace.pkg("deploy", folder)
    assert redeployed.returncode == 0, redeployed.stderr
    assert "packed the weights" not in redeployed.stderr  # still valid: reused
    second = workspace.state()
    assert second["pid"] != first["pid"]
    assert not pid_alive(int(str(first["pid"])))
    assert "replaced" in redeployed.stdout
    assert f"from ${KEY_ENV}" in redeployed.stdout
    assert not key_file.exists()
    assert [m.id for m in client_for(second, "key-from-the-environment").models.list().data] == [FUNCTION]

    destroyed = workspace.pkg("destroy", absolute, "--target", "local", cwd=elsewhere)
    assert destroyed.returncode == 0, destroyed.stderr
    assert not pid_alive(int(str(second["pid"])))
    state_dir = workspace.state_dir()
    # The demo deploys with `process_snapshot = true`: destroy keeps the snapshot for the next deploy, and the
    # prepacked graphs it maps stay beside the bundle. (`server.exit` comes as the launcher sees the server end.)
    # The redeploy kept the replaced server's log, which it wrote to until it had drained.
    kept = sorted(p.name for p in state_dir.iterdir() if p.name != "server.exit")
    assert kept == ["deploy.lock", "process-snapshot", "server.log", "server.previous.log"]
    assert sorted(p.name for p in (workspace.root / "build" / FUNCTION / "local").iterdir()) == ["prepacked"]
    assert "Application startup complete" in (state_dir / "server.log").read_text()

    assert "Application startup complete" in workspace.pkg("logs", folder).stdout  # the log outlives the server
    assert "nothing to do" in workspace.pkg("destroy", folder).stdout
    assert "is not deployed" in workspace.pkg("status", folder).stdout
    assert workspace.pkg("invoke", folder, "Hello").returncode == 1
    assert json.loads(workspace.pkg("ps", "--json").stdout) == []


def test_a_server_that_cannot_start_fails_the_deploy_with_its_log(workspace: Workspace) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = f'name = "busy"\n[model]\nsource = "hf:unused"\n[targets.local]\nport = {port}\n'
        folder = str(workspace.add_function("busy", spec).relative_to(workspace.root))
        started = time.monotonic()
        result = workspace.pkg("deploy", folder)
    assert result.returncode == 1
    assert "busy did not start: the server exited with code 1" in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr.split("last")[0]
    assert time.monotonic() - started < 30
    assert not (workspace.state_dir("busy") / "state.json").exists()


def test_deploy_without_a_bundle_says_to_build(workspace: Workspace) -> None:
    folder = workspace.add_function(FUNCTION)
    (workspace.root / "build" / FUNCTION / "bundle").unlink()
    result = workspace.pkg("deploy", str(folder.relative_to(workspace.root)))
    assert result.returncode == 1
    assert "pkg build functions/smollm2-chat" in result.stderr
    assert not (workspace.root / "build" / FUNCTION / "local").exists()
    assert not workspace.state_dir().exists()


def test_a_crashed_server_shows_as_exited_until_the_gateway_starts_it_again(workspace: Workspace) -> None:
    # Also the plain way to deploy: no process snapshot, the bundle's graphs packed at start.
    spec = (DEMO_FUNCTION / "function.toml").read_text().replace("process_snapshot = true", "prepack = false")
    folder = str(workspace.add_function(FUNCTION, spec).relative_to(workspace.root))
    deployed = workspace.pkg("deploy", folder)
    assert deployed.returncode == 0, deployed.stderr
    assert "--prepacked" not in list(workspace.state()["command"])  # type: ignore[call-overload]
    assert not (workspace.root / "build" / FUNCTION / "local" / "prepacked").exists()
    pid = int(str(workspace.state()["pid"]))
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)

    status = workspace.pkg("status", folder)
    assert status.returncode == 1  # scripts can tell
    assert "exited" in status.stdout
    assert f"the server (pid {pid}) was killed by SIGKILL (out of memory?" in status.stdout
    assert "server.log" in status.stdout and "engine ready" in status.stdout  # its last lines
    [process] = json.loads(workspace.pkg("ps", "--json").stdout)
    assert (process["state"], process["rss_bytes"], process["requests"]) == ("exited", None, None)
    assert "was killed by SIGKILL" in process["reason"] and process["log_tail"]
    # `pkg invoke` goes through the gateway, which starts the server again (supervise.py) and answers.
    invoked = workspace.pkg("invoke", folder, "Hello", "--max-tokens", "4")
    assert invoked.returncode == 0, invoked.stderr
    [process] = json.loads(workspace.pkg("ps", "--json").stdout)
    assert process["state"] == "ready" and process["pid"] != pid
    assert workspace.state()["crashes"] and "was killed by SIGKILL" in str(workspace.state()["crash_reason"])
    destroyed = workspace.pkg("destroy", folder)
    assert destroyed.returncode == 0
    assert f"stopped {FUNCTION}" in destroyed.stdout
    assert not (workspace.state_dir() / "state.json").exists()
