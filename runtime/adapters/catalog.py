"""The adapters a server may serve, by name: the bundle's own, and those added while it runs.

Added adapters live as files in a directory of their own (written to a temporary name, then renamed, so a
crash never leaves half a file under an adapter's name), so they survive a restart of the server. The
catalog changes from request threads; the engine reads an entry once, when a request is submitted.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from runtime.adapters.files import SUFFIX, AdapterFile, AdapterFileError, misfit, read_adapter_file
from runtime.adapters.layout import NAME, NAME_RULE, AdapterLayout


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    path: Path
    digest: str  # sha256:…, of the file: what the prefix cache and the slots key the adapter by
    size: int
    bundled: bool  # shipped in the bundle (removed only by a rebuild)


class AdapterCatalog:
    def __init__(self, layout: AdapterLayout, bundled: list[CatalogEntry], directory: Path | None) -> None:
        self.layout = layout
        self.directory = directory
        self._lock = threading.Lock()
        self._entries = {e.name: e for e in bundled}
        if directory is not None and directory.is_dir():
            for path in sorted(directory.glob(f"*{SUFFIX}")):
                name = path.name.removesuffix(SUFFIX)
                if NAME.match(name) and name not in self._entries:
                    self._entries[name] = _entry(name, path.read_bytes(), path, bundled=False)

    def get(self, name: str) -> CatalogEntry | None:
        with self._lock:
            return self._entries.get(name)

    def entries(self) -> list[CatalogEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]

    def add(self, name: str, data: bytes, digest: str | None = None) -> CatalogEntry:
        """Verify and store an adapter file's bytes under `name` (replacing an added one of that name).

        `digest`: what the sender says the bytes hash to; a mismatch is a transfer error, nothing is stored.
        """
        if not NAME.match(name):
            raise AdapterFileError(f"adapter name {name!r} is not valid: {NAME_RULE}")
        if self.directory is None:
            raise AdapterFileError("this server has no adapter directory (--adapter-dir), so it cannot add adapters")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest is not None and digest != actual:
            raise AdapterFileError(f"the adapter's bytes hash to {actual}, not the {digest} sent with them; resend")
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".incoming-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            self._check(read_adapter_file(Path(tmp)), name)
            with self._lock:
                existing = self._entries.get(name)
                if existing is not None and existing.bundled:
                    raise AdapterFileError(f"{name!r} is one of the bundle's adapters; add it under another name")
                path = self.directory / f"{name}{SUFFIX}"
                os.replace(tmp, path)
                entry = self._entries[name] = CatalogEntry(name, path, actual, len(data), bundled=False)
            return entry
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def remove(self, name: str) -> CatalogEntry:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise KeyError(name)
            if entry.bundled:
                raise AdapterFileError(f"{name!r} is one of the bundle's adapters; remove it from function.toml")
            del self._entries[name]
            entry.path.unlink(missing_ok=True)
            return entry

    def _check(self, adapter: AdapterFile, name: str) -> None:
        problem = misfit(adapter, self.layout)
        if problem is not None:
            raise AdapterFileError(
                f"adapter {name!r} does not fit this bundle: {problem}; declare it under [[adapters]] in "
                "function.toml (or widen [export] adapter_rank / adapter_modules) and rebuild"
            )


def bundled_entry(name: str, path: Path, digest: str, size: int) -> CatalogEntry:
    return CatalogEntry(name, path, digest, size, bundled=True)


def _entry(name: str, data: bytes, path: Path, *, bundled: bool) -> CatalogEntry:
    return CatalogEntry(name, path, "sha256:" + hashlib.sha256(data).hexdigest(), len(data), bundled)
