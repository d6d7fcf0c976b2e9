"""Unpack a bundle archive into a folder so that nothing it names can land outside that folder.

A bundle holds regular files and folders only, so every other member (a symbolic or hard link, a device,
a FIFO) is refused outright, wherever it points: judging a link by its target is what CVE-2025-4517
defeats, tarfile's own `data` filter included before Python 3.11.13. Names are refused when absolute,
when they hold `..` or NUL, when they appear twice, or when a member would need a file to be a folder.
Every member is checked before anything is written, and the reason names the member.

tarfile only reads the archive; the files are written here, without ever resolving a path through the
filesystem: each folder is opened relative to its parent's descriptor with O_NOFOLLOW, and each file is
created in its folder with O_EXCL | O_NOFOLLOW. A link planted by any other route is never followed.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tarfile
import zlib
from pathlib import Path

FILE_MODE = 0o644  # the umask may narrow these; nothing can widen them or add setuid bits
FOLDER_MODE = 0o755
SPACE_MARGIN = 64 << 20  # bytes left free after unpacking: logs and history must still be writable
NAME_MAX = 255  # bytes in one path component, on every filesystem a device is likely to use
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 20
_SHOWN_CHARS = 200  # of a name quoted in a refusal: a PAX name may be megabytes, and history.jsonl keeps it

Parts = tuple[str, ...]  # a member's path, split into its components


class UnsafeArchiveError(Exception):
    """The archive is refused; the message names the member and why."""


def unpack(archive: Path, target: Path) -> int:
    """Extract `archive` (tar, optionally gzipped) into `target`, created if missing; returns bytes written."""
    with archive.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    try:
        # Plain or gzipped, as documented: bz2 would add a decompressor whose errors are bare OSErrors,
        # which could not be told apart from a full disk.
        with tarfile.open(archive, "r:gz" if gzipped else "r:") as tar:
            try:
                members = tar.getmembers()
            except OSError as exc:  # a declared size that seeks past what the filesystem allows: EINVAL
                raise UnsafeArchiveError(f"the archive cannot be read: {exc}") from exc
            plan = check_members(members)
            target.mkdir(parents=True, exist_ok=True)
            _check_space(sum(member.size for member, _ in plan if member.isfile()), target)
            root = os.open(target, _FOLDER_FLAGS)
            try:
                return sum(_write(tar, member, parts, root) for member, parts in plan)
            finally:
                os.close(root)
    # A corrupt gzip stream surfaces from the decompressor, not from tarfile.
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise UnsafeArchiveError(f"the archive is not a readable tar file (plain or gzipped): {exc}") from exc


def check_members(members: list[tarfile.TarInfo]) -> list[tuple[tarfile.TarInfo, Parts]]:
    """The members to write, each with its path's components; raises on the first member refused."""
    seen: set[Parts] = set()
    files: set[Parts] = set()
    folders: set[Parts] = set()  # named by a folder member, or implied as the parent of any member
    plan = []
    for member in members:
        name = member.name
        _check_kind(member)
        parts = _parts(name)
        if not parts:
            if member.isfile():
                raise _refused(name, "is a file with an empty name")
            continue  # `./`, as `tar -C dir .` writes it: the target folder itself
        if parts in seen:
            raise _refused(name, "appears twice in the archive")
        parents = [parts[:depth] for depth in range(1, len(parts))]
        for parent in parents:
            if parent in files:
                raise _refused(name, f"passes through the file {_shown('/'.join(parent))}")
        if member.isfile() and parts in folders:
            raise _refused(name, "is a file, but an earlier member needs it as a folder")
        seen.add(parts)
        (files if member.isfile() else folders).add(parts)
        folders.update(parents)
        plan.append((member, parts))
    return plan


def _check_space(needed: int, target: Path) -> None:
    """Refuse an archive that unpacks to more than the device holds (a gzip bomb, say) before writing a byte:
    the upload's own check counted only the archive's size."""
    free = shutil.disk_usage(target).free - SPACE_MARGIN
    if needed > free:
        raise UnsafeArchiveError(
            f"the archive unpacks to {needed} bytes, but the device has {max(free, 0)} free (after a "
            f"{SPACE_MARGIN >> 20} MiB margin): free space or push a smaller bundle"
        )


def _check_kind(member: tarfile.TarInfo) -> None:
    name = member.name
    if member.issym() or member.islnk():
        kind = "symbolic link" if member.issym() else "hard link"
        raise _refused(name, f"is a {kind} (to {_shown(member.linkname)}): a bundle holds files and folders only")
    if member.isdev() or member.isfifo():
        raise _refused(name, "is a device file or FIFO")
    if not (member.isfile() or member.isdir()):
        raise _refused(name, "is neither a file nor a folder")
    if member.issparse():  # its declared size is not what it writes: the space check below would not hold
        raise _refused(name, "is a sparse file")


def _parts(name: str) -> Parts:
    """`name` split into components, `.` and empty ones dropped: they name the folder they are in."""
    if "\0" in name:
        raise _refused(name, "has a NUL byte in its name")
    if name.startswith("/"):
        raise _refused(name, "has an absolute path")
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if ".." in parts:
        raise _refused(name, "climbs out with '..'")
    if any(len(os.fsencode(part)) > NAME_MAX for part in parts):
        raise _refused(name, f"has a component longer than {NAME_MAX} bytes")
    return parts


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, parts: Parts, root: int) -> int:
    """Create one member under the folder open as `root`; returns the bytes written."""
    if member.isdir():
        os.close(_open_folder(root, parts))
        return 0
    folder = _open_folder(root, parts[:-1])
    try:
        fd = os.open(parts[-1], _FILE_FLAGS, FILE_MODE, dir_fd=folder)
    finally:
        os.close(folder)
    with os.fdopen(fd, "wb") as out:
        data = tar.extractfile(member)
        assert data is not None  # check_members lets through regular files only
        shutil.copyfileobj(data, out, _COPY_CHUNK)
    return member.size


def _open_folder(root: int, parts: Parts) -> int:
    """The folder `parts` below `root`, created where missing, opened one component at a time."""
    fd = os.dup(root)
    for part in parts:
        try:
            with contextlib.suppress(FileExistsError):  # made for an earlier member
                os.mkdir(part, FOLDER_MODE, dir_fd=fd)
            child = os.open(part, _FOLDER_FLAGS, dir_fd=fd)  # O_NOFOLLOW | O_DIRECTORY: a folder, nothing else
        finally:
            os.close(fd)
        fd = child
    return fd


def _refused(name: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"archive member {_shown(name)} {why}")


def _shown(name: str) -> str:
    return repr(name) if len(name) <= _SHOWN_CHARS else repr(name[:_SHOWN_CHARS]) + "..."
