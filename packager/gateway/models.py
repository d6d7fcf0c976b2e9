"""The gateway's model cards: one per function, and one per adapter it serves, without waking it.

An adapter is a model `FUNCTION:ADAPTER` whose card names the function as its `parent`, as the function's own
server lists it (runtime/http/adapters.py). The gateway reads the adapters from what is on disk, so an idle
function's are listed too: the ones its bundle ships (its manifest, read once per bundle) and the ones added
with `pkg adapter add` (files in the server's `--adapter-dir`, which it reads at start and which its adapter
routes keep current).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packager.gateway.functions import Function
from packager.runtime_flags import adapter_dir_of
from runtime.bundle import BundleError, read_manifest

ADAPTER_SUFFIX = ".safetensors"  # runtime.adapters.files.SUFFIX (that module loads numpy and safetensors)
_bundled: dict[tuple[str, str], tuple[str, ...]] = {}  # (bundle, digest) -> the adapters its manifest ships


def cards(function: Function) -> list[dict[str, Any]]:
    """The function's card, then its adapters' in name order."""
    return [card(function), *(card(function, name) for name in adapters(function))]


def card(function: Function, adapter: str | None = None) -> dict[str, Any]:
    created = int(function.deployment.started_at)
    found: dict[str, Any] = {"id": function.name, "object": "model", "created": created, "owned_by": "onnxfn"}
    if adapter is not None:
        found["id"] = f"{function.name}:{adapter}"
        found["parent"] = function.name
    return found


def adapters(function: Function) -> list[str]:
    names = set(_bundled_adapters(function))
    folder = adapter_dir_of(function.deployment.command)
    if folder is not None and folder.is_dir():
        names.update(p.name.removesuffix(ADAPTER_SUFFIX) for p in folder.glob(f"[!.]*{ADAPTER_SUFFIX}"))
    return sorted(names)


def _bundled_adapters(function: Function) -> tuple[str, ...]:
    key = (function.deployment.bundle, function.deployment.bundle_digest)
    if key not in _bundled:
        try:
            manifest = read_manifest(Path(key[0]))
        except BundleError:
            return ()  # moved or rebuilt under it: `pkg status` says so; the function's card is still listed
        _bundled[key] = tuple(sorted((manifest.adapters or {}).get("bundled") or {}))
    return _bundled[key]
