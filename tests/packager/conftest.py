from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_model_cache


@pytest.fixture
def isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the session's own, so tiny-model tests never touch (or reuse) the user's cache."""
    cache = tiny_model_cache(tmp_path_factory)
    monkeypatch.setenv("ONNXFN_CACHE_DIR", str(cache))
    return cache


def write_function(root: Path, name: str, source: str, extra: str = "") -> Path:
    folder = root / "functions" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "function.toml").write_text(f'name = "{name}"\n[model]\nsource = "{source}"\n{extra}')
    return folder
