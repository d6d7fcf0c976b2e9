"""Session-wide fixtures: the real demo bundle, built once by the real `pkg build` pipeline."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_FUNCTION = REPO / "functions" / "smollm2-chat"


@pytest.fixture(scope="session", autouse=True)
def isolated_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`$XDG_STATE_HOME` for the session: what tests deploy never lands in the user's ~/.local/state/onnxfn,
    and `pkg ps` in a test never sees the user's own deployments. Subprocesses inherit it."""
    state = tmp_path_factory.mktemp("xdg-state")
    previous = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(state)
    yield state
    if previous is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = previous


@pytest.fixture(scope="session")
def demo_bundle() -> Path:
    """`build/smollm2-chat/bundle`, built (or reused from the content-addressed cache) for this session.

    `ONNXFN_TEST_BUNDLE` points the suite at another bundle instead.
    """
    configured = os.environ.get("ONNXFN_TEST_BUNDLE")
    if configured:
        return Path(configured)
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec

    previous = Path.cwd()
    os.chdir(REPO)
    try:
        result = build_function(load_spec(DEMO_FUNCTION), StepProgress())
    finally:
        os.chdir(previous)
    return REPO / result.bundle


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama folder (tests/fixtures/tiny_llama.py), shared by every suite that builds one."""
    from tests.fixtures.tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "hf")


def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's own build cache for tiny models: never the user's, shared so their exports are built once."""
    return tmp_path_factory.getbasetemp() / "onnxfn-cache"
