"""The agent's bundle root on disk, laid out so that a SIGKILL at any instant leaves a servable state.

```
ROOT/uploads/ID.part, ID.json    archives being received (ID = the archive's sha256)
ROOT/staging/NAME-XXXX/          an archive being unpacked and verified (deleted at start: never complete)
ROOT/bundles/NAME/               complete, verified bundles (NAME = the manifest digest's first 16 hex digits)
ROOT/current -> bundles/NAME     what is served
ROOT/previous -> bundles/NAME    what `rollback` returns to
ROOT/verified/                   the runtime's hash records (`runtime.verified`), so a restart skips rehashing
ROOT/adapters/NAME.safetensors   LoRA adapters added without a bundle (`pkg adapter add --device`), kept across
                                 swaps: written by the served runtime (temporary name, fsync, rename)
```

A folder only enters `bundles/` by rename(2) after every file in it was fsynced, and `current` only ever
names such a folder: it is replaced by renaming a new symlink over it, so a reader sees the old link or
the new one, never neither. `previous` is written before `current`; a crash between the two leaves both
naming the old bundle, which is still complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

CURRENT = "current"
PREVIOUS = "previous"
_POINTERS = (CURRENT, PREVIOUS)
_TENSORRT_CACHE_SUFFIX = "-tensorrt-cache"  # runtime.engine.providers.TensorRTCache.beside names it so


class BundleRoot:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.uploads = root / "uploads"
        self.staging = root / "staging"
        self.bundles = root / "bundles"
        self.verified = root / "verified"
        self.history_file = root / "history.jsonl"
        self.adapters = root / "adapters"

    def prepare(self) -> None:
        """Create the folders and drop what a crash can leave behind: half-unpacked folders and temp links."""
        for folder in (self.uploads, self.staging, self.bundles, self.verified, self.adapters):
            folder.mkdir(parents=True, exist_ok=True)
        for leftover in self.staging.iterdir():
            _remove(leftover)
        for leftover in self.adapters.glob(".incoming-*"):  # an adapter a crash cut short (runtime.adapters.catalog)
            leftover.unlink(missing_ok=True)
        for leftover in self.root.glob(".*.tmp-*"):
            leftover.unlink(missing_ok=True)
        self.collect_garbage()

    def pointer(self, name: str) -> Path | None:
        """The bundle folder `current` or `previous` names, or None when unset or dangling."""
        link = self.root / name
        if not link.is_symlink():
            return None
        target = (self.root / os.readlink(link)).resolve()
        return target if target.is_dir() and target.parent == self.bundles.resolve() else None

    def bundle_path(self, name: str) -> Path:
        return self.bundles / name

    def new_staging(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.staging))

    def commit(self, staging: Path, name: str) -> Path:
        """Move a verified staging folder into `bundles/` (replacing an orphan of the same name)."""
        _fsync_tree(staging)
        target = self.bundle_path(name)
        if target.exists():
            _remove(target)
        staging.rename(target)
        _fsync_dir(self.bundles)
        return target

    def switch(self, new: Path) -> None:
        """`previous` := the bundle served so far, then `current` := `new`."""
        old = self.pointer(CURRENT)
        if old is not None and old != new.resolve():
            self._point(PREVIOUS, old)
        self._point(CURRENT, new)

    def swap_with_previous(self) -> None:
        """Rollback's switch: `current` and `previous` trade places."""
        old, back = self.pointer(CURRENT), self.pointer(PREVIOUS)
        if old is None or back is None:
            raise FileNotFoundError("rollback needs both a current and a previous bundle")
        self._point(PREVIOUS, old)
        self._point(CURRENT, back)

    def collect_garbage(self) -> None:
        """Delete bundles (and their TensorRT caches) that neither `current` nor `previous` names."""
        keep = {p.name for p in map(self.pointer, _POINTERS) if p is not None}
        for entry in self.bundles.iterdir():
            bundle_name = entry.name.removeprefix(".").removesuffix(_TENSORRT_CACHE_SUFFIX)
            if bundle_name not in keep:
                _remove(entry)

    def _point(self, name: str, target: Path) -> None:
        relative = os.path.relpath(target, self.root)
        tmp = self.root / f".{name}.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(relative, target_is_directory=True)
        os.replace(tmp, self.root / name)
        _fsync_dir(self.root)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder under `root`: after the rename, a power cut must not leave holes."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
