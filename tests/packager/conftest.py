from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_llama import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "hf")


@pytest.fixture
def isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the session's own, so tiny-model tests never touch (or reuse) the user's cache."""
    cache = tmp_path_factory.getbasetemp() / "onnxfn-cache"
    monkeypatch.setenv("ONNXFN_CACHE_DIR", str(cache))
    return cache


def write_function(root: Path, name: str, source: str, extra: str = "") -> Path:
    folder = root / "functions" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "function.toml").write_text(f'name = "{name}"\n[model]\nsource = "{source}"\n{extra}')
    return folder
