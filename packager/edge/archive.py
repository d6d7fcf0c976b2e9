"""The bundle as one reproducible tar archive: the unit an agent receives, named by its sha256.

Members are sorted, with fixed owner, mode and mtime, so the same bundle always gives the same bytes and
the same upload id: an interrupted push resumes even after the archive was rebuilt. Uncompressed: the
weights barely compress and a device should not spend its CPU on inflating them.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from packager.errors import UserError
from runtime.bundle import BundleError, Manifest, file_digest, open_bundle, read_manifest


@dataclass(frozen=True)
class BundleArchive:
    path: Path
    sha256: str  # the upload id
    size: int
    manifest: Manifest


def archive_bundle(bundle: Path, out_dir: Path) -> BundleArchive:
    """`out_dir/<manifest digest>.tar`, written once per bundle (an existing one is reused)."""
    try:
        manifest = read_manifest(bundle)
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first with `pkg build`") from exc
    target = out_dir / f"{manifest.digest.removeprefix('sha256:')[:16]}.tar"
    if not target.is_file():
        try:
            open_bundle(bundle)  # never ship files that do not match their manifest
        except BundleError as exc:
            raise UserError(f"refusing to push {bundle}: {exc}") from exc
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp-{os.getpid()}")
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
                tar.add(path, arcname=path.relative_to(bundle).as_posix(), recursive=False, filter=_normalized)
        tmp.replace(target)
    return BundleArchive(target, file_digest(target).sha256, target.stat().st_size, manifest)


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o644
    return info
