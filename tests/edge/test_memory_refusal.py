"""`pkg push` refuses, before it sends a byte, a bundle a device has no memory for, and names the sizes.

The device is the real agent in its network namespace, moved into a memory cgroup of its own: a device with less
memory than the bundle needs, as its agent sees it (runtime/memory_need.py reads the cgroup's limit, as on a
Jetson whose containers are capped). Needs a writable memory cgroup besides the namespaces; skips without one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from packager.edge.client import DeviceAuth
from packager.edge.fleet import push
from packager.errors import UserError
from runtime.bundle import read_manifest
from runtime.memory_need import gib, serving_need
from tests.edge.conftest import TOKEN, Workspace
from tests.edge.test_push import fingerprint, pkg, served, token_file


def _memory_cgroup_of(pid: int) -> tuple[Path, str, str]:
    """The memory cgroup folder of `pid`, its limit file and its process list (cgroup v1, or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes", "cgroup.procs"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            return Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max", "cgroup.procs"
    pytest.skip("no memory cgroup to limit the device's agent with")


@contextmanager
def memory_limited(pid: int, limit: int) -> Iterator[Path]:
    """`pid` in a new memory cgroup with `limit` bytes (the limit file's path yielded), back where it was after."""
    parent, limit_file, procs = _memory_cgroup_of(pid)
    child = parent / f"onnxfn-device-{pid}"
    try:
        child.mkdir()
        (child / limit_file).write_text(str(limit))
        (child / procs).write_text(str(pid))
    except OSError as exc:
        if child.is_dir():
            child.rmdir()
        pytest.skip(f"cannot limit the agent's memory here ({exc})")
    try:
        yield child / limit_file
    finally:
        (parent / procs).write_text(str(pid))
        child.rmdir()


def test_a_device_without_memory_for_the_bundle_refuses_it_before_the_upload(
    devices, workspace: Workspace, bundle_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = bundle_pair[0]
    (device,) = devices(1)  # serves nothing yet
    # `ip netns exec` mounts a /sys of its own, without the cgroup file systems: the agent would see no limit. A
    # device's agent sees its cgroups, so this one enters the namespace's network only.
    device.kill()
    device.start(["nsenter", f"--net=/var/run/netns/{device.namespace}"])
    memory = device.wait_settled()["memory"]
    # The budgets the agent serves with: its --kv-memory-mb 64 and the engine's default prefix cache.
    assert memory["kv_pool_bytes"] == 64 << 20 and memory["prefix_cache_bytes"] == 128 << 20
    need = serving_need(read_manifest(bundle), 64 << 20, 128 << 20)
    assert memory["available_bytes"] > need.total  # this machine has room: only the limit below refuses
    archive = workspace.archive(bundle)
    auth = DeviceAuth(TOKEN)

    assert device.process is not None
    limit = need.total // 2 >> 16 << 16  # whole pages
    with memory_limited(device.process.pid, limit) as limit_file:
        memory = device.status()["memory"]
        assert memory["source"] == str(limit_file) and memory["total_bytes"] == limit
        assert memory["available_bytes"] < need.total
        (result,) = push([device.url], archive, auth, lambda *_: None, 1 << 20)
        assert result.outcome == "refused" and result.sent == 0, result
        assert result.detail.startswith(f"serving the bundle needs about {need.describe()} and the device has ")
        assert f" available of {gib(limit)} ({limit_file};" in result.detail
        assert "lower the agent's --kv-memory-mb" in result.detail
        # Nothing was sent or installed: no upload on the device, and it still serves nothing.
        status = device.status()
        assert status["current"] is None and status["history"] == []
        assert not any((device.root / "uploads").iterdir())
        # The command line fails naming it, like any device that failed (exit code 1).
        workspace.select(bundle)
        token = token_file(tmp_path)
        with pytest.raises(UserError, match=r"\(refused\): serving the bundle needs about .* available of") as failed:
            pkg(workspace, monkeypatch, "push", workspace.function, "--device", device.url, "--token-file", token)
        assert failed.value.exit_code == 1

    # The same device with its memory back takes the same bundle.
    (result,) = push([device.url], archive, auth, lambda *_: None, 1 << 20)
    assert result.outcome == "installed", result
    assert served(device) == fingerprint(bundle)
