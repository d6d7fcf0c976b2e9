"""Unpack a bundle archive into a fresh folder, refusing any member that could write outside it.

A bundle holds regular files and folders only. Every member is checked before anything is written, so a
refused archive leaves nothing behind, and the reason names the member: an absolute path, a `..`
component, a link (symbolic or hard) pointing outside the folder, a device file or FIFO. tarfile's
`data` filter then extracts with the same rules enforced again (and modes stripped of setuid bits).
"""

from __future__ import annotations

import posixpath
import tarfile
from pathlib import Path, PurePosixPath


class UnsafeArchiveError(Exception):
    """The archive is refused; the message names the member and why."""


def unpack(archive: Path, target: Path) -> int:
    """Extract `archive` (tar, optionally gzip) into the empty folder `target`; returns the bytes written."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for member in members:
                check_member(member)
            total = sum(m.size for m in members if m.isfile())
            tar.extractall(target, filter="data")
    except tarfile.FilterError as exc:  # the checks above make this unreachable; kept as a second line
        raise UnsafeArchiveError(f"archive member refused by tarfile's data filter: {exc}") from exc
    except (tarfile.TarError, EOFError) as exc:
        raise UnsafeArchiveError(f"the archive is not a readable tar file: {exc}") from exc
    return total


def check_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        raise UnsafeArchiveError(f"archive member {name!r} has an absolute path")
    if ".." in PurePosixPath(name).parts:
        raise UnsafeArchiveError(f"archive member {name!r} climbs out with '..'")
    if member.isdev() or member.isfifo():
        raise UnsafeArchiveError(f"archive member {name!r} is a device file or FIFO")
    if member.issym() or member.islnk():
        kind = "symbolic link" if member.issym() else "hard link"
        link = member.linkname
        # A symlink resolves from its own folder; a hard link's name is relative to the archive root.
        base = posixpath.dirname(name) if member.issym() else ""
        resolved = posixpath.normpath(posixpath.join(base, link))
        if link.startswith("/") or resolved == ".." or resolved.startswith("../"):
            raise UnsafeArchiveError(f"archive member {name!r} is a {kind} to {link!r}, outside the bundle")
    elif not (member.isfile() or member.isdir()):
        raise UnsafeArchiveError(f"archive member {name!r} is neither a file nor a folder")
