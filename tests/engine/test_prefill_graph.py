"""The prefill graphs a CPU bundle carries: logits of each row's last position, with fp32 matmuls on the int8
weights or with the model's own int8 matmuls; which one the engine runs depends on the CPU."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from packager.export.prefill import PREFILL_RECIPE_FILE
from runtime.bundle import Bundle, open_bundle
from runtime.engine import graphs
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.graphs import PREFILL_MODEL_FILE, QUANTIZED_PREFILL_FILE, graph_source, prefill_graph_file
from runtime.engine.kv_cache import KVPool
from runtime.engine.recipes import dequantize_nbits
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.engine.session import DecoderSession
from runtime.engine.session_build import SessionOptions, create_session
from runtime.engine.tables import inference_session
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids


def _matmul_nbits(
    packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int, k: int, n: int
) -> ort.InferenceSession:
    initializers = [onnx.numpy_helper.from_array(packed, "b"), onnx.numpy_helper.from_array(scales, "scales")]
    if zero_points is not None:
        initializers.append(onnx.numpy_helper.from_array(zero_points, "zero_points"))
    node = helper.make_node(
        "MatMulNBits", ["a", *(i.name for i in initializers)], ["y"], domain="com.microsoft",
        K=k, N=n, bits=bits, block_size=32, accuracy_level=0,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        initializers,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("zero_points", [False, True], ids=["default-zero-point", "zero-points"])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_weights_reproduce_matmul_nbits(bits: int, zero_points: bool) -> None:
    rng = np.random.default_rng(bits)
    k, n = 80, 24  # K not a multiple of the block: the padding of the last block must be dropped
    blocks = -(-k // 32)
    packed = rng.integers(0, 256, size=(n, blocks, 32 * bits // 8), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(n, blocks)).astype(np.float32)
    # 4-bit zero points two to a byte, each row padded to whole bytes (3 blocks: 2 bytes)
    zero = rng.integers(0, 256, size=(n, blocks * bits // 8 + (blocks * bits % 8 > 0)), dtype=np.uint8)
    zero = zero if zero_points else None
    a = rng.standard_normal((5, k)).astype(np.float32)
    (expected,) = _matmul_nbits(packed, scales, zero, bits, k, n).run(None, {"a": a})
    weight = dequantize_nbits(packed, scales, bits, k, zero)
    assert weight.shape == (k, n)
    np.testing.assert_allclose(a @ weight, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.real_model
@pytest.mark.parametrize("graph", [PREFILL_MODEL_FILE, QUANTIZED_PREFILL_FILE])
def test_prefill_graph_returns_the_last_position_of_the_same_model(
    graph: str, bundle: Bundle, tokenizer: Tokenizer
) -> None:
    files = bundle.manifest.files
    if PREFILL_MODEL_FILE not in files:
        pytest.skip("the test bundle was built without a prefill graph")
    assert {PREFILL_RECIPE_FILE, QUANTIZED_PREFILL_FILE} <= set(files)  # quantized demo: fp32 weights derived here
    facts = bundle.manifest.model
    io = facts.io
    prompt = np.array([chat_ids(tokenizer, "Why is the sky blue?")], np.int64)
    empty = np.zeros((1, facts.num_kv_heads, 0, facts.head_dim), np.float32)
    feed = {io.input_ids: prompt, io.attention_mask: np.ones_like(prompt)}
    feed |= {name % i: empty for i in range(facts.num_layers) for name in (io.past_key, io.past_value)}
    full = inference_session(bundle.model_path, ort.SessionOptions(), ["CPUExecutionProvider"], bundle)
    source = graph_source(bundle, graph, EngineConfig())
    prefill = inference_session(source, ort.SessionOptions(), ["CPUExecutionProvider"], bundle)
    (all_positions,) = full.run([io.logits], feed)
    (last,) = prefill.run([io.logits], feed)
    assert all_positions.shape == (1, prompt.shape[1], facts.vocab_size)
    assert last.shape == (1, 1, facts.vocab_size)
    if graph == QUANTIZED_PREFILL_FILE:  # the same kernels on the same rows
        np.testing.assert_allclose(last[0, 0], all_positions[0, -1], rtol=0, atol=1e-4)
        return
    p, q = _log_softmax(all_positions[0, -1]), _log_softmax(last[0, 0])
    kl = float(np.sum(np.exp(p) * (p - q)))
    assert last[0, 0].argmax() == all_positions[0, -1].argmax()
    assert kl < 0.02  # int8 activations vs fp32 ones on the same weights; a wrong weight layout gives KL > 1


@pytest.mark.real_model
def test_decoded_kv_is_cached_only_when_one_graph_computes_prompts_and_tokens(
    bundle: Bundle, tokenizer: Tokenizer
) -> None:
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    prompt = chat_ids(tokenizer, "List three prime numbers.")
    request = GenerationRequest("decoded", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    graphs_in_use = {
        "fp32 prefill graph + model.onnx": {"prefill_matmuls": "fp32"},
        "quantized prefill graph alone": {"prefill_matmuls": "quantized"},
        "model.onnx alone": {"prefill_graph": False},
    }
    counts: dict[str, int] = {}
    for name, graph_config in graphs_in_use.items():
        config = EngineConfig(max_batch=1, max_context=256, prefix_block_size=8, **graph_config)  # type: ignore[arg-type]
        engine = Engine(bundle, config)
        engine.generate(request)
        counts[name] = engine.stats().prefix_cache_bytes // (8 * bundle.manifest.model.kv_bytes_per_token())
        engine.shutdown()
    # Prefill KV and decode KV differ slightly between two graphs, so only prompt blocks may be reused then.
    assert counts["fp32 prefill graph + model.onnx"] == len(prompt) // 8
    assert counts["quantized prefill graph alone"] == counts["model.onnx alone"] == (len(prompt) + 39) // 8


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


@pytest.mark.real_model
def test_a_deferred_prefill_graph_takes_over_and_then_matches_a_loaded_engine(
    bundle: Bundle, tokenizer: Tokenizer
) -> None:
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    prompt = chat_ids(tokenizer, "Name a large river.")
    sampling = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs, cached = {}, {}
    for defer in (False, True):
        # Two graphs (prompts through fp32 matmuls, tokens through model.onnx), so there is one to defer.
        config = EngineConfig(
            max_batch=2, max_context=256, prefix_block_size=8, defer_prefill_graph=defer, prefill_matmuls="fp32"
        )
        engine = Engine(bundle, config)
        if defer:
            # Ready before the prefill graph: whatever arrives now is served through the decode graph.
            early = engine.generate(GenerationRequest("early", prompt, sampling))
            assert len(early[0].token_ids) == 12
            engine.wait_for_prefill_graph()
            assert engine.prefill_graph == "prefill graph"
            engine.shutdown()
            engine = Engine(bundle, config)  # a fresh prefix cache, so both engines start equal
            engine.wait_for_prefill_graph()
        outputs[defer] = engine.generate(GenerationRequest(f"r-{defer}", prompt, sampling))[0].token_ids
        cached[defer] = engine.stats().prefix_cache_bytes
        engine.shutdown()
    assert outputs[True] == outputs[False]
    assert cached[True] == cached[False] == (len(prompt) // 8) * 8 * bundle.manifest.model.kv_bytes_per_token()


@pytest.mark.real_model
def test_a_prefill_graph_that_fails_to_load_leaves_the_decode_graph_serving(
    bundle: Bundle, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    config = EngineConfig(
        max_batch=1, max_context=256, prefix_block_size=8, defer_prefill_graph=True, prefill_matmuls="fp32"
    )
    used = prefill_graph_file(bundle, config)
    for entry in bundle.path.iterdir():
        if entry.name != used:
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / str(used)).write_bytes(b"not an onnx graph")
    broken = open_bundle(tmp_path, verify=False)
    engine = Engine(broken, dataclasses.replace(config, derived=tmp_path / "derived"))
    try:
        engine.wait_for_prefill_graph()
        assert engine.prefill_graph == "decode graph"
        prompt = chat_ids(tokenizer, "Name a large river.")
        request = GenerationRequest("fallback", prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
        assert len(engine.generate(request)[0].token_ids) == 9
        # One graph for prompts and decoding again: generated tokens' KV is reusable too.
        blocks = engine.stats().prefix_cache_bytes // (8 * broken.manifest.model.kv_bytes_per_token())
        assert blocks == (len(prompt) + 8) // 8
    finally:
        engine.shutdown()


@pytest.mark.real_model
def test_an_idle_engine_switches_to_the_prefill_graph_once_it_is_built(bundle: Bundle) -> None:
    """No request has to arrive first: a server's `/ready` reports the switch, and pages move, while idle."""
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    config = EngineConfig(
        max_batch=1, max_context=256, prefix_block_size=8, defer_prefill_graph=True, prefill_matmuls="fp32"
    )
    engine = Engine(bundle, config)
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while engine.prefill_graph == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.prefill_graph == "prefill graph"
        assert engine.stats().steps == 0
    finally:
        engine.shutdown()


@pytest.mark.real_model
@pytest.mark.parametrize("graph", [PREFILL_MODEL_FILE, QUANTIZED_PREFILL_FILE])
def test_prompts_prefilled_in_one_run_match_each_prefilled_alone(
    graph: str, bundle: Bundle, tokenizer: Tokenizer
) -> None:
    """Right-padded first chunks in one run: every row's KV and last-position logits are bit-for-bit its own."""
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    facts = bundle.manifest.model
    pool = KVPool(facts, slots=3, max_context=64)
    options = SessionOptions()
    decoder = DecoderSession(
        create_session(bundle.model_path, options, bundle), facts.io, facts.num_layers, pool.tensors, facts.vocab_size,
        max_rows=3, max_chunk=64,
        prefill_session=create_session(graph_source(bundle, graph, EngineConfig()), options, bundle),
    )  # fmt: skip
    assert decoder.prefills_prompts_together
    prompts = [chat_ids(tokenizer, q) for q in ("hi", "Name a large river.", "Tell me a fun fact about octopuses.")]
    assert len({len(p) for p in prompts}) == 3  # ragged: the shorter rows are padded
    together = decoder.prefill_prompts(0, prompts).copy()
    kv_together = [tensor.copy() for tensor in pool.tensors]
    for row, prompt in enumerate(prompts):
        alone = decoder.prefill(0, prompt, 0)
        assert alone.shape == (1, facts.vocab_size)
        assert np.array_equal(alone[0], together[row])
        for tensor, before in zip(pool.tensors, kv_together, strict=True):
            assert np.array_equal(tensor[0, :, : len(prompt)], before[row, :, : len(prompt)])


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["latency", "throughput"])
def test_prompts_admitted_together_share_prefill_runs_and_keep_their_tokens(
    mode: str, bundle: Bundle, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    if PREFILL_MODEL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a prefill graph")
    runs: list[int] = []
    prefill_prompts = DecoderSession.prefill_prompts

    def counted(self: DecoderSession, first_slot: int, prompts: list[tuple[int, ...]]) -> np.ndarray:
        runs.append(len(prompts))
        return prefill_prompts(self, first_slot, prompts)

    monkeypatch.setattr(DecoderSession, "prefill_prompts", counted)
    # Plain text of similar lengths and no prefix cache: every prompt starts at position 0.
    texts = ["The capital city of Spain is", "The tallest mountain on Earth is", "Octopuses have three hearts and"]
    prompts = [tuple(tokenizer.encode(text)) for text in texts]
    sampling = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_context=128, prefill_chunk=256, prefix_cache_bytes=0, decode=mode)  # type: ignore[arg-type]
    engine = Engine(bundle, config)
    try:
        # Submitted before the loop runs, so all three are admitted in its first step.
        streams = [engine.submit(GenerationRequest(f"together-{i}", p, sampling)) for i, p in enumerate(prompts)]
        engine.start()
        together = [tuple(t for out in stream for t in out.token_ids) for stream in streams]
        batched = list(runs)
        alone = [
            engine.generate(GenerationRequest(f"alone-{i}", p, sampling))[0].token_ids for i, p in enumerate(prompts)
        ]
    finally:
        engine.shutdown()
    assert batched == [3] and runs == [3]  # one run for the three prompts, none for a prompt alone
    assert together == [tuple(a) for a in alone]


def test_the_prefill_graph_follows_the_cpu_unless_configured(bundle: Bundle, monkeypatch: pytest.MonkeyPatch) -> None:
    if QUANTIZED_PREFILL_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle was built without a quantized prefill graph")

    def on(flags: set[str], **config: object) -> str | None:
        monkeypatch.setattr(graphs, "cpu_flags", lambda: frozenset(flags))
        return prefill_graph_file(bundle, EngineConfig(**config))  # type: ignore[arg-type]

    avx2, vnni = {"avx2", "fma"}, {"avx2", "avx512f", "avx512_vnni"}
    assert on(avx2) == PREFILL_MODEL_FILE  # fp32 matmuls: 2.6x faster prefill there than int8
    assert on(vnni) == on({"avx2", "avx_vnni"}) == QUANTIZED_PREFILL_FILE
    assert on(vnni, prefill_matmuls="fp32") == on(avx2, prefill_matmuls="fp32") == PREFILL_MODEL_FILE
    assert on(avx2, prefill_matmuls="quantized") == QUANTIZED_PREFILL_FILE
    assert on(vnni, decode="throughput") == PREFILL_MODEL_FILE  # decodes through the fp32 graph, prompts too
    assert on(vnni, prefill_graph=False) is None
    assert on(vnni, providers=("cuda", "cpu")) is None
    monkeypatch.setattr(graphs, "cpu_flags", lambda: frozenset(vnni))
    # The quantized prefill graph decodes too (graphs.decodes_with_prefill_graph): one graph, one copy of the weights.
    assert graphs.bundle_graphs(bundle) == [bundle.path / QUANTIZED_PREFILL_FILE]
    assert graphs.bundle_graphs(bundle, EngineConfig(speculative=True)) == [
        bundle.model_path,
        bundle.path / QUANTIZED_PREFILL_FILE,
    ]
    throughput = EngineConfig(decode="throughput")
    assert graphs.bundle_graphs(bundle, throughput) == [graph_source(bundle, PREFILL_MODEL_FILE, throughput)]


def test_auto_derives_no_fp32_copy_beyond_its_cap(bundle: Bundle, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `FP32_PREFILL_MAX_BYTES` of fp32 weights (a 1B model's copy is 3.7 GiB), `auto` runs prompts through
    the quantized graph even where fp32 matmuls prefill faster; an explicit choice is kept."""
    if PREFILL_RECIPE_FILE not in bundle.manifest.files:
        pytest.skip("the test bundle ships its fp32 prefill weights")
    monkeypatch.setattr(graphs, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    copy = graphs.derived_bytes(bundle, PREFILL_MODEL_FILE)
    assert copy > 3 * bundle.manifest.files["model.onnx.data"].size  # what the cap is about: ~4x the bundle
    assert copy <= graphs.FP32_PREFILL_MAX_BYTES and prefill_graph_file(bundle, EngineConfig()) == PREFILL_MODEL_FILE
    monkeypatch.setattr(graphs, "FP32_PREFILL_MAX_BYTES", copy - 1)  # the same bundle, as if it were larger
    assert prefill_graph_file(bundle, EngineConfig()) == QUANTIZED_PREFILL_FILE
    assert graphs.bundle_graphs(bundle) == [bundle.path / QUANTIZED_PREFILL_FILE]  # nothing derived
    assert prefill_graph_file(bundle, EngineConfig(prefill_matmuls="fp32")) == PREFILL_MODEL_FILE


def test_cpu_flags_are_the_kernels_first_cpu_line() -> None:
    flags = graphs.cpu_flags()
    text = Path("/proc/cpuinfo").read_text()
    first = next(line for line in text.splitlines() if line.startswith("flags"))
    assert flags == frozenset(first.partition(":")[2].split())
