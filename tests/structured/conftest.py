"""A real uvicorn server on a free port serving the demo bundle, with room for 10 sequences at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from runtime.engine.engine import EngineConfig
from runtime.http.state import ServerSettings
from tests.server.conftest import API_KEY, RunningServer, engine_loader, policy_for, serve_in_thread


@pytest.fixture(scope="package")
def server(demo_bundle: Path) -> Iterator[RunningServer]:
    settings = ServerSettings(policy=policy_for(demo_bundle, max_tokens_limit=160, max_n=10), api_key=API_KEY)
    config = EngineConfig(max_batch=10, max_queue=64, max_context=768)
    with serve_in_thread(settings, engine_loader(demo_bundle, config)) as running:
        yield running


@pytest.fixture(scope="package")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def model(server: RunningServer) -> str:
    return server.state.policy.model_name
