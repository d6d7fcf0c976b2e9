"""The engine's LoRA adapters: the catalog of names it may serve and the slots the graph reads them from.

A request names its adapter; `resolve` (on the submitting thread) turns the name into the adapter's digest and
weights, read once per digest and kept while the catalog has it, so the engine thread only copies weights into a
slot (adapter_slots.py) and a bad or vanished file fails its own request, never a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from runtime.adapters.catalog import AdapterCatalog, CatalogEntry, bundled_entry
from runtime.adapters.files import AdapterFile, AdapterFileError, read_adapter_file
from runtime.adapters.layout import AdapterLayout
from runtime.bundle import Bundle
from runtime.engine.adapter_slots import AdapterSlots, RequestAdapter
from runtime.engine.request import EngineError, UnknownAdapterError


def resolve_adapter(adapters: EngineAdapters | None, name: str | None) -> RequestAdapter | None:
    """The adapter a request names (None: the base model); `UnknownAdapterError` for a name not served here."""
    if name is None:
        return None
    if adapters is None:
        raise UnknownAdapterError(
            f"this model takes no adapters, so {name!r} is not one; declare [[adapters]] in function.toml and rebuild",
            available=(),
        )
    return adapters.resolve(name)


class EngineAdapters:
    def __init__(self, catalog: AdapterCatalog, slots: AdapterSlots) -> None:
        self.catalog = catalog
        self.slots = slots
        self._lock = threading.Lock()
        self._files: dict[str, AdapterFile] = {}  # digest -> weights, for the catalog's entries

    @classmethod
    def for_bundle(cls, bundle: Bundle, max_adapters: int, adapter_dir: Path | None, pool_rows: int) -> EngineAdapters:
        described = bundle.manifest.adapters
        assert described is not None, "only a bundle whose graph takes adapters has them"
        layout = AdapterLayout.from_json(described["layout"])
        files = bundle.manifest.files
        bundled = [
            bundled_entry(name, bundle.file(file), "sha256:" + files[file].sha256, files[file].size)
            for name, file in sorted(described.get("bundled", {}).items())
        ]
        return cls(AdapterCatalog(layout, bundled, adapter_dir), AdapterSlots(layout, max_adapters, pool_rows))

    def resolve(self, name: str) -> RequestAdapter:
        entry = self.catalog.get(name)
        if entry is None:
            available = tuple(self.catalog.names())
            raise UnknownAdapterError(
                f"this server has no adapter {name!r}; available: {', '.join(available) or 'none'}",
                available=available,
            )
        return RequestAdapter(name, entry.digest, self._weights(entry))

    def remove(self, name: str, on_engine_thread: Callable[[Callable[[], None]], None]) -> None:
        """Take `name` out of the catalog and drop its weights; its slot frees once no request holds it."""
        entry = self.catalog.remove(name)
        with self._lock:
            self._files.pop(entry.digest, None)
        on_engine_thread(lambda: self.slots.forget(entry.digest))

    def _weights(self, entry: CatalogEntry) -> AdapterFile:
        with self._lock:
            cached = self._files.get(entry.digest)
        if cached is not None:
            return cached
        try:
            weights = read_adapter_file(entry.path)
        except AdapterFileError as exc:
            raise EngineError(f"adapter {entry.name!r} cannot be read: {exc}") from exc
        with self._lock:
            live = {e.digest for e in self.catalog.entries()}
            self._files = {d: w for d, w in self._files.items() if d in live}
            self._files[entry.digest] = weights
        return weights
