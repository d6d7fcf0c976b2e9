"""`pkg serve`: the function's server in the foreground, driven as a user does: a real `pkg` process, a real
request, then Ctrl-C (SIGINT to `pkg`, or to its whole process group as a terminal sends it)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.deploy_local.conftest import FUNCTION, Workspace, pid_alive
from tests.foreground.conftest import free_port, kill_session, session_processes

pytestmark = pytest.mark.real_model
READY_TIMEOUT = 60.0


def start_serve(workspace: Workspace, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        workspace.command("serve", f"functions/{FUNCTION}", *args), cwd=workspace.root, env=workspace.env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def wait_ready(serve: subprocess.Popen[str], url: str) -> str:
    """Wait for `pkg serve` itself to announce the server at `url`; returns what it printed so far.

    Its own announcement, not a probe of our own: `pkg serve` probes /ready separately, and a test that signalled
    it after its own probe could stop it before it announced anything. Read from the descriptor (select, then
    os.read), so the pipe's text wrapper stays empty for the `communicate()` that reads the rest."""
    assert serve.stdout is not None
    descriptor, printed = serve.stdout.fileno(), b""
    deadline = time.monotonic() + READY_TIMEOUT
    while f" is ready at {url}/v1".encode() not in printed:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"pkg serve did not say it was ready at {url} after {READY_TIMEOUT:.0f} s: {printed!r}")
        if select.select([descriptor], [], [], remaining)[0]:
            chunk = os.read(descriptor, 65536)
            if not chunk:
                pytest.fail(f"pkg serve exited before it was ready: {printed!r} {serve.communicate()}")
            printed += chunk
    return printed.decode()


def server_pids(serve: subprocess.Popen[str]) -> list[int]:
    """The servers `pkg serve` runs: every process of its session but itself."""
    return [pid for pid in session_processes(serve.pid) if pid != serve.pid]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("how", ["signal to pkg", "Ctrl-C in a terminal"])
def test_serve_answers_then_ctrl_c_stops_it_cleanly(workspace: Workspace, how: str) -> None:
    workspace.add_function(FUNCTION)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = start_serve(workspace, "--port", str(port))
    try:
        announced = wait_ready(serve, url)
        servers = server_pids(serve)
        assert len(servers) == 1, servers
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": FUNCTION, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"].strip()
        if how == "signal to pkg":
            os.kill(serve.pid, signal.SIGINT)
        else:  # a terminal signals its foreground process group: `pkg`, not the server in a group of its own
            os.killpg(serve.pid, signal.SIGINT)
        stdout, stderr = serve.communicate(timeout=30)
        stdout = announced + stdout
    finally:
        kill_session(serve.pid)
    assert serve.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert f"{FUNCTION} is ready at {url}/v1" in stdout, stdout
    assert "api key: none (only this machine can connect)" in stdout
    assert f"pkg chat functions/{FUNCTION} --url {url}" in stdout
    assert "Application shutdown complete" in stderr  # the server's own log, on the terminal, drained
    assert f"stopped {FUNCTION}" in stderr
    assert not pid_alive(servers[0]) and session_processes(serve.pid) == []
    assert port_is_free(port)


def test_the_server_does_not_outlive_a_killed_pkg_serve(workspace: Workspace) -> None:
    workspace.add_function(FUNCTION)
    port = free_port()
    serve = start_serve(workspace, "--port", str(port))
    try:
        wait_ready(serve, f"http://127.0.0.1:{port}")
        servers = server_pids(serve)
        serve.kill()  # SIGKILL: `pkg serve` forwards nothing; the kernel's parent-death signal stops the server
        serve.communicate(timeout=10)
        deadline = time.monotonic() + 15
        while any(map(pid_alive, servers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(pid_alive, servers)), servers
    finally:
        kill_session(serve.pid)


def test_serve_refuses_what_it_cannot_do_and_says_what_to_do(workspace: Workspace) -> None:
    workspace.add_function(FUNCTION)
    unbuilt = workspace.root / "functions" / "unbuilt"
    unbuilt.mkdir()
    spec = (workspace.root / "functions" / FUNCTION / "function.toml").read_text()
    (unbuilt / "function.toml").write_text(spec.replace(f'name = "{FUNCTION}"', 'name = "unbuilt"'))

    result = workspace.pkg("serve", "functions/unbuilt", timeout=60)
    assert result.returncode == 1 and "pkg build functions/unbuilt" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr

    result = workspace.pkg("serve", f"functions/{FUNCTION}", "--host", "0.0.0.0", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "without an API key" in result.stderr and "--api-key-env" in result.stderr
    assert "Traceback" not in result.stderr

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = workspace.pkg("serve", f"functions/{FUNCTION}", "--port", str(port), timeout=60)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; choose another with --port" in result.stderr
    assert "Traceback" not in result.stderr
