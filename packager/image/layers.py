"""Reproducible layer blobs: a directory tree → a gzip'd tar whose bytes depend only on the files.

Same files in, same digest out, on any host: entries sorted by path, owners 0:0 with no names, mtimes
clamped to `EPOCH` (files older than it keep theirs, which keeps Debian's timestamp-checked `.pyc`
files valid), no atime/ctime, and gzip with no name and mtime 0. Both digests are computed while
writing: `digest` of the compressed blob (what registries store) and `diff_id` of the tar (what the
image config lists).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
TAR_LAYER = "application/vnd.oci.image.layer.v1.tar"
EPOCH = 1_700_000_000  # 2023-11-14; every entry's mtime is clamped to this
GZIP_LEVEL = 6  # zlib's default: part of the format, since another level gives other bytes


@dataclass(frozen=True)
class Layer:
    """A layer blob on disk with what the manifest and config say about it."""

    path: Path
    digest: str  # sha256:… of the gzip'd blob
    diff_id: str  # sha256:… of the uncompressed tar
    size: int  # bytes of the blob
    tar_size: int  # bytes of the uncompressed tar
    name: str  # which part of the image it holds: os, python-deps, bundle, code
    media_type: str = GZIP_LAYER

    def descriptor(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "path": str(self.path)}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Layer:
        return cls(**{**data, "path": Path(str(data["path"]))})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Entry:
    """One file system object to put in a layer: `source` on this host (None: a plain directory), `target`
    inside the image."""

    source: Path | None
    target: PurePosixPath


def tree_entries(root: Path, target: str) -> Iterator[Entry]:
    """Every object under `root` (root itself included) mapped below `target` inside the image."""
    base = PurePosixPath(target)
    yield Entry(root, base)
    for directory, dirnames, filenames in os.walk(root):
        relative_dir = PurePosixPath(Path(directory).relative_to(root).as_posix())
        for name in dirnames + filenames:
            yield Entry(Path(directory, name), base / relative_dir / name)
        # os.walk lists a symlink to a directory under dirnames without following it: stored as a link.


def write_layer(entries: Iterable[Entry], out: Path, name: str, *, compress: bool = True) -> Layer:
    """Write `entries` (any order, parent directories added) as a reproducible layer blob at `out`.

    `compress=False` stores the tar as is: for model weights, which gzip shrinks by under a third at
    ~10 MB/s here, while an uncompressed layer costs no CPU to build or to unpack at a cold start.
    """
    by_target = {e.target: e for e in entries}
    for target in list(by_target):
        for parent in target.parents:
            by_target.setdefault(parent, Entry(None, parent))
    by_target.pop(PurePosixPath("/"), None)  # the root is the container's, not the layer's
    ordered = sorted(by_target.values(), key=lambda e: e.target.as_posix())
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as raw:
        blob = _HashingWriter(raw)
        if compress:
            with gzip.GzipFile(filename="", mode="wb", fileobj=blob, mtime=0, compresslevel=GZIP_LEVEL) as zipped:
                tar_stream = _HashingWriter(zipped)
                _write_tar(tar_stream, ordered)
        else:
            tar_stream = blob
            _write_tar(tar_stream, ordered)
    return Layer(
        path=out,
        digest=blob.digest(),
        diff_id=tar_stream.digest(),
        size=blob.count,
        tar_size=tar_stream.count,
        name=name,
        media_type=GZIP_LAYER if compress else TAR_LAYER,
    )


def _write_tar(stream: _HashingWriter, entries: list[Entry]) -> None:
    with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        hardlinks: dict[tuple[int, int], str] = {}
        for entry in entries:
            _add(tar, entry, hardlinks)


def _add(tar: tarfile.TarFile, entry: Entry, hardlinks: dict[tuple[int, int], str]) -> None:
    arcname = entry.target.as_posix().lstrip("/")
    info = tarfile.TarInfo(arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.source is None:
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
        tar.addfile(info)
        return
    st = entry.source.lstat()
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = min(int(st.st_mtime), EPOCH)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(entry.source)
    elif stat.S_ISREG(st.st_mode):
        inode = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and inode in hardlinks:
            info.type = tarfile.LNKTYPE
            info.linkname = hardlinks[inode]
        else:
            hardlinks[inode] = arcname
            info.size = st.st_size
            with entry.source.open("rb") as data:
                tar.addfile(info, data)
            return
    else:
        return  # device nodes, sockets, fifos: the container runtime provides /dev
    tar.addfile(info)


class _HashingWriter:
    """A write-only file object that forwards bytes while counting and hashing them."""

    def __init__(self, sink: BinaryIO | gzip.GzipFile) -> None:
        self._sink = sink
        self._hash = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        self.count += len(data)
        self._sink.write(data)
        return len(data)

    def flush(self) -> None:
        self._sink.flush()

    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()
