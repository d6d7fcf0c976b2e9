"""`[targets.ray]` without an address: `pkg deploy` starts a Ray head on this machine, bound to loopback, serves
the function through it, and `pkg destroy` of its last function stops it, leaving no process behind."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from packager.targets.local.server_process import free_port
from packager.targets.ray import local_head, nodes
from tests.ray.conftest import FUNCTION, function_toml


@pytest.fixture
def workspace(tmp_path: Path, demo_bundle: Path) -> Iterator[Path]:
    pytest.importorskip("ray", reason="ray is not installed (pip install 'onnxfn[ray]')")
    folder = tmp_path / "functions" / FUNCTION
    folder.mkdir(parents=True)
    toml = function_toml(max_replicas=1, max_queued_requests=8, http_port=free_port("127.0.0.1"))
    toml = "\n".join(line for line in toml.splitlines() if not line.startswith(("address", "bundle_store",
                     "endpoint_url", "region", "resources")))  # fmt: skip
    (folder / "function.toml").write_text(toml + "\n")
    (tmp_path / "build" / FUNCTION).mkdir(parents=True)
    (tmp_path / "build" / FUNCTION / "bundle").symlink_to(demo_bundle.resolve())
    yield tmp_path
    head = local_head.running()
    if head is not None:  # a failed test: nothing of the head may outlive it
        local_head.stop(head)


def pkg(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packager.cli", *args], cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip


# Ray 2.60 starts each Serve replica's inter-deployment gRPC server on every interface (`[::]:0`, fixed in
# ray/serve/_private/replica.py); docs/targets/ray.md says so. Everything else of the head must be on loopback.
REPLICA_TITLE = '"ray::ServeRepli"'  # the process name as `ss` shows it (15 characters)


def listening(pids: set[int]) -> list[str]:
    """`ss` lines of what these processes listen on (TCP), Serve replicas' own gRPC server left out."""
    table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [
        line for line in table.splitlines() if any(f"pid={pid}," in line for pid in pids) and REPLICA_TITLE not in line
    ]


def loopback(address: str) -> bool:
    """`127.0.0.1:PORT` or `[::ffff:127.0.0.1]:PORT` (gRPC's dual-stack form of the same); not `*:PORT`."""
    host = address.rpartition(":")[0].strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        return False
    ip = ipaddress.ip_address(host)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_a_local_head_on_loopback_serves_and_goes_with_its_last_function(workspace: Path) -> None:
    deployed = pkg(workspace, "deploy", f"functions/{FUNCTION}", "--target", "ray", "--json")
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert "started a Ray head at 127.0.0.1:" in deployed.stderr and "pkg destroy --target ray" in deployed.stderr
    report = json.loads(deployed.stdout)
    assert report["state"] == "ready" and report["url"].startswith("http://127.0.0.1:")
    head = local_head.running()
    assert head is not None and head.address.startswith("127.0.0.1:")
    processes = set(nodes.node_processes(head.node()))
    lines = listening(processes)
    assert lines and [line for line in lines if not loopback(line.split()[3])] == []

    key = (workspace / "build" / FUNCTION / "ray" / "api-key").read_text()
    client = openai.OpenAI(base_url=report["url"] + "/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=FUNCTION, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content

    destroyed = pkg(workspace, "destroy", f"functions/{FUNCTION}", "--target", "ray")
    assert destroyed.returncode == 0, destroyed.stderr
    assert "ray-head 127.0.0.1" in destroyed.stdout
    assert local_head.running() is None
    assert nodes.node_processes(head.node()) == []
