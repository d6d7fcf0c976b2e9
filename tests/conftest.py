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
    and `pkg ps` in a test never sees the user's own deployments. Subprocesses inherit it. The gateway a
    `pkg deploy` starts listens on a free port (not the user's 8420) and is stopped at the end."""
    from packager.gateway import control
    from packager.targets.local.server_process import free_port

    state = tmp_path_factory.mktemp("xdg-state")
    saved = {name: os.environ.get(name) for name in ("XDG_STATE_HOME", control.PORT_ENV)}
    os.environ["XDG_STATE_HOME"] = str(state)
    os.environ[control.PORT_ENV] = str(free_port("127.0.0.1"))
    yield state
    control.stop()
    for name, previous in saved.items():
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


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
