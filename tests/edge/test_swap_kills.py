"""SIGKILL the agent at random instants of an install: it must always come back serving a complete bundle.

The bundles are a tiny random-weight model built by the real pipeline: each kill costs an agent restart
and an engine load, which the demo model would make seconds each, so all 20 rounds run in every suite.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import httpx

from packager.edge.client import AgentClient, AgentError, DeviceAuth
from packager.edge.fleet import push
from runtime.bundle import open_bundle
from tests.edge.conftest import MODEL, TOKEN

KILLS = 20


def test_sigkill_during_install_always_recovers(devices, workspace, tiny_bundle_pair) -> None:
    (device,) = devices(1)
    archives = [workspace.archive(bundle) for bundle in tiny_bundle_pair]
    digests = {archive.manifest.digest for archive in archives}
    auth = DeviceAuth(TOKEN)
    (first,) = push([device.url], archives[0], auth, lambda *a: None, 8 << 20)
    assert first.outcome == "installed"
    rng = random.Random(20261122)
    outcomes = {"old": 0, "new": 0}
    install_seconds = first.install_seconds
    for round_ in range(KILLS):
        serving = device.status()["current"]["digest"]
        target = next(a for a in archives if a.manifest.digest != serving)
        with AgentClient(device.url, auth) as client:
            client.upload(target.path, target.sha256, lambda held: None)
            delay = rng.uniform(0.0, install_seconds)
            installing = threading.Thread(target=_install_ignoring_kill, args=(client, target.sha256))
            installing.start()
            time.sleep(delay)
            device.kill()
            installing.join()
        device.start()
        status = device.wait_settled()
        assert status["health"] == "serving", (round_, status)
        current = status["current"]["digest"]
        assert current in digests
        outcomes["new" if current == target.manifest.digest else "old"] += 1
        # Complete means every file matches the manifest: hash them all, as a fresh start would.
        assert open_bundle(device.root / "current").manifest.digest == current
        assert list((device.root / "staging").iterdir()) == []
        chat = httpx.post(
            f"{device.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            timeout=60,
        )
        assert chat.status_code == 200 and chat.json()["system_fingerprint"] == "fp_" + current[7:19]
    print(f"\n{KILLS} kills during installs (0..{install_seconds:.2f} s in): came back on the old bundle "
          f"{outcomes['old']} times, on the new one {outcomes['new']} times; never broken")  # fmt: skip


def _install_ignoring_kill(client: AgentClient, upload_id: str) -> None:
    with contextlib.suppress(AgentError):  # the agent dies under the request: that is the point
        client.install(upload_id)
