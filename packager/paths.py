"""Where `pkg` keeps things: build outputs per function, and a content-addressed cache shared by builds."""

from __future__ import annotations

import os
from pathlib import Path

from packager.spec import FunctionSpec


def build_dir(spec: FunctionSpec) -> Path:
    return Path("build") / spec.name


def bundle_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / "bundle"


def cache_root() -> Path:
    """`$ONNXFN_CACHE_DIR`, else `~/.cache/onnxfn`: dequantized weights and exports keyed by content hash."""
    configured = os.environ.get("ONNXFN_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "onnxfn"
