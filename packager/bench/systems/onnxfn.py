"""onnxfn's engine in-process: every stream is a request submitted to one continuously batching engine."""

from __future__ import annotations

import asyncio
import itertools

from packager.bench.systems.base import (
    PromptSpec,
    StreamTiming,
    SystemConfig,
    now,
    process_memory,
    timings_from_marks,
)
from packager.decoder_facts import decoder_facts
from runtime.engine.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.verified import open_verified


def engine_config(config: SystemConfig, kv_bytes_per_token: int) -> EngineConfig:
    return EngineConfig(
        max_batch=config.max_batch,
        threads=config.threads,
        max_context=config.max_context,
        kv_memory_bytes=config.max_batch * config.max_context * kv_bytes_per_token,
        defer_prefill_graph=True,  # as the server and the Lambda handler start
    )


class OnnxfnSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.max_streams = config.max_batch
        started = now()
        # As the server and the Lambda handler do: files hashed once, then trusted while their stat is unchanged.
        bundle, _ = open_verified(config.bundle)
        verified = now()
        self._engine = Engine(bundle, engine_config(config, decoder_facts(bundle.manifest).kv_bytes_per_token()))
        self._engine.start()
        self.load_phases = {"verify_bundle": verified - started, "engine": now() - verified}
        self._ids = itertools.count()

    async def _stream(self, ids: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(f"bench-{next(self._ids)}", tuple(ids), sampling)
        marks: list[float] = []
        tokens: list[int] = []
        async for output in self._engine.submit(request):
            for token in output.token_ids:
                marks.append(now())
                tokens.append(token)
        return marks, tokens

    async def _run_all(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]:
        start = now()
        results = await asyncio.gather(*(self._stream(p.ids, max_tokens) for p in prompts))
        return [timings_from_marks(start, marks, tokens) for marks, tokens in results]

    def run(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]:
        self._engine.wait_until_warm()  # steady state: the prefill graph in use, the weights on huge pages
        return asyncio.run(self._run_all(prompts, max_tokens))

    def first_token(self, text: str) -> dict[str, float]:
        ids = self._engine.tokenizer.encode(text)
        tokenized = now()
        request = GenerationRequest("cold", tuple(ids), SamplingParams(max_tokens=1, temperature=0.0))
        next(iter(self._engine.submit(request)))
        return {"tokenizer": tokenized, "first_token": now()}

    def memory(self) -> dict[str, float]:
        return process_memory()

    def close(self) -> None:
        self._engine.shutdown()
