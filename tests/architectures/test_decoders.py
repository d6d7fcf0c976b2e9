"""Every supported decoder architecture, on a tiny model of its published config: built, checked, served.

For each case (cases.py): `pkg build` at fp32 passes its parity check (the fp32 graph's top-1 equals transformers'
at every answer position of the 8 quality prompts, probabilities within fp32 tolerance); the engine's greedy
tokens equal transformers' `generate` on a chat prompt and, for rope-scaled models, on a prompt past the original
context; and the engine serves a batch with a shared prefix (continuous batching, the prefix cache) with every row's
tokens the same as alone.
"""

from __future__ import annotations

import json

import pytest

from packager.export.architectures import SUPPORTED_DECODERS
from runtime.bundle import open_bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.engine.tokenizer import Tokenizer
from tests.architectures.cases import CASES, LONG_PROMPT, Case
from tests.architectures.conftest import Builds, assert_batched_with_a_shared_prefix_as_alone, transformers_greedy

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _prompts(tokenizer: Tokenizer, case: Case) -> list[list[int]]:
    chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}]))
    prompts = [list(chat)]
    if case.long_prompt:
        prompts.append([3 + (i * 37) % 380 for i in range(LONG_PROMPT)])
    return prompts


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_builds_with_parity_and_decodes_like_transformers(case: Case, builds: Builds) -> None:
    assert SUPPORTED_DECODERS[case.hf_class] == case.model_type
    hf, bundle_dir = builds.get(case)
    parity = json.loads((bundle_dir / "quality.json").read_text())["torch_parity"]
    assert parity["identical_greedy"] == parity["prompts"] == 8, parity
    assert parity["max_probability_delta"] < 1e-4, parity
    bundle = open_bundle(bundle_dir)
    facts = bundle.manifest.model
    assert facts.architecture == case.model_type
    tokenizer = Tokenizer(bundle.tokenizer_path, facts.chat_template, facts.bos_token_id, facts.eos_token_ids)
    engine = Engine(bundle, EngineConfig(max_batch=2, max_context=256, prefill_chunk=32))
    try:
        for i, prompt in enumerate(_prompts(tokenizer, case)):
            (served,) = engine.generate(GenerationRequest(f"{case.name}-{i}", tuple(prompt), GREEDY))
            expected = transformers_greedy(hf, prompt, facts.context_length, NEW_TOKENS)
            assert list(served.token_ids) == expected, f"prompt {i} ({len(prompt)} tokens)"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_serves_a_batch_with_a_shared_prefix_as_each_row_alone(case: Case, builds: Builds) -> None:
    _, bundle_dir = builds.get(case)
    assert_batched_with_a_shared_prefix_as_alone(open_bundle(bundle_dir), GREEDY)
