"""Bundles the agent must refuse, while the bundle it serves keeps serving."""

from __future__ import annotations

import hashlib
import re
import tarfile
from pathlib import Path

import httpx
import pytest

from packager.edge.client import AgentClient, AgentError, DeviceAuth
from packager.edge.fleet import push
from tests.edge.bundles import tar_bytes
from tests.edge.conftest import MODEL, TOKEN


def _upload_and_install(client: AgentClient, data: bytes, upload_id: str | None = None) -> dict:
    path = Path(client.url.replace("/", "_").replace(":", "_"))
    archive = Path("/tmp") / f"onnxfn-edge-{hashlib.sha256(data).hexdigest()[:12]}-{path.name}.tar"
    archive.write_bytes(data)
    try:
        upload_id = upload_id or hashlib.sha256(data).hexdigest()
        client.upload(archive, upload_id, lambda held: None)
        return client.install(upload_id)
    finally:
        archive.unlink()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def test_refused_bundles_never_replace_the_served_one(devices, workspace, bundle_pair, tmp_path) -> None:
    (device,) = devices(1)
    good = workspace.archive(bundle_pair[0])
    (result,) = push([device.url], good, DeviceAuth(TOKEN), lambda *a: None, 8 << 20)
    assert result.outcome == "installed"
    client = AgentClient(device.url, DeviceAuth(TOKEN))

    # One byte of one file changed, manifest untouched: the agent names the file and keeps serving A.
    with tarfile.open(good.path) as tar:
        entries = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    tampered = [(m, data.replace(b"<|im_start|>", b"<|im_stArt|>", 1) if m.name == "chat_template.jinja" else data)
                for m, data in entries]  # fmt: skip
    with pytest.raises(
        AgentError, match=r"refused the bundle: bundle refused: bundle file chat_template.jinja has sha256"
    ):
        _upload_and_install(client, tar_bytes(tampered))

    outside = tmp_path / "escaped"
    unsafe = [
        ("climbs out with '..'", [_file(f"../../../../../../..{outside}", b"x")]),
        ("has an absolute path", [_file(str(outside), b"x")]),
        # Links are refused whatever they point at: a bundle holds files and folders only.
        ("is a symbolic link (to '/etc/passwd')", [_link("manifest.json", "/etc/passwd", tarfile.SYMTYPE)]),
        ("is a hard link (to '../x')", [_link("model.onnx", "../x", tarfile.LNKTYPE)]),
        ("is a symbolic link (to 'model.onnx')", [_link("manifest.json", "model.onnx", tarfile.SYMTYPE)]),
        ("is a device file or FIFO", [_link("tokenizer.json", "", tarfile.CHRTYPE)]),
        ("is a device file or FIFO", [_link("tokenizer.json", "", tarfile.FIFOTYPE)]),
    ]
    for reason, members in unsafe:
        with pytest.raises(AgentError, match=f"archive refused: archive member .* {re.escape(reason)}"):
            _upload_and_install(client, tar_bytes(members))
    assert not outside.exists()

    # Bytes that do not hash to the upload's id were altered on the way.
    with pytest.raises(AgentError, match="altered in transit"):
        _upload_and_install(client, b"x" * 10240, upload_id="0" * 64)

    status = device.status()
    assert status["health"] == "serving" and status["current"]["digest"] == good.manifest.digest
    assert status["previous"] is None
    codes = [e["code"] for e in status["history"] if e["event"] == "refused"]
    assert codes == ["invalid_bundle"] + ["unsafe_archive"] * len(unsafe) + ["digest_mismatch"]
    assert list((device.root / "staging").iterdir()) == [] and list((device.root / "uploads").iterdir()) == []
    chat = httpx.post(
        f"{device.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["system_fingerprint"] == "fp_" + good.manifest.digest[7:19]

    # Protocol mistakes are 4xx with the OpenAI error shape, never 500.
    headers = {"Authorization": f"Bearer {TOKEN}"}
    bad_range = httpx.put(f"{device.url}/agent/uploads/{'a' * 64}", content=b"x", headers=headers)
    assert bad_range.status_code == 400 and bad_range.json()["error"]["code"] == "invalid_content_range"
    bad_id = httpx.head(f"{device.url}/agent/uploads/nothex", headers=headers)
    assert bad_id.status_code == 400
    gap = httpx.put(
        f"{device.url}/agent/uploads/{'b' * 64}", content=b"x", headers={**headers, "Content-Range": "bytes 5-5/10"}
    )
    assert gap.status_code == 416 and gap.headers["Upload-Offset"] == "0"
    with pytest.raises(AgentError, match="send the rest first"):
        client.install("b" * 64)
    client.close()


def test_a_kv_budget_too_small_for_the_smoke_request_is_refused_naming_the_setting(
    devices, workspace, bundle_pair
) -> None:
    # 1 MiB of KV pool for 8 slots holds 2 tokens of the demo model per request: the smoke request cannot fit.
    (device,) = devices(1, extra_args=["--kv-memory-mb", "1", "--max-batch", "8"])
    (result,) = push([device.url], workspace.archive(bundle_pair[0]), DeviceAuth(TOKEN), lambda *a: None, 8 << 20)
    assert result.outcome == "refused", result
    expected = (
        r"the smoke generation needs \d+ tokens and the context is 2 tokens: \[runtime\] kv_memory_mb "
        r"\(--kv-memory-mb, 1\) holds no more for each of the 8 slots"
    )
    assert re.search(expected, result.detail), result.detail
    assert device.status()["current"] is None
