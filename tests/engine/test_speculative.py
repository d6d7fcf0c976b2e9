"""Prompt-lookup speculative decoding: drafting, the per-sequence switch, and exact acceptance in the engine.

Verify forwards run the decode graph on several tokens, and ONNX Runtime's attention computes that
with another GEMM path than a one-token step (float rounding, amplified by the int8 activations), so
the exact reference for a speculating engine is decoding every token through that same path: one
real token plus a padding token per forward, which is what `reference_through_verify` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from runtime.bundle import Bundle
from runtime.engine.constraints import json_object_grammar
from runtime.engine.draft import DraftState
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.graphs import graph_source, prefill_graph_file
from runtime.engine.kv_cache import KVPool
from runtime.engine.request import FinishReason, GenerationRequest, SamplingParams
from runtime.engine.scheduler import SequenceState
from runtime.engine.session import DecoderSession
from runtime.engine.session_build import SessionOptions, create_session
from runtime.engine.speculative import PromptLookup, lookup_draft
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at six, carrying a tin of oil and a "
    "cloth for the lens, and watched the fishing boats return to the harbour."
)
PROMPTS = [
    f"Repeat the following text exactly: {PASSAGE}",
    "Rewrite this code with `total` renamed to `acc`:\n\ndef add(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total\n",
    f"Copy this sentence twice: {PASSAGE}",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
CONTEXT = 512
PAD = 0


class AlwaysVerify(PromptLookup):
    """Verifies on every step: the prompt-lookup draft, or one padding token (rejected unless the model picks it).

    Drafts also run past `max_tokens` and EOS, so the engine must drop what follows a sequence's end.
    """

    def propose(self, seq: SequenceState, room: int) -> np.ndarray | None:
        draft = lookup_draft(np.asarray(seq.token_ids(), dtype=np.int64), self.max_draft)
        return draft if draft.size else np.array([PAD], dtype=np.int64)


@pytest.fixture(scope="module")
def verify_session(bundle: Bundle) -> DecoderSession:
    """A decoder over a one-slot pool of its own, for the reference loop."""
    facts = bundle.manifest.model
    options = SessionOptions()
    prefill = None
    if (prompt_graph := prefill_graph_file(bundle, EngineConfig())) is not None:
        prefill = create_session(graph_source(bundle, prompt_graph, EngineConfig()), options, bundle)
    pool = KVPool(facts, 1, CONTEXT)
    session = create_session(bundle.model_path, options, bundle)
    return DecoderSession(
        session, facts.io, facts.num_layers, pool.tensors, facts.vocab_size, 1, 64, prefill, max_width=2
    )


@pytest.fixture(scope="module")
def engines(bundle: Bundle) -> Iterator[dict[bool, Engine]]:
    kv = 4 * CONTEXT * bundle.manifest.model.kv_bytes_per_token()
    config = EngineConfig(max_batch=4, kv_memory_bytes=kv, prefix_cache_bytes=0)
    pair = {on: Engine(bundle, replace(config, speculative=on)) for on in (False, True)}
    for engine in pair.values():
        engine.start()
    yield pair
    for engine in pair.values():
        engine.shutdown()


def reference_through_verify(
    session: DecoderSession, prompt: tuple[int, ...], params: SamplingParams, eos: set[int]
) -> list[int]:
    """Greedy tokens with every decode step fed `[token, padding]` through `verify`, stopping like the engine."""
    logits = np.empty(0)
    for start in range(0, len(prompt), 64):
        logits = session.prefill(0, prompt[start : start + 64], start)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < params.max_tokens and (params.ignore_eos or tokens[-1] not in eos):
        step = session.verify([tokens[-1], PAD], len(prompt) + len(tokens) - 1)
        tokens.append(int(step[0].argmax()))
    return tokens


def test_lookup_draft_continues_the_latest_longest_match() -> None:
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7], dtype=np.int64)
    # The suffix (6, 7) occurs at 1 and 6; the later one continues with 3, 4, 2.
    assert lookup_draft(tokens, 3).tolist() == [3, 4, 2]
    assert lookup_draft(tokens, 1).tolist() == [3]
    # A 3-gram beats a later 1-gram: (9, 1, 6) then 7 ... ; only (1, 6) and (6,) would match elsewhere.
    assert lookup_draft(np.array([9, 1, 6, 7, 0, 6, 9, 1, 6]), 2).tolist() == [7, 0]
    assert lookup_draft(np.array([1, 2, 3, 4]), 4).size == 0  # nothing repeats
    assert lookup_draft(np.array([4, 4, 4]), 4).tolist() == [4]  # a run drafts its own next token


def test_a_sequence_stops_drafting_after_low_acceptance() -> None:
    state = DraftState()
    for _ in range(3):
        state.record(drafted=3, accepted=0)
    assert state.enabled  # still on probation
    state.record(drafted=3, accepted=0)
    assert not state.enabled
    good = DraftState()
    for accepted in (3, 2, 0, 3, 3, 1, 3):
        good.record(drafted=3, accepted=accepted)
    assert good.enabled and good.accepted == 15 and good.drafted == 21


@pytest.mark.real_model
def test_speculation_keeps_exactly_the_tokens_the_verify_forward_picks(
    engines: dict[bool, Engine], verify_session: DecoderSession, tokenizer: Tokenizer, bundle: Bundle
) -> None:
    engine = engines[True]
    eos = set(bundle.manifest.model.eos_token_ids)
    drafter = AlwaysVerify(engine.config.speculative_tokens)
    engine._runner._drafter = drafter  # every step verifies, so the reference is exact
    produced = 0
    try:
        for i, text in enumerate(PROMPTS):
            prompt = chat_ids(tokenizer, text)
            # Odd lengths end mid-draft; natural EOS ends the chat answers inside a draft too.
            params = SamplingParams(max_tokens=27 if i < 3 else 21, temperature=0, ignore_eos=i == 0)
            (output,) = engine.generate(GenerationRequest(f"exact-{i}", prompt, params))
            expected = reference_through_verify(verify_session, prompt, params, eos)
            assert list(output.token_ids) == expected, text
            assert output.completion_tokens == len(expected)
            ended = expected[-1] in eos and not params.ignore_eos
            assert output.finish_reason is (FinishReason.STOP if ended else FinishReason.LENGTH)
            produced += len(expected) - 1  # the first token comes from prefill
    finally:
        engine._runner._drafter = engine._drafter
    stats = drafter.stats
    # Copy-heavy prompts accept most drafts, the chat prompts' padding tokens are rejected.
    assert stats.drafted > stats.accepted > stats.drafted // 3 > 0
    assert stats.steps + stats.accepted >= produced  # every decoded token came from a verify step


@pytest.mark.real_model
def test_copying_is_accepted_and_counted(engines: dict[bool, Engine], tokenizer: Tokenizer) -> None:
    engine = engines[True]
    before = engine.stats()
    prompt = chat_ids(tokenizer, PROMPTS[0])
    params = SamplingParams(max_tokens=60, temperature=0)
    (output,) = engine.generate(GenerationRequest("copy", prompt, params))
    after = engine.stats()
    drafted = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_draft_tokens - before.accepted_draft_tokens
    assert output.text.strip() == PASSAGE
    assert drafted >= 20 and accepted >= 0.7 * drafted
    # Fewer forwards than tokens: each verify step yields 1 + its accepted drafts.
    assert after.steps - before.steps < output.completion_tokens - accepted // 2


@pytest.mark.real_model
def test_a_mixed_batch_keeps_sampled_and_constrained_outputs(engines: dict[bool, Engine], tokenizer: Tokenizer) -> None:
    """Sampled and constrained requests never draft; greedy ones draft only once they decode alone."""
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=48, temperature=0)),
        (PROMPTS[3], SamplingParams(max_tokens=12, seed=7, temperature=0.8)),
        (PROMPTS[4], SamplingParams(max_tokens=16, temperature=0, grammar=json_object_grammar())),
        (PROMPTS[5], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
    ]
    results: dict[bool, list[list[int]]] = {}
    drafted: dict[bool, int] = {}
    for on, engine in engines.items():
        before = engine.stats()
        streams = [
            engine.submit(GenerationRequest(f"mixed-{on}-{i}", chat_ids(tokenizer, text), params))
            for i, (text, params) in enumerate(requests)
        ]
        results[on] = [[t for out in stream for t in out.token_ids] for stream in streams]
        after = engine.stats()
        drafted[on] = after.draft_tokens - before.draft_tokens
    assert results[False][1:3] == results[True][1:3]
    assert drafted[False] == 0 < drafted[True]
    assert tokenizer.decode(results[True][0][:-1]).strip() == PASSAGE
