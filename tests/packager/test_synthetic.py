"""Synthetic GGUFs of published shapes: the shapes are the published models', the file is what llama.cpp's
converter and quantizer write, the weights are seeded and sane, and writing holds one tensor at a time."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoConfig
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from packager.synthetic import PUBLISHED_CONFIGS, PublishedConfig, published_config, synthetic_gguf
from packager.synthetic.layout import tensor_plan
from packager.synthetic.mix import tensor_type
from packager.synthetic.weights import (
    BIAS_STD,
    LINEAR_STD,
    LOGIT_STD,
    hf_order_tensor,
    permute_rows,
    random_q4_k_blocks,
    random_q6_k_blocks,
)
from packager.synthetic.writer import tokenizer_gguf, write_synthetic_gguf

Q = GGMLQuantizationType
VOCAB = 49152  # the demo tokenizer's (SmolLM2)

# Parameters of each published checkpoint (its safetensors), with its own vocabulary and without rope_freqs.
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
}
# The layers whose attn_v and ffn_down llama.cpp's Q4_K_M makes Q6_K, written out per layer count.
Q6_K_LAYERS = {
    16: {0, 1, 4, 7, 10, 13, 14, 15},
    24: {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23},
    28: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27},
    32: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31},
    36: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35},
}
# Small files of each architecture and mix (fewer layers, the published widths), written once per session.
Case = tuple[str, str, int]
LLAMA_1B: Case = ("llama-3.2-1b", "q4_k_m", 2)  # tied, head_dim in config.json
LLAMA_1B_Q4_1: Case = ("llama-3.2-1b", "q4_1", 1)  # q/k through gguf's quantizer
LLAMA_8B: Case = ("llama-3.1-8b", "q4_k_m", 1)  # untied, no head_dim
QWEN_0_5B: Case = ("qwen2.5-0.5b", "q4_k_m", 2)  # 896-wide rows: the Q5_0/Q8_0 fallbacks
QWEN_7B: Case = ("qwen2.5-7b", "q4_k_m", 1)  # untied, biases
CASES = [LLAMA_1B, LLAMA_1B_Q4_1, LLAMA_8B, QWEN_0_5B, QWEN_7B]
CASE_IDS = ["-".join(map(str, case)) for case in CASES]
TRANSFORMERS_CASES = [LLAMA_1B, LLAMA_8B, QWEN_7B]


@pytest.fixture(scope="session")
def written() -> dict[Case, Path]:
    """Through the cache (`synthetic_gguf`), as the bench and the builds get them: written once per machine (~30 s);
    test_the_cache_reuses_a_file_and_a_seed_changes_it checks that what the cache returns is what the writer
    writes."""
    return {(name, mix, layers): synthetic_gguf(name, mix, seed=7, layers=layers) for name, mix, layers in CASES}


@pytest.fixture(scope="session")
def readers(written: dict[Case, Path]) -> dict[Case, GGUFReader]:
    """Each file parsed once (parsing the vocabulary's strings takes seconds)."""
    return {case: GGUFReader(path) for case, path in written.items()}


def _sampled_rows(data: np.ndarray, rows: int = 256) -> np.ndarray:
    """At most `rows` rows spread over a tensor's stored rows: enough for its statistics, fast to dequantize."""
    return data if data.ndim == 1 or data.shape[0] <= rows else data[:: data.shape[0] // rows]


def _types(config: PublishedConfig, mix: str) -> dict[str, GGMLQuantizationType]:
    return {spec.name: tensor_type(spec, config, mix) for spec in tensor_plan(config, VOCAB)}


@pytest.mark.parametrize("name", PUBLISHED_CONFIGS)
def test_the_layout_has_the_published_models_parameters(name: str) -> None:
    config = PUBLISHED_CONFIGS[name]
    plan = tensor_plan(config, config.published_vocab_size)
    assert (
        sum(int(np.prod(spec.shape)) for spec in plan if spec.name != "rope_freqs.weight")
        == (PUBLISHED_PARAMETERS[name])
    )
    assert ("output.weight" in {spec.name for spec in plan}) is not config.tie_word_embeddings


@pytest.mark.parametrize("name", PUBLISHED_CONFIGS)
def test_q4_k_m_gives_q6_k_where_llama_cpp_does(name: str) -> None:
    config = PUBLISHED_CONFIGS[name]
    types = _types(config, "q4_k_m")
    more_bits = Q6_K_LAYERS[config.num_hidden_layers]
    # Qwen2.5-0.5B's 896-wide rows fit no 256-value block: Q4_K falls back to Q5_0, Q6_K to Q8_0.
    narrow = config.hidden_size % 256 != 0
    for layer in range(config.num_hidden_layers):
        high = Q.Q6_K if layer in more_bits else Q.Q4_K
        assert types[f"blk.{layer}.ffn_down.weight"] == high  # its rows are intermediate_size long
        assert types[f"blk.{layer}.attn_v.weight"] == ({Q.Q6_K: Q.Q8_0, Q.Q4_K: Q.Q5_0}[high] if narrow else high)
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{layer}.{part}.weight"] == (Q.Q5_0 if narrow else Q.Q4_K)
        for part in ("attn_norm", "ffn_norm"):
            assert types[f"blk.{layer}.{part}.weight"] == Q.F32
    output = Q.Q8_0 if narrow else Q.Q6_K
    if config.tie_word_embeddings:
        assert types["token_embd.weight"] == output
    else:
        assert (types["token_embd.weight"], types["output.weight"]) == (Q.Q4_K, output)
    assert {t for n, t in types.items() if n.endswith(".bias")} <= {Q.F32}


def test_q4_1_is_the_demo_files_mix() -> None:
    config = PUBLISHED_CONFIGS["llama-3.1-8b"]
    types = _types(config, "q4_1")
    assert types.pop("token_embd.weight") == types.pop("output.weight") == Q.Q8_0
    assert {n for n, t in types.items() if t == Q.F32} == {n for n in types if "norm" in n or "rope" in n}
    assert {t for t in types.values() if t != Q.F32} == {Q.Q4_1}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_file_holds_the_published_structure(readers: dict[Case, GGUFReader], case: Case) -> None:
    name, mix, layers = case
    config = published_config(name).with_layers(layers)
    reader = readers[case]
    fields = {key: field.contents() for key, field in reader.fields.items()}
    arch = config.architecture
    expected = {
        "general.architecture": arch,
        f"{arch}.block_count": layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.rope.freq_base": pytest.approx(config.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": pytest.approx(config.rms_norm_eps),
        "general.file_type": {"q4_1": 3, "q4_k_m": 15}[mix],
        "general.quantization_version": 2,
    }
    if arch == "llama":
        expected |= {"llama.vocab_size": VOCAB, "llama.rope.dimension_count": config.head_size}
    assert {key: fields.get(key) for key in expected} == expected
    assert (f"{arch}.attention.key_length" in fields) is (config.head_dim is not None)
    assert f"{VOCAB} tokens instead of {config.published_vocab_size}" in fields["general.description"]
    # The tensors: the plan's names, in its order, with its shapes (GGUF lists dimensions innermost first).
    plan = tensor_plan(config, VOCAB)
    assert [t.name for t in reader.tensors] == [spec.name for spec in plan]
    assert [tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors] == [spec.shape for spec in plan]
    types = _types(config, mix)
    assert {t.name: t.tensor_type for t in reader.tensors} == types


def test_the_tokenizer_is_the_demo_files_byte_for_byte(readers: dict[Case, GGUFReader]) -> None:
    demo = GGUFReader(tokenizer_gguf())
    wanted = {key: field for key, field in demo.fields.items() if key.startswith("tokenizer.")}
    for case in (LLAMA_1B, QWEN_7B):
        got = {key: field for key, field in readers[case].fields.items() if key.startswith("tokenizer.")}
        assert list(got) == list(wanted)
        for key, field in wanted.items():
            assert got[key].types == field.types
            assert b"".join(bytes(got[key].parts[i]) for i in got[key].data) == b"".join(
                bytes(field.parts[i]) for i in field.data
            ), key


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_weights_dequantize_finite_with_the_chosen_spread(readers: dict[Case, GGUFReader], case: Case) -> None:
    config = published_config(case[0])
    for tensor in readers[case].tensors:
        values = dequantize(_sampled_rows(tensor.data), tensor.tensor_type).astype(np.float64)
        assert np.isfinite(values).all(), tensor.name
        if tensor.name.endswith("norm.weight"):
            assert abs(values.mean() - 1) < 0.02 and 0.08 < values.std() < 0.12, tensor.name
        elif tensor.name.endswith(".bias"):
            assert values.std() == pytest.approx(BIAS_STD, rel=0.25) and abs(values.mean()) < 0.2, tensor.name
        elif tensor.name in ("output.weight", "token_embd.weight"):
            makes_logits = config.tie_word_embeddings or tensor.name == "output.weight"
            std = LOGIT_STD / np.sqrt(config.hidden_size) if makes_logits else LINEAR_STD
            assert values.std() == pytest.approx(std, rel=0.1), tensor.name
            assert abs(values.mean()) < 0.01 * std, tensor.name
        elif tensor.name.endswith(".weight") and tensor.name != "rope_freqs.weight":
            assert values.std() == pytest.approx(LINEAR_STD, rel=0.1), tensor.name
            assert abs(values.mean()) < 0.02 * LINEAR_STD, tensor.name


@pytest.mark.parametrize("case", TRANSFORMERS_CASES, ids=["-".join(map(str, case)) for case in TRANSFORMERS_CASES])
def test_transformers_reads_the_published_structure(written: dict[Case, Path], case: Case) -> None:
    name, _, layers = case
    config = published_config(name).with_layers(layers)
    path = written[case]
    loaded = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    wanted = config.hf_config(VOCAB)
    keys = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    keys += ["num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "vocab_size"]
    assert {key: loaded[key] for key in keys} == {key: wanted[key] for key in keys}
    assert loaded["rope_parameters"]["rope_theta"] == pytest.approx(config.rope_theta)
    assert loaded["rms_norm_eps"] == pytest.approx(config.rms_norm_eps)
    assert loaded.get("head_dim", config.head_size) == config.head_size


def test_the_llama3_rope_factors_are_the_converters(readers: dict[Case, GGUFReader]) -> None:
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, for Llama 3.2 (factor 32, head_dim 64).
    freqs = 1.0 / (500000.0 ** (np.arange(0, 64, 2, dtype=np.float64) / 64))
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    factors = np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 32.0, 1 / ((1 - smooth) / 32 + smooth)))
    stored = next(t for t in readers[LLAMA_1B].tensors if t.name == "rope_freqs.weight")
    assert stored.tensor_type == Q.F32
    np.testing.assert_allclose(np.asarray(stored.data), factors, rtol=1e-5)


@pytest.mark.parametrize("case", [LLAMA_1B, LLAMA_1B_Q4_1], ids=CASE_IDS[:2])
def test_q_and_k_rows_are_permuted_as_the_converter_does(readers: dict[Case, GGUFReader], case: Case) -> None:
    """transformers' GGUF loader undoes the converter's permutation: on the file's q/k it must give the weights
    in the Hugging Face order the generator drew them in; v is never permuted."""
    name, mix, layers = case
    config = published_config(name).with_layers(layers)
    undo = LlamaTensorProcessor(
        config={"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    )
    stored = {t.name: t for t in readers[case].tensors}
    for spec in tensor_plan(config, VOCAB):
        if spec.layer != layers - 1 or spec.name.split(".")[2] not in ("attn_q", "attn_k", "attn_v"):
            continue
        qtype = tensor_type(spec, config, mix)
        drawn = dequantize(hf_order_tensor(spec, qtype, config, seed=7), qtype)
        in_file = dequantize(stored[spec.name].data, qtype)
        assert not np.array_equal(in_file, drawn) or spec.name.endswith("attn_v.weight")
        np.testing.assert_array_equal(undo.process(in_file, spec.name).weights, drawn)


def test_the_permutation_pairs_rotary_halves_and_round_trips() -> None:
    heads, head_dim = 4, 8
    rows = np.arange(heads * head_dim)
    permuted = permute_rows(rows, heads)
    # Within head 0, Hugging Face's rotary pairs (i, i + 4) become neighbours (2i, 2i + 1).
    assert permuted[:head_dim].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    undo = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": heads})
    assert undo.process(permuted, "blk.0.attn_q.weight").weights.tolist() == rows.tolist()
    blocks = np.arange(heads * head_dim * 3).reshape(heads * head_dim, 3)  # rows of blocks move whole
    assert (permute_rows(blocks, heads)[:, 0] // 3).tolist() == permuted.tolist()


def test_k_quant_blocks_read_back_centred_with_the_wanted_spread() -> None:
    rng = np.random.default_rng(3)
    q4_k = dequantize(random_q4_k_blocks(rng, 4096, 0.02), Q.Q4_K).reshape(4096, 8, 32)
    assert q4_k.std() == pytest.approx(0.02, rel=0.05)
    # Each sub-block spans d*sc*[0, 15] - dmin*m with m ~ 15/16 sc and dmin = 8 d: its minimum sits at about half
    # its range below zero. A scale or minimum unpacked from the wrong bits (ggml's 6-bit packing) breaks that.
    low, high = q4_k.min(axis=2), q4_k.max(axis=2)
    ratio = -low / (high - low)
    assert np.all(np.abs(np.median(ratio, axis=0) - 0.5) < 0.03)
    q6_k = dequantize(random_q6_k_blocks(rng, 4096, 0.02), Q.Q6_K).reshape(4096, 16, 16)
    assert q6_k.std() == pytest.approx(0.02, rel=0.05) and abs(q6_k.mean()) < 0.001
    assert np.isfinite(q4_k).all() and np.isfinite(q6_k).all()


def test_the_cache_reuses_a_file_and_a_seed_changes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXFN_CACHE_DIR", str(tmp_path))
    first = synthetic_gguf("qwen2.5-0.5b", "q4_k_m", seed=1, layers=1)
    written_at = first.stat().st_mtime_ns
    again = synthetic_gguf("qwen2.5-0.5b", "q4_k_m", seed=1, layers=1)
    assert again == first and again.stat().st_mtime_ns == written_at
    other = synthetic_gguf("qwen2.5-0.5b", "q4_k_m", seed=2, layers=1)
    assert other.parent != first.parent
    digest = [hashlib.sha256(path.read_bytes()).hexdigest() for path in (first, other)]
    assert digest[0] != digest[1]
    # The same seed written elsewhere gives the same bytes.
    rewritten = write_synthetic_gguf(published_config("qwen2.5-0.5b").with_layers(1), tmp_path / "x.gguf", "q4_k_m", 1)
    assert hashlib.sha256(rewritten.read_bytes()).hexdigest() == digest[0]
    assert not list(tmp_path.glob(".*partial*"))


_WRITE_AND_REPORT = """
import sys
from pathlib import Path
from packager.synthetic import published_config, write_synthetic_gguf

def status_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

baseline = status_kib("VmRSS")  # after the imports
write_synthetic_gguf(published_config("llama-3.2-1b"), Path(sys.argv[1]), "q4_k_m", seed=0)
print(baseline, status_kib("VmHWM"))
"""


def test_writing_the_full_1b_file_holds_one_tensor_at_a_time(tmp_path: Path) -> None:
    out = tmp_path / "llama-3.2-1b.gguf"
    report = subprocess.run(
        [sys.executable, "-c", _WRITE_AND_REPORT, str(out)], capture_output=True, text=True, check=True
    ).stdout
    # VmHWM: the kernel's high-water mark of the child's resident memory (exact, where sampling could miss the
    # peak). Not the child's ru_maxrss: that starts from the forking parent's RSS, pytest's gigabytes.
    baseline, peak = (int(kib) * 1024 for kib in report.split())
    reader = GGUFReader(out)
    largest = max(int(t.n_bytes) for t in reader.tensors)
    assert largest == VOCAB * 2048 // 256 * 210  # the tied embedding, Q6_K
    assert peak - baseline <= largest + 300 * 2**20, (peak, baseline, largest)
    assert out.stat().st_size > 2 * (peak - baseline)  # the file is far larger than what writing it held
    config = published_config("llama-3.2-1b")
    assert {t.name: t.tensor_type for t in reader.tensors} == _types(config, "q4_k_m")
    q6_k_layers = {
        int(t.name.split(".")[1])
        for t in reader.tensors
        if t.name.endswith("attn_v.weight") and t.tensor_type == Q.Q6_K
    }
    assert q6_k_layers == Q6_K_LAYERS[16]
