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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from runtime.adapters.files import SUFFIX, AdapterFileError, AdapterMisfit, verify_adapter_file
from runtime.adapters.layout import NAME, NAME_RULE, AdapterLayout
from runtime.bundle import file_digest


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    path: Path
    digest: str  # sha256:…, of the file: what the prefix cache and the slots key the adapter by
    size: int
    bundled: bool  # shipped in the bundle (removed only by a rebuild)


@dataclass
class IncomingAdapter:
    """An upload being written: its bytes so far, hashed as they go."""

    path: Path
    file: BinaryIO
    size: int = 0
    _hash: Any = field(default_factory=hashlib.sha256)

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


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
                    digest = file_digest(path)  # a chunk at a time: an adapter may be hundreds of MB
                    self._entries[name] = CatalogEntry(
                        name, path, "sha256:" + digest.sha256, digest.size, bundled=False
                    )

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
        with self.incoming() as incoming:
            incoming.write(data)
            return self.add_file(name, incoming, digest)

    @contextmanager
    def incoming(self) -> Iterator[IncomingAdapter]:
        """A file in the adapter directory to stream an upload into (hashed as it is written), so a large one is
        never held in memory; `add_file` verifies and renames it, and it is removed if not added."""
        if self.directory is None:
            raise AdapterFileError("this server has no adapter directory (--adapter-dir), so it cannot add adapters")
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".incoming-", suffix=SUFFIX)
        incoming = IncomingAdapter(Path(tmp), os.fdopen(fd, "wb"))
        try:
            yield incoming
        finally:
            incoming.file.close()
            incoming.path.unlink(missing_ok=True)

    def add_file(self, name: str, incoming: IncomingAdapter, digest: str | None = None) -> CatalogEntry:
        """`add` for bytes already streamed into `incoming`: verified one tensor at a time, then renamed."""
        if not NAME.match(name):
            raise AdapterFileError(f"adapter name {name!r} is not valid: {NAME_RULE}")
        actual = incoming.digest
        if digest is not None and digest != actual:
            raise AdapterFileError(f"the adapter's bytes hash to {actual}, not the {digest} sent with them; resend")
        incoming.file.flush()
        os.fsync(incoming.file.fileno())
        try:
            verify_adapter_file(incoming.path, self.layout, label=f"{name!r}")
        except AdapterMisfit as exc:
            raise AdapterFileError(
                f"adapter {name!r} does not fit this bundle: {exc}; declare it under [[adapters]] in "
                "function.toml (or widen [export] adapter_rank / adapter_modules) and rebuild"
            ) from None
        assert self.directory is not None  # `incoming` needs it
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None and existing.bundled:
                raise AdapterFileError(f"{name!r} is one of the bundle's adapters; add it under another name")
            path = self.directory / f"{name}{SUFFIX}"
            os.replace(incoming.path, path)
            entry = self._entries[name] = CatalogEntry(name, path, actual, incoming.size, bundled=False)
        return entry

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


def bundled_entry(name: str, path: Path, digest: str, size: int) -> CatalogEntry:
    return CatalogEntry(name, path, digest, size, bundled=True)
