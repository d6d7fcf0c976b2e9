"""The local target's per-user state, its lock, how a server's end is recorded, and what `pkg status` and
`pkg ps` make of records, without a model: real processes, fake servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from packager.errors import UserError
from packager.paths import function_state_dir, state_root
from packager.spec import load_spec
from packager.targets.local import inventory, lock, server_process
from packager.targets.local.records import LocalDeployment, ServerState
from packager.targets.local.server_process import free_port

SPEC = 'name = "{name}"\n[model]\nsource = "hf:unused"\n'


def function(root: Path, name: str = "fake") -> Path:
    folder = root / "functions" / name
    folder.mkdir(parents=True)
    (folder / "function.toml").write_text(SPEC.format(name=name))
    return folder


def record(directory: Path, name: str = "fake", **changes: object) -> LocalDeployment:
    """A state.json for a server that is gone (pid 2**22 + 1 is above Linux's pid_max default)."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "server.log"
    log.write_text("INFO: Application startup complete.\nERROR: something went badly\n")
    deployment = LocalDeployment(
        function=name, url="http://127.0.0.1:9", host="127.0.0.1", port=9, pid=2**22 + 1, bundle="/nowhere",
        bundle_digest="sha256:" + "ab" * 32, started_at=time.time() - 60, log_file=str(log), api_key_source="none",
        api_key_location="", command=("python", "-m", "runtime", "serve", "/nowhere"),
        function_dir=str(directory), exit_file=str(directory / "server.exit"),
    )  # fmt: skip
    deployment = LocalDeployment(**{**asdict(deployment), **changes})
    (directory / "state.json").write_text(json.dumps(asdict(deployment)))
    return deployment


def pkg(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packager.cli", *args], cwd=cwd, env={**os.environ, "COLUMNS": "250", **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_state_root_follows_xdg_and_keys_functions_by_their_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_root() == tmp_path / "xdg" / "onnxfn"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/path")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_root() == tmp_path / "home" / ".local" / "state" / "onnxfn"

    one, other = function(tmp_path / "a", "chat"), function(tmp_path / "b", "chat")
    monkeypatch.chdir(tmp_path / "a")
    by_relative = function_state_dir(load_spec(Path("functions/chat")))
    monkeypatch.chdir(tmp_path)
    assert function_state_dir(load_spec(one)) == by_relative
    assert by_relative.name.startswith("chat-") and by_relative.parent == state_root() / "functions"
    assert function_state_dir(load_spec(other)) != by_relative


def test_a_second_holder_waits_says_for_whom_and_gives_up_with_what_to_do(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        said: list[str] = []
        started = time.monotonic()
        with pytest.raises(UserError) as refused, lock.held(tmp_path, "chat", "destroy", said.append, wait=0.5):
            pass
        assert time.monotonic() - started >= 0.5
        assert said == [f"waiting for another pkg (pid {holder.pid}, deploy) to finish with chat (at most 0 s)"]
        message = str(refused.value)
        assert f"another pkg (pid {holder.pid}, deploy) has been changing chat's local deployment" in message
        assert "wait for it to finish, or stop it and run this again" in message and lock.LOCK_FILE in message
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's lock: no stale lock file to clean up.
    with lock.held(tmp_path, "chat", "deploy", pytest.fail, wait=0.5):
        assert json.loads((tmp_path / lock.LOCK_FILE).read_text()) == {"pid": os.getpid(), "action": "deploy"}


HOLD_LOCK = """
import sys, time
from pathlib import Path
from packager.targets.local import lock
with lock.held(Path(sys.argv[1]), "chat", "deploy", print):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_waiter_names_a_holder_that_writes_its_name_late(tmp_path: Path) -> None:
    # The CI race: the holder has taken the lock but not yet written who it is (a loaded machine).
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_THEN_NAME, str(tmp_path / lock.LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        said: list[str] = []
        with pytest.raises(UserError), lock.held(tmp_path, "chat", "deploy", said.append, wait=1.5):
            pass
        assert said == [f"waiting for another pkg (pid {holder.pid}, destroy) to finish with chat (at most 2 s)"]
    finally:
        holder.kill()
        holder.wait()


LOCK_THEN_NAME = """
import fcntl, json, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(0.5)
os.pwrite(descriptor, json.dumps({"pid": os.getpid(), "action": "destroy"}).encode(), 0)
time.sleep(60)
"""


def test_a_server_started_under_the_lock_does_not_keep_it(tmp_path: Path) -> None:
    with lock.held(tmp_path, "chat", "deploy", pytest.fail):
        child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        with lock.held(tmp_path, "chat", "deploy", pytest.fail, wait=0.5):
            pass  # acquired at once: the child holds no copy of the locked descriptor
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("signal_number", "code", "reason"),
    [
        (0, 3, "exited with code 3"),
        (9, 137, "was killed by SIGKILL (out of memory?"),
        (15, 143, "was killed by SIGTERM"),
    ],
)
@pytest.mark.parametrize("prefix", [(), ("unshare", "--pid")], ids=["own-session", "pid-namespace"])
def test_the_launcher_records_how_the_server_ended(
    tmp_path: Path, signal_number: int, code: int, reason: str, prefix: tuple[str, ...]
) -> None:
    if prefix and os.geteuid() != 0:
        pytest.skip("a pid namespace needs root here")
    if prefix and signal_number == 15:
        pytest.skip("the first process of a pid namespace ignores signals it has no handler for, but SIGKILL")
    # Killed from outside, as the kernel's OOM killer or a user would; the real server handles SIGTERM (exit 0).
    # One that is signalled lives until it is (a slow machine's kill must not find it already exited).
    command = (sys.executable, "-c", f"import sys, time; time.sleep({60 if signal_number else 1}); sys.exit(3)")
    exit_file = tmp_path / "server.exit"
    started = time.time()
    with (tmp_path / "log").open("wb") as log:
        launcher, pid = server_process.launch(command, log, dict(os.environ), exit_file, prefix)
    assert pid != launcher.pid and Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1] == [
        arg.encode() for arg in command
    ]
    assert os.getpgid(pid) == pid  # a session of its own: `terminate` signals its group
    if signal_number:
        os.kill(pid, signal_number)
    assert launcher.wait(timeout=10) == code
    recorded = server_process.recorded_exit(exit_file, started)
    assert recorded == code and server_process.exit_reason(recorded).startswith(reason)
    assert server_process.recorded_exit(exit_file, time.time() + 60) is None  # an earlier server's


def test_gone_servers_are_exited_with_their_reason_or_idle_when_stopped_on_purpose(tmp_path: Path) -> None:
    exited = record(tmp_path / "a")
    (tmp_path / "a" / "server.exit").write_text("137\n")
    seen = inventory.observe(exited)
    assert seen.state is ServerState.EXITED and seen.rss_bytes is None and seen.uptime_seconds is None
    assert seen.reason.startswith(f"the server (pid {exited.pid}) was killed by SIGKILL")
    assert seen.log_tail[-1] == "ERROR: something went badly"
    assert "last 2 lines of" in seen.detail(exited.log_file)

    unknown = inventory.observe(record(tmp_path / "b", exit_file="", start="restored"))
    assert unknown.state is ServerState.EXITED and "it was resumed from a process snapshot" in unknown.reason

    idle = inventory.observe(record(tmp_path / "c", idle_since=time.time() - 5, wake="snapshot"))
    assert (idle.state, idle.rss_bytes) == (ServerState.IDLE, 0)
    assert "the next request through the gateway resumes its process snapshot" in idle.reason
    cold = inventory.observe(record(tmp_path / "d", idle_since=time.time() - 5, wake="fresh", wake_note="no CRIU"))
    assert "the next request through the gateway starts it fresh (no CRIU)" in cold.reason


def test_status_exits_1_for_an_exited_server_and_ps_lists_every_function(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg")}
    project = tmp_path / "project"
    for name in ("alpha", "beta"):
        folder = function(project, name)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("XDG_STATE_HOME", env["XDG_STATE_HOME"])
            directory = function_state_dir(load_spec(folder))
        record(directory, name, function_dir=str(folder), exit_file="" if name == "alpha" else str(directory / "x"))
    (directory / "x").write_text("1\n")  # beta exited with code 1
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    status = pkg("status", str(project / "functions" / "beta"), cwd=elsewhere, env=env)
    assert status.returncode == 1
    assert "exited with code 1" in status.stdout and "something went badly" in status.stdout
    as_json = pkg("status", str(project / "functions" / "beta"), "--json", cwd=elsewhere, env=env)
    assert as_json.returncode == 1 and json.loads(as_json.stdout)[0]["state"] == "exited"
    # Its base URL is the gateway's (started for it): the gateway starts an exited server again on the next request.
    gateway_port = free_port("127.0.0.1")
    endpoint = pkg(
        "status", str(project / "functions" / "beta"), "--base-url", cwd=elsewhere,
        env={**env, "ONNXFN_GATEWAY_PORT": str(gateway_port)},
    )  # fmt: skip
    pkg("gateway", "stop", cwd=elsewhere, env=env)
    assert endpoint.returncode == 0 and endpoint.stdout == f"http://127.0.0.1:{gateway_port}/v1\n", endpoint.stderr
    assert "Traceback" not in status.stderr + endpoint.stderr

    listed = pkg("ps", "--json", cwd=elsewhere, env=env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [row["name"] for row in rows] == ["alpha", "beta"]
    assert set(rows[0]) == {
        "name", "function_dir", "url", "server_url", "model", "state", "wake", "idle_timeout", "reason", "log_tail",
        "pid", "bundle_digest", "rss_bytes", "uptime_seconds", "requests", "started_at", "state_dir", "log_file",
        "crashes", "last_crash",
    }  # fmt: skip
    assert rows[1]["function_dir"] == str(project / "functions" / "beta") and rows[1]["model"] == "beta"
    assert rows[1]["state"] == "exited" and "exited with code 1" in rows[1]["reason"]
    table = pkg("ps", cwd=elsewhere, env=env)
    assert table.returncode == 0 and "alpha" in table.stdout and "beta: the server" in table.stdout

    (directory / "state.json").write_text("{not json")
    corrupt = pkg("ps", "--json", cwd=elsewhere, env=env)
    assert corrupt.returncode == 1 and [row["name"] for row in json.loads(corrupt.stdout)] == ["alpha"]
    assert "is corrupt" in corrupt.stderr and "delete" in corrupt.stderr


def test_ps_with_nothing_deployed_says_how_to_deploy(tmp_path: Path) -> None:
    empty = pkg("ps", cwd=tmp_path, env={"XDG_STATE_HOME": str(tmp_path / "xdg")})
    assert empty.returncode == 0 and "no function is deployed on this machine" in empty.stdout
    assert pkg("ps", "--json", cwd=tmp_path, env={"XDG_STATE_HOME": str(tmp_path / "xdg")}).stdout == "[]\n"
