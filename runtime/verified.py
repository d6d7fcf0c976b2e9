"""Hash a bundle once, then trust a stat check on later starts.

Hashing the 270 MB of the demo's weights costs more than the rest of a cold start. After a full
verification the runtime records each file's identity (size, device, inode, mtime in ns) under the
manifest's digest; a later start whose files still carry those identities skips the hashing. Writing
to a file changes its mtime and replacing it changes its inode, so an altered file fails the check,
is hashed again and refused. ctime is left out on purpose: hard-linking a file (the image builder
links bundle files into its layer) changes it without touching the content. The check guards against
corruption and accidental edits; someone able to rewrite a file and set its mtime back could also
rewrite the record, which lives with the runtime's state (`$ONNXFN_STATE_DIR`, default `~/.cache/onnxfn`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from runtime.bundle import Bundle, Manifest, read_manifest, verify_files

RECORD_DIR_ENV = "ONNXFN_STATE_DIR"
log = logging.getLogger("runtime.bundle")


def default_record_dir() -> Path:
    configured = os.environ.get(RECORD_DIR_ENV)
    base = Path(configured) if configured else Path.home() / ".cache" / "onnxfn"
    return base / "verified"


def open_verified(path: str | Path, record_dir: Path | None = None) -> tuple[Bundle, bool]:
    """Open the bundle at `path`, hashing its files unless a record shows they are unchanged since last time.

    Returns the bundle and whether it was hashed now. Raises `BundleError` for a bundle that fails.
    """
    root = Path(path)
    manifest = read_manifest(root)
    record = (record_dir or default_record_dir()) / f"{manifest.digest.removeprefix('sha256:')}.json"
    identities = _identities(root, manifest)
    if identities is not None and _read(record) == identities:
        return Bundle(path=root, manifest=manifest), False
    verify_files(root, manifest)
    _write(record, _identities(root, manifest))
    return Bundle(path=root, manifest=manifest), True


def _identities(root: Path, manifest: Manifest) -> dict[str, list[int]] | None:
    """Each listed file's identity, or None when one is missing (full verification says which).

    Folders count too: a file added beside the listed ones changes its folder's mtime.
    """
    folders = {Path(name).parent.as_posix() for name in manifest.files}
    out: dict[str, list[int]] = {}
    try:
        for name in sorted(folders):
            out[f"{name}/"] = file_identity(root / name)
        for name in sorted(manifest.files):
            out[name] = file_identity(root / name)
    except OSError:
        return None
    return out


def file_identity(path: Path) -> list[int]:
    """What changes when a file is written or replaced (see the module docstring for why not ctime)."""
    st = path.lstat()
    return [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns]


def _read(record: Path) -> object:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return None


def _write(record: Path, identities: dict[str, list[int]] | None) -> None:
    """Best effort: a read-only home only means the next start hashes again."""
    if identities is None:
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(identities))
        tmp.replace(record)
    except OSError as exc:
        log.info("cannot record the bundle's verification in %s (%s): the next start hashes it again", record, exc)
