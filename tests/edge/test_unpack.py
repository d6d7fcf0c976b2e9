"""The agent's unpack on its own: which members it refuses, and what it writes for the ones it keeps.

No agent or namespace here; `test_hostile_pushes.py` sends the escaping archives to a real agent.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from runtime.agent.unpack import UnsafeArchiveError, unpack
from tests.edge.bundles import tar_bytes


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def _member(name: str, kind: bytes, linkname: str = "", mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info, None


def _unpack(tmp_path: Path, entries: list, *, gzipped: bool = False) -> Path:
    data = tar_bytes(entries)
    archive = tmp_path / "archive.tar"
    archive.write_bytes(gzip.compress(data) if gzipped else data)
    target = tmp_path / "out"
    unpack(archive, target)
    return target


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ([_member("inside", tarfile.SYMTYPE, "model.onnx")], "'inside' is a symbolic link"),
        ([_file("model.onnx"), _member("alias", tarfile.LNKTYPE, "model.onnx")], "'alias' is a hard link"),
        ([_member("pipe", tarfile.FIFOTYPE)], "'pipe' is a device file or FIFO"),
        ([_member("disk", tarfile.BLKTYPE)], "'disk' is a device file or FIFO"),
        ([_member("cont", b"7")], None),  # CONTTYPE: tarfile reads it as a regular file; kept
        ([_file("a/../b")], "'a/../b' climbs out with '..'"),
        ([_file("/etc/cron.d/x")], "'/etc/cron.d/x' has an absolute path"),
        ([_file("model.onnx"), _file("model.onnx", b"second")], "'model.onnx' appears twice"),
        ([_file("a/b"), _file("./a//b")], "'./a//b' appears twice"),
        ([_member("d", tarfile.DIRTYPE), _member("d/", tarfile.DIRTYPE)], "'d' appears twice"),  # tarfile drops the /
        ([_file("f"), _file("f/g")], "'f/g' passes through the file 'f'"),
        ([_file("f"), _member("f/g", tarfile.DIRTYPE)], "'f/g' passes through the file 'f'"),
        ([_file("a/b"), _file("a")], "'a' is a file, but an earlier member needs it as a folder"),
        ([_file("."), _file("x")], "'.' is a file with an empty name"),
        ([_file("a" * 256)], "has a component longer than 255 bytes"),
    ],
)
def test_refused_members(tmp_path: Path, entries: list, reason: str | None) -> None:
    if reason is None:
        _unpack(tmp_path, entries)
        return
    with pytest.raises(UnsafeArchiveError, match=f"archive member .*{reason}"):
        _unpack(tmp_path, entries)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_nul_in_a_pax_name_is_refused(tmp_path: Path) -> None:
    info, data = _file("a")
    info.pax_headers = {"path": "model.onnx\0/../../x"}
    archive = tmp_path / "archive.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(data))
    with tarfile.open(archive) as tar:
        name = tar.getmembers()[0].name
    if "\0" not in name:
        pytest.skip(f"this Python's tarfile cuts PAX names at NUL ({name!r})")
    with pytest.raises(UnsafeArchiveError, match="NUL byte"):
        unpack(archive, tmp_path / "out")


def test_writes_plain_files_and_folders_with_sane_modes(tmp_path: Path) -> None:
    entries = [
        _member("./", tarfile.DIRTYPE),  # `tar -C dir .` names the root itself: skipped
        _member("tok", tarfile.DIRTYPE, mode=0o7777),
        _file("tok/vocab.json", b"{}", mode=0o6777),
        _file("deep/er/model.onnx", b"weights"),
        _file("empty", b""),
    ]
    target = _unpack(tmp_path, entries, gzipped=True)
    assert (target / "tok/vocab.json").read_bytes() == b"{}"
    assert (target / "deep/er/model.onnx").read_bytes() == b"weights"
    assert (target / "empty").read_bytes() == b""
    umask = os.umask(0)
    os.umask(umask)
    for path, mode in [("tok", 0o755), ("deep/er", 0o755), ("tok/vocab.json", 0o644), ("empty", 0o644)]:
        assert stat.S_IMODE((target / path).stat().st_mode) == mode & ~umask, path


def test_a_link_planted_in_the_target_is_not_followed(tmp_path: Path) -> None:
    """Defence in depth: even a link that reached the target some other way is never written through."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "out"
    target.mkdir()
    (target / "tok").symlink_to(outside)
    archive = tmp_path / "archive.tar"
    archive.write_bytes(tar_bytes([_file("tok/vocab.json")]))
    with pytest.raises(OSError):
        unpack(archive, target)
    (target / "tok").unlink()
    (target / "model.onnx").symlink_to(outside / "model.onnx")
    archive.write_bytes(tar_bytes([_file("model.onnx")]))
    with pytest.raises(FileExistsError):
        unpack(archive, target)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("data", [b"", b"not a tar at all" * 64, gzip.compress(b"\0" * 100)[:-12]])
def test_unreadable_archives_are_refused(tmp_path: Path, data: bytes) -> None:
    archive = tmp_path / "archive.tar"
    archive.write_bytes(data)
    with pytest.raises(UnsafeArchiveError, match="not a readable tar file"):
        unpack(archive, tmp_path / "out")


def test_an_archive_larger_than_the_free_space_is_refused_before_writing(tmp_path: Path) -> None:
    # A bomb's headers declare what it unpacks to: here 10 TB of zeros (the archive file is sparse here; a
    # gzipped one would be ~10 GB on the wire, as well within --max-upload-mb).
    member = tarfile.TarInfo("model.onnx.data")
    member.size = 10**13
    archive = tmp_path / "bomb.tar"
    archive.write_bytes(member.tobuf(format=tarfile.PAX_FORMAT))
    os.truncate(archive, archive.stat().st_size + member.size + 1024)
    target = tmp_path / "staging"
    with pytest.raises(UnsafeArchiveError, match=r"unpacks to 10000000000000 bytes, but the device has \d+ free"):
        unpack(archive, target)
    assert list(target.iterdir()) == []
    member.size = 10**15  # past ext4's largest file: reading the archive fails with EINVAL, a refusal too
    archive.write_bytes(member.tobuf(format=tarfile.PAX_FORMAT))
    with pytest.raises(UnsafeArchiveError, match="cannot be read|not a readable tar"):
        unpack(archive, target)


def test_a_sparse_member_is_refused(tmp_path: Path) -> None:
    member = tarfile.TarInfo("weights.bin")
    member.type = tarfile.GNUTYPE_SPARSE
    archive = tmp_path / "sparse.tar"
    archive.write_bytes(member.tobuf(format=tarfile.GNU_FORMAT))
    with pytest.raises(UnsafeArchiveError, match="'weights.bin'"):
        unpack(archive, tmp_path / "staging")
