"""`pkg push` / `pkg rollback` against real agents on network-namespace devices, with the real demo bundle."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from packager.cli import build_parser
from packager.edge.client import AgentClient, DeviceAuth
from packager.edge.fleet import push
from packager.errors import UserError
from tests.edge.conftest import MODEL, TOKEN, Device, Workspace


def pkg(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.chdir(workspace.root)
    args = build_parser().parse_args(list(argv))
    return args.run(args)


def token_file(tmp_path: Path, token: str = TOKEN) -> str:
    path = tmp_path / f"token-{token}"
    path.write_text(token)
    return str(path)


def served(device: Device) -> str:
    """The system_fingerprint (bundle digest) of a chat answer from the device's /v1 API."""
    response = httpx.post(
        f"{device.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] >= 1
    return body["system_fingerprint"]


def fingerprint(bundle: Path) -> str:
    from runtime.bundle import read_manifest

    return "fp_" + read_manifest(bundle).digest.removeprefix("sha256:")[:12]


def test_push_update_and_rollback_on_two_devices(devices, workspace, bundle_pair, tmp_path, monkeypatch) -> None:
    a, b = bundle_pair
    first, second = devices(2)
    urls = f"{first.url},{second.url}"
    token = token_file(tmp_path)

    workspace.select(a)
    started = time.perf_counter()
    assert pkg(workspace, monkeypatch, "push", workspace.function, "--device", urls, "--token-file", token) == 0
    print(f"\npush of A ({a.name}) to 2 devices: {time.perf_counter() - started:.2f} s (archive included)")
    for device in (first, second):
        assert served(device) == fingerprint(a)

    # The update, with a client hammering the first device: the swap must not fail a single request.
    workspace.select(b)
    load = _Traffic(first)
    load.start()
    started = time.perf_counter()
    assert pkg(workspace, monkeypatch, "push", workspace.function, "--device", urls, "--token-file", token) == 0
    update_s = time.perf_counter() - started
    load.stop()
    print(f"update to B: {update_s:.2f} s; during it {load.ok} requests ok, {len(load.failures)} failed, "
          f"longest gap between answers {load.max_gap * 1000:.0f} ms")  # fmt: skip
    assert load.failures == []
    assert load.ok > 0 and load.fingerprints == {fingerprint(a), fingerprint(b)}
    for device in (first, second):
        assert served(device) == fingerprint(b)
        status = device.status()
        assert status["current"]["function"] == "smollm2-chat-v2"
        assert status["previous"]["function"] == "smollm2-chat"
        assert [e["event"] for e in status["history"]] == ["installed", "installed"]

    assert pkg(workspace, monkeypatch, "rollback", workspace.function, "--device", urls, "--token-file", token) == 0
    for device in (first, second):
        assert served(device) == fingerprint(a)
        assert device.status()["current"]["function"] == "smollm2-chat"
        assert device.status()["previous"]["function"] == "smollm2-chat-v2"

    # Pushing what a device already serves changes nothing; pushing B again installs it over the kept copy.
    workspace.select(a)
    assert pkg(workspace, monkeypatch, "push", workspace.function, "--device", first.url, "--token-file", token) == 0
    assert first.status()["history"][-1]["event"] == "rolled_back"
    workspace.select(b)
    assert pkg(workspace, monkeypatch, "push", workspace.function, "--device", first.url, "--token-file", token) == 0
    assert served(first) == fingerprint(b)
    assert sorted(p.name for p in (first.root / "bundles").iterdir()) == sorted(
        {first.status()["current"]["bundle"], first.status()["previous"]["bundle"]}
    )


def test_wrong_token_and_unreachable_device_are_clear_errors(devices, workspace, bundle_pair, tmp_path, monkeypatch):
    (device,) = devices(1)
    workspace.select(bundle_pair[0])
    wrong = token_file(tmp_path, "not-the-token")
    with pytest.raises(UserError, match=r"refused the token \(401: incorrect API key provided\)"):
        pkg(workspace, monkeypatch, "push", workspace.function, "--device", device.url, "--token-file", wrong)
    nobody = device.url.replace(":8470", ":8471")
    with pytest.raises(UserError, match=r"unreachable\): cannot connect .*is `python -m runtime agent` running"):
        pkg(workspace, monkeypatch, "push", workspace.function, "--device", nobody, "--token-file", wrong)
    with pytest.raises(UserError, match="no agent token"):
        monkeypatch.delenv("ONNXFN_EDGE_TOKEN", raising=False)
        pkg(workspace, monkeypatch, "rollback", workspace.function, "--device", device.url)
    assert httpx.get(f"{device.url}/agent/status", timeout=5).status_code == 401
    assert device.status()["health"] == "empty"
    assert httpx.get(f"{device.url}/v1/models", timeout=5).status_code == 503


def test_interrupted_uploads_resume(devices, workspace, bundle_pair, tmp_path) -> None:
    """The pusher dies at ~30 %, then the agent dies at ~60 %: each later push sends only the rest."""
    import subprocess
    import sys

    (device,) = devices(1)
    archive = workspace.archive(bundle_pair[0])
    auth = DeviceAuth(TOKEN)
    client = AgentClient(device.url, auth)
    workspace.select(bundle_pair[0])
    pusher = subprocess.Popen(
        [sys.executable, "-m", "packager.cli", "push", workspace.function, "--device", device.url,
         "--token-file", token_file(tmp_path), "--chunk-mb", "1"],
        cwd=workspace.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        killed_at = _wait_for_offset(client, archive.sha256, 0.3 * archive.size, pusher)
    finally:
        pusher.kill()
        pusher.wait()
    time.sleep(0.2)
    after_pusher = client.offset(archive.sha256)
    assert killed_at <= after_pusher < archive.size

    def kill_past_60_percent(url: str, phase: str, done: int, total: int) -> None:
        """The device dies once it holds 60 %: from the pushing thread, so no chunk goes out after that."""
        if phase == "upload" and done >= 0.6 * total and device.process is not None:
            device.kill()

    results = push([device.url], archive, auth, kill_past_60_percent, 1 << 20)
    assert results[0].outcome == "unreachable"
    assert results[0].resumed_from == 0 and results[0].sent == 0  # the failed attempt reports nothing sent
    device.start()
    held = client.offset(archive.sha256)
    assert after_pusher < held < archive.size

    started = time.perf_counter()
    (result,) = push([device.url], archive, auth, _quiet, 8 << 20)
    total = time.perf_counter() - started
    print(f"\nresume: {held / 1e6:.1f} of {archive.size / 1e6:.1f} MB were kept; the rest took "
          f"{result.upload_seconds:.2f} s, install {result.install_seconds:.2f} s ({total:.2f} s)")  # fmt: skip
    assert result.outcome == "installed", result.detail
    assert result.resumed_from == held
    assert result.sent == archive.size - held
    assert served(device) == fingerprint(bundle_pair[0])
    client.close()


def _wait_for_offset(
    client: AgentClient, upload_id: str, at_least: float, process: object | None = None, timeout: float = 120
) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        offset = client.offset(upload_id)
        if offset >= at_least:
            return offset
        if process is not None and process.poll() is not None:  # type: ignore[attr-defined]
            raise AssertionError("the push finished before it could be interrupted")
        time.sleep(0.01)
    raise AssertionError(f"the upload never reached {at_least:.0f} bytes")


def _quiet(device: str, phase: str, done: int, total: int) -> None:
    pass


class _Traffic:
    """Chat requests back to back on one device, counting answers and failures and the longest gap."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.ok = 0
        self.failures: list[str] = []
        self.fingerprints: set[str] = set()
        self.max_gap = 0.0
        self._asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Start, and return once one answer came back: the swap must land while traffic is already flowing."""
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.ok == 0 and not self.failures and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop after one more answer, so the last one was asked after the swap finished."""
        answered_by_then = self._asked + 1  # the one in flight now may predate the swap; the next one does not
        deadline = time.monotonic() + 60
        while self.ok + len(self.failures) <= answered_by_then and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        with httpx.Client(base_url=self.device.url, timeout=60) as http:
            while not self._stop.is_set():
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
                self._asked += 1
                response = http.post("/v1/chat/completions", json=body)
                now = time.perf_counter()
                if response.status_code == 200:
                    self.ok += 1
                    self.fingerprints.add(response.json()["system_fingerprint"])
                    self.max_gap = max(self.max_gap, now - last)
                    last = now
                else:
                    self.failures.append(f"{response.status_code} {response.text[:200]}")
