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


def build_in(root: Path, function: Path, cache: Path | None = None) -> Path:
    """The real `pkg build` of `function`, run from `root` (its bundle lands in `root/build/NAME/bundle`, returned
    resolved) with `cache` as the build cache (None: the one in effect)."""
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec

    patch = pytest.MonkeyPatch()
    if cache is not None:
        patch.setenv("ONNXFN_CACHE_DIR", str(cache))
    patch.chdir(root)
    try:
        return (root / build_function(load_spec(function), StepProgress()).bundle).resolve()
    finally:
        patch.undo()


def write_function(root: Path, name: str, source: str, extra: str = "") -> Path:
    folder = root / "functions" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "function.toml").write_text(f'name = "{name}"\n[model]\nsource = "{source}"\n{extra}')
    return folder
