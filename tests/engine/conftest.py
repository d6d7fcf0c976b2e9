from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.bundle import Bundle, open_bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def bundle_path(demo_bundle: Path) -> Path:
    """The real demo bundle, built by the session fixture (or `ONNXFN_TEST_BUNDLE`)."""
    return demo_bundle


@pytest.fixture(scope="session")
def bundle(bundle_path: Path) -> Bundle:
    return open_bundle(bundle_path)


@pytest.fixture(scope="session")
def tokenizer(bundle: Bundle) -> Tokenizer:
    facts = bundle.manifest.model
    return Tokenizer(bundle.tokenizer_path, facts.chat_template, facts.bos_token_id, facts.eos_token_ids)


@pytest.fixture(scope="module")
def engine(bundle: Bundle) -> Iterator[Engine]:
    """A started engine shared by a module's tests (each test uses its own request ids)."""
    eng = Engine(
        bundle, EngineConfig(max_batch=8, kv_memory_bytes=8 * 512 * bundle.manifest.model.kv_bytes_per_token())
    )
    eng.start()
    yield eng
    eng.shutdown()


def chat_ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
