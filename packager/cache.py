"""A content-addressed directory cache: an entry is complete or absent, never half-written."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packager.paths import cache_root

_COMPLETE_MARK = ".complete"


def digest_of(*parts: Any) -> str:
    """A stable key from JSON-serialisable parts (sorted keys, so dict order never matters)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def cached_dir(kind: str, key: str, produce: Callable[[Path], None]) -> tuple[Path, bool]:
    """Return `(path, reused)` for the entry `kind/key`, calling `produce(tmp_dir)` to make it if absent.

    `produce` writes into a fresh temporary directory that is renamed into place only when it returns,
    so an interrupted build never leaves an entry that looks complete.
    """
    final = cache_root() / kind / key
    if (final / _COMPLETE_MARK).is_file():
        return final, True
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=final.parent))
    try:
        produce(tmp)
        (tmp / _COMPLETE_MARK).write_text(key + "\n")
        if final.exists():  # a stale, incomplete entry from an interrupted run
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, False


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def cached_json(kind: str, key: str, produce: Callable[[], Any]) -> tuple[Any, bool]:
    """Return `(value, reused)` for a JSON result stored under `kind/key.json`."""
    path = cache_root() / kind / f"{key}.json"
    if path.is_file():
        return read_json(path), True
    value = produce()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_json(tmp, value)
    tmp.replace(path)
    return value, False
