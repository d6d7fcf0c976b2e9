"""The engine's tokens against a plain ONNX Runtime loop, alone and inside continuous batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest

from runtime.bundle import Bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.graphs import PREFILL_MODEL_FILE, decode_graph_path, graph_source, prefill_graph_file
from runtime.engine.request import FinishReason, GenerationRequest, SamplingParams
from runtime.engine.tables import inference_session
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
DEFAULT_CONFIG = EngineConfig()
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "hi",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, French and German, one per line, with no other text at all.",
    "2+2=?",
    "Tell me a fun fact about octopuses.",
]


def reference_greedy(
    bundle: Bundle, prompt: tuple[int, ...], new_tokens: int, config: EngineConfig = DEFAULT_CONFIG
) -> list[int]:
    """Plain `session.run` with a KV cache that grows by concatenation: no IO binding, no shared buffer.

    The prompt and the tokens after it go through the graphs an engine with `config` runs (graphs.py).
    """
    facts = bundle.manifest.model
    io = facts.io
    cpu = ["CPUExecutionProvider"]
    session = inference_session(decode_graph_path(bundle, config), ort.SessionOptions(), cpu, bundle)
    prompt_session = session
    if (prefill := prefill_graph_file(bundle, config)) is not None:
        prompt_session = inference_session(graph_source(bundle, prefill, config), ort.SessionOptions(), cpu, bundle)
    empty = np.zeros((1, facts.num_kv_heads, 0, facts.head_dim), np.float32)
    cache_names = io.cache_names(facts.num_layers)
    past = {name: empty for name, _ in cache_names}
    output_names = [o.name for o in session.get_outputs()]
    tokens, generated = list(prompt), []
    step_ids = np.array([prompt], np.int64)
    for step in range(new_tokens):
        feed = {io.input_ids: step_ids, io.attention_mask: np.ones((1, len(tokens)), np.int64), **past}
        out = dict(zip(output_names, (prompt_session if step == 0 else session).run(output_names, feed), strict=True))
        token = int(out[io.logits][0, -1].argmax())
        generated.append(token)
        tokens.append(token)
        for past_name, present_name in cache_names:
            past[past_name] = out[present_name]
        step_ids = np.array([[token]], np.int64)
    return generated


def run(engine: Engine, request_id: str, prompt: tuple[int, ...], params: SamplingParams = GREEDY) -> list[int]:
    return list(engine.generate(GenerationRequest(request_id, prompt, params))[0].token_ids)


def test_greedy_matches_plain_reference_loop(engine: Engine, bundle: Bundle, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    assert run(engine, "ref-0", prompt) == reference_greedy(bundle, prompt, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def throughput_engine(bundle: Bundle) -> Iterator[Engine]:
    """An engine whose prefill graph decodes too (`decode = throughput`)."""
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    kv = 8 * 512 * bundle.manifest.model.kv_bytes_per_token()
    eng = Engine(bundle, EngineConfig(max_batch=8, kv_memory_bytes=kv, decode="throughput"))
    eng.start()
    yield eng
    eng.shutdown()


def test_throughput_mode_decodes_through_the_prefill_graph(
    throughput_engine: Engine, bundle: Bundle, tokenizer: Tokenizer
) -> None:
    assert throughput_engine.prefill_graph == "prefill graph"
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    expected = reference_greedy(bundle, prompt, GREEDY.max_tokens, EngineConfig(decode="throughput"))
    assert run(throughput_engine, "throughput-ref", prompt) == expected


def test_throughput_mode_refuses_speculative_decoding(bundle: Bundle) -> None:
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    with pytest.raises(ValueError, match="decode = latency"):
        Engine(bundle, EngineConfig(max_batch=1, max_context=64, decode="throughput", speculative=True))


@pytest.mark.parametrize("mode", ["latency", "throughput"])
def test_greedy_tokens_do_not_depend_on_the_batch(
    mode: str, request: pytest.FixtureRequest, tokenizer: Tokenizer
) -> None:
    engine: Engine = request.getfixturevalue("engine" if mode == "latency" else "throughput_engine")
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    alone = [run(engine, f"alone-{i}", p) for i, p in enumerate(prompts)]
    # Different max_tokens make sequences finish mid-batch, so later slots get moved into the holes;
    # one sampled request rides along to mix greedy and sampled rows in the same step.
    lengths = [24, 5, 24, 9, 24, 13, 24, 24]
    streams = [
        engine.submit(GenerationRequest(f"batch-{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    sampled = engine.submit(GenerationRequest("batch-sampled", prompts[2], SamplingParams(max_tokens=20, seed=1)))
    together = [[t for out in stream for t in out.token_ids] for stream in streams]
    assert len(list(sampled)) > 0
    assert together == [a[:n] for a, n in zip(alone, lengths, strict=True)]


def test_chunked_prefill_equals_one_shot(bundle: Bundle, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, QUESTIONS[3])  # ~60 tokens: 8 chunks of 8
    results = []
    for chunk in (8, 256):
        eng = Engine(bundle, EngineConfig(max_batch=2, prefill_chunk=chunk, max_context=256, prefix_cache_bytes=0))
        try:
            eng.start()
            results.append(run(eng, f"chunk-{chunk}", prompt))
            assert eng.stats().steps >= (len(prompt) // chunk)
        finally:
            eng.shutdown()
    assert len(prompt) > 8 * 4
    assert results[0] == results[1]


def test_prefix_cache_hit_gives_the_same_tokens(bundle: Bundle, tokenizer: Tokenizer) -> None:
    first = chat_ids(tokenizer, QUESTIONS[1])
    second = chat_ids(tokenizer, QUESTIONS[5])  # shares the system prompt with `first`
    config = EngineConfig(max_batch=2, max_context=512, prefix_block_size=16)
    cold = Engine(bundle, EngineConfig(max_batch=2, max_context=512, prefix_cache_bytes=0))
    warm = Engine(bundle, config)
    try:
        cold.start()
        warm.start()
        expected = run(cold, "cold", second)
        assert cold.stats().prefix_hits == 0

        run(warm, "first", first)
        hits = warm.stats().prefix_hits
        assert run(warm, "shared-system-prompt", second) == expected
        assert warm.stats().prefix_hits == hits + 1
        # Now every full block of `second` is cached: only the tail is computed.
        tokens_in = warm.stats().tokens_in
        assert run(warm, "repeat", second) == expected
        assert warm.stats().tokens_in - tokens_in == len(second) - (len(second) - 1) // 16 * 16
        assert warm.stats().prefix_cache_bytes > 0
    finally:
        cold.shutdown()
        warm.shutdown()


def test_warm_prefixes_seed_the_cache(bundle: Bundle, tokenizer: Tokenizer) -> None:
    system = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": "Answer briefly."}], False))
    prompt = tuple(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTIONS[0]}]
    )))  # fmt: skip
    eng = Engine(bundle, EngineConfig(max_batch=1, max_context=256, prefix_block_size=16))
    try:
        eng.start()
        # The whole prefix is pinned, though it fills no 16-token block.
        assert 0 < eng.warm_prefixes([system]) == len(system) < 16
        with pytest.raises(ValueError, match="must each start the longest"):
            eng.warm_prefixes([system, [system[0] + 1]])
        before = eng.stats()
        run(eng, "after-warm", prompt)
        after = eng.stats()
        assert after.prefix_hits == before.prefix_hits + 1
        assert after.tokens_in - before.tokens_in == len(prompt) - len(system)
    finally:
        eng.shutdown()


def test_n_sequences_share_the_prompt_and_seed_reproduces(engine: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, QUESTIONS[7])
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7, n=3, ignore_eos=True)
    first = engine.generate(GenerationRequest("n-a", prompt, params))
    second = engine.generate(GenerationRequest("n-b", prompt, params))
    assert [o.index for o in first] == [0, 1, 2]
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 16 and o.finish_reason is FinishReason.LENGTH for o in first)
    assert len({o.token_ids for o in first}) > 1  # each index has its own random stream
    greedy = engine.generate(GenerationRequest("n-greedy", prompt, SamplingParams(max_tokens=8, temperature=0, n=2)))
    assert greedy[0].token_ids == greedy[1].token_ids


def test_ignore_eos_generates_exactly_max_tokens_and_eos_stops_otherwise(
    engine: Engine, bundle: Bundle, tokenizer: Tokenizer
) -> None:
    prompt = chat_ids(tokenizer, QUESTIONS[6])
    forced = engine.generate(
        GenerationRequest("eos-off", prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    )
    assert len(forced[0].token_ids) == 32
    natural = engine.generate(GenerationRequest("eos-on", prompt, SamplingParams(max_tokens=32, temperature=0)))[0]
    if natural.finish_reason is FinishReason.STOP:
        assert natural.token_ids[-1] in bundle.manifest.model.eos_token_ids
        assert natural.token_ids == forced[0].token_ids[: len(natural.token_ids)]
        assert "<|im_end|>" not in natural.text


def test_stop_string_ends_the_text_before_it(engine: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, QUESTIONS[3])
    full = engine.generate(GenerationRequest("stop-full", prompt, SamplingParams(max_tokens=24, temperature=0)))[0]
    stop = full.text[10:16]
    assert len(stop.strip()) >= 3
    cut = engine.generate(
        GenerationRequest("stop-cut", prompt, SamplingParams(max_tokens=24, temperature=0, stop=(stop, "never here")))
    )[0]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]


def test_logprobs_are_the_raw_distribution(engine: Engine, tokenizer: Tokenizer) -> None:
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    out = engine.generate(
        GenerationRequest("lp", prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=5))
    )[0]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.top[0][2] == pytest.approx(lp.logprob)
        assert [v for _, _, v in lp.top] == sorted((v for _, _, v in lp.top), reverse=True)
        assert sum(np.exp(v) for _, _, v in lp.top) <= 1.0 + 1e-5
        assert lp.text == tokenizer.id_to_text(token)
