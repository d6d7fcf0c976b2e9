"""Where `pkg` keeps things: build outputs per function, a content-addressed cache shared by builds, and the
per-user state of what runs on this machine."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from packager.private_state import private_dir
from packager.spec import FunctionSpec


def build_dir(spec: FunctionSpec) -> Path:
    return Path("build") / spec.name


def bundle_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / "bundle"


def cache_root() -> Path:
    """`$ONNXFN_CACHE_DIR`, else `~/.cache/onnxfn`: dequantized weights and exports keyed by content hash."""
    configured = os.environ.get("ONNXFN_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "onnxfn"


def state_root() -> Path:
    """`$XDG_STATE_HOME/onnxfn`, else `~/.local/state/onnxfn`: what runs on this machine, for this user.

    Not under the current folder: `pkg status`, `ps` and `destroy` must find a deployment from anywhere.
    The XDG spec says a relative `$XDG_STATE_HOME` is invalid and is ignored. Created 0700 (or narrowed to it).
    """
    configured = os.environ.get("XDG_STATE_HOME", "")
    base = Path(configured) if configured and Path(configured).is_absolute() else Path.home() / ".local" / "state"
    return private_dir(base / "onnxfn")  # its keys and snapshots are the user's alone, wherever it sits


def function_state_dir(spec: FunctionSpec, root: Path | None = None) -> Path:
    """`STATE_ROOT/functions/FOLDER-HASH`: one folder per function folder, keyed by its resolved path.

    The folder's name keeps it readable; the hash of the whole path keeps two `functions/chat` of different
    projects apart, and gives the same folder whichever relative path or current folder named the function.
    """
    folder = spec.directory.resolve()
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    return (root or state_root()) / "functions" / f"{folder.name}-{digest}"
