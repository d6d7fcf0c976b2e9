"""Hostile pushes from issue 37, performed for real: a tar built here, sent over HTTP to a real agent.

Each test snapshots what lies outside the bundle root before the attack (a sentinel file, the names in
every folder up to the test's tmp folder) and checks that nothing there changed, and that the bundle
served before the attack is still the one served after it.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import httpx

from packager.edge.client import DeviceAuth
from packager.edge.fleet import push
from tests.edge.bundles import tar_bytes
from tests.edge.conftest import MODEL, TOKEN, Device

HEADERS = {"Authorization": f"Bearer {TOKEN}"}
SENTINEL = b"precious: the attack must not change this file\n"
# The install unpacks into ROOT/staging/ + tempfile.mkdtemp(prefix="incoming-"), whose suffix is 8 characters.
STAGING_SUFFIX = "/staging/incoming-XXXXXXXX"


def test_realpath_overflow_archive_cannot_escape(devices, workspace, bundle_pair, tmp_path) -> None:
    """CVE-2025-4517: links that only resolve past PATH_MAX defeat a realpath check such as tarfile's."""
    device, digest = _serving_device(devices, workspace, bundle_pair)
    sentinel, before = _outside(device, tmp_path)
    archive = tar_bytes(_realpath_overflow_members(len(str(device.root)) + len(STAGING_SUFFIX)))

    response = _push_raw(device, archive)

    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "unsafe_archive"
    # The first link of the chain is named: every link is refused, before a single byte is written.
    message = response.json()["error"]["message"]
    assert "archive member 'a' is a symbolic link" in message
    assert len(message) < 1000  # the 4,000-character link target is cut short
    _assert_untouched(device, digest, sentinel, before)


def test_symlink_chain_archive_cannot_escape(devices, workspace, bundle_pair, tmp_path) -> None:
    """`d/s -> ..` then `d/s/t -> ..`: each link looks harmless on its own, together they climb out."""
    device, digest = _serving_device(devices, workspace, bundle_pair)
    sentinel, before = _outside(device, tmp_path)
    archive = tar_bytes(
        [
            _folder("d"),
            _symlink("d/s", ".."),
            _symlink("d/s/t", ".."),
            _symlink("d/s/t/u", ".."),
            _symlink("d/s/t/u/v", ".."),
            _file("d/s/t/u/v/escaped", b"written outside the bundle root"),
            _file(f"d/s/t/u/v/{sentinel.name}", b"overwritten"),
        ]
    )

    response = _push_raw(device, archive)

    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "unsafe_archive"
    assert "archive member 'd/s' is a symbolic link" in response.json()["error"]["message"]
    _assert_untouched(device, digest, sentinel, before)


def test_absurd_content_range_is_a_400(devices, tmp_path) -> None:
    """5,000 digits overflow int()'s digit limit (a ValueError, once a 500); 10**19 is bounded too."""
    (device,) = devices(1)
    url = f"{device.url}/agent/uploads/{'a' * 64}"
    for header in ("bytes 0-0/" + "9" * 5000, "bytes " + "1" * 5000 + "-0/1", "bytes 0-0/" + "1" + "0" * 19):
        response = httpx.put(url, content=b"x", headers={**HEADERS, "Content-Range": header})
        assert response.status_code == 400, (header[:40], response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["code"] == "invalid_content_range" and error["type"] == "invalid_request_error"
    # Large but in bounds: a plain refusal of the size, still no 5xx.
    big = httpx.put(url, content=b"x", headers={**HEADERS, "Content-Range": f"bytes 0-0/{10**18}"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "too_large"
    assert list((device.root / "uploads").iterdir()) == []
    assert httpx.get(f"{device.url}/agent/status", headers=HEADERS).status_code == 200


def test_upload_id_with_a_trailing_newline_is_a_400(devices) -> None:
    """`^...$` admits a final newline; the id names files in uploads/, so it must match exactly."""
    (device,) = devices(1)
    url = f"{device.url}/agent/uploads/{'a' * 64}%0A"
    put = httpx.put(url, content=b"x", headers={**HEADERS, "Content-Range": "bytes 0-0/1"})
    assert put.status_code == 400, put.text
    assert put.json()["error"]["code"] == "invalid_id"
    assert httpx.head(url, headers=HEADERS).status_code == 400
    install = httpx.post(f"{url}/install", headers=HEADERS)
    assert install.status_code == 400 and install.json()["error"]["code"] == "invalid_id"
    assert list((device.root / "uploads").iterdir()) == []


def _realpath_overflow_members(staging_len: int) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    """CPython's test_realpath_limit_attack (Lib/test/test_tarfile.py), aimed past the bundle root.

    Folders of long names, each reachable through a one-letter link, so that `a/b/.../p` is short but
    its real path nearly fills PATH_MAX. The link `a/.../p/lll...` then points back up to the staging
    folder, but realpath() cannot see that: expanding it overflows PATH_MAX and a non-strict realpath
    carries on lexically, so `escape -> a/.../p/lll.../../../..` looks like it stays inside. The kernel
    resolves it to the folder above the bundle root, where a hard link and a plain file then land.
    """
    steps = "abcdefghijklmnop"
    path_max = os.pathconf("/", "PC_PATH_MAX")
    component = "d" * ((path_max - staging_len - 1) // (len(steps) + 1))
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    path = ""
    for step in steps:
        members.append(_folder(os.path.join(path, component)))
        members.append(_symlink(os.path.join(path, step), component))
        path = os.path.join(path, component)
    link = os.path.join(*steps, "l" * 254)
    members.append(_symlink(link, os.path.join(*[".."] * len(steps))))  # back to the staging folder
    # Up from staging: ROOT/staging, ROOT, then the folder that holds ROOT (and the sentinel).
    members.append(_symlink("escape", os.path.join(link, "..", "..", "..")))
    members.append(_hardlink("flaglink", "escape/sentinel"))
    members.append(_file("flaglink", b"overwritten through a hard link"))
    members.append(_file("escape/newfile", b"created outside the bundle root"))
    return members


def _serving_device(devices, workspace, bundle_pair) -> tuple[Device, str]:
    (device,) = devices(1)
    good = workspace.archive(bundle_pair[0])
    (result,) = push([device.url], good, DeviceAuth(TOKEN), lambda *a: None, 8 << 20)
    assert result.outcome == "installed"
    return device, good.manifest.digest


def _push_raw(device: Device, archive: bytes) -> httpx.Response:
    """The attack as a client would send it: one PUT of the whole archive, then the install."""
    upload_id = hashlib.sha256(archive).hexdigest()
    put = httpx.put(
        f"{device.url}/agent/uploads/{upload_id}",
        content=archive,
        headers={**HEADERS, "Content-Range": f"bytes 0-{len(archive) - 1}/{len(archive)}"},
    )
    assert put.status_code == 204, put.text
    return httpx.post(f"{device.url}/agent/uploads/{upload_id}/install", headers=HEADERS, timeout=120)


def _outside(device: Device, tmp_path: Path) -> tuple[Path, dict[Path, set[str]]]:
    """A sentinel beside the bundle root, and the names in the root and in the two folders above it.

    Higher folders are shared with other pytest sessions, whose files come and go on their own.
    """
    assert device.root.parent == tmp_path
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(SENTINEL)
    return sentinel, {folder: set(os.listdir(folder)) for folder in (device.root, tmp_path, tmp_path.parent)}


def _assert_untouched(device: Device, digest: str, sentinel: Path, before: dict[Path, set[str]]) -> None:
    assert sentinel.read_bytes() == SENTINEL
    assert sentinel.stat().st_nlink == 1  # no hard link to it was made, even one deleted since
    for folder, names in before.items():
        assert set(os.listdir(folder)) == names, folder
    assert list((device.root / "staging").iterdir()) == []
    assert list((device.root / "uploads").iterdir()) == []
    status = device.status()
    assert status["health"] == "serving" and status["current"]["digest"] == digest
    assert status["history"][-1]["code"] == "unsafe_archive"
    chat = httpx.post(
        f"{device.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["system_fingerprint"] == "fp_" + digest[7:19]


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    return info, data


def _folder(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o777
    return info, None


def _symlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


def _hardlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info, None
