"""Fixtures on the real demo bundle (`demo_bundle`, built by `pkg build` with its cold-start snapshot)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.bundle import Bundle, open_bundle
from runtime.engine.config import EngineConfig
from runtime.engine.engine import Engine

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # functions/smollm2-chat
SMALL = EngineConfig(max_batch=2, max_context=256, kv_memory_bytes=2 * 256 * 46080)


@pytest.fixture(scope="session")
def bundle(demo_bundle: Path) -> Bundle:
    return open_bundle(demo_bundle, verify=False)


@pytest.fixture()
def engine(bundle: Bundle) -> Iterator[Engine]:
    eng = Engine(bundle, SMALL)
    eng.start()
    yield eng
    eng.shutdown()


def chat(engine: Engine, user: str, system: str | None = SYSTEM_PROMPT) -> tuple[int, ...]:
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return tuple(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages)))
