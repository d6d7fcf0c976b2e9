"""A GGUF's rope scaling reaches the config a GGUF build runs from (sources/gguf_rope.py).

Each GGUF here holds what llama.cpp's converter writes for a published model's rope scaling (tensors and metadata
only: transformers reads a config from no more), and the config made from it must rotate as transformers rotates the
published config: the same inverse frequencies and attention factor, in every regime.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from packager.progress import StepProgress
from packager.sources.gguf import gguf_config_folder
from packager.synthetic import published_config
from packager.synthetic.weights import llama3_rope_factors
from tests.architectures.published_rope import PHI3_5_LONG_FACTOR, PHI3_5_SHORT_FACTOR


def _gguf(path: Path, architecture: str, head_dim: int, keys: dict[str, Any], tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF with a two-head decoder's metadata, the given rope metadata and tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(131072)
    writer.add_embedding_length(2 * head_dim)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(32064)  # past Phi-3's pad id
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    for name, array in tensors.items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _config_from(gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The config.json a GGUF build runs from, as transformers loads it."""
    from transformers import AutoConfig

    from tests.fixtures.tiny_llama import make_tiny_llama

    monkeypatch.setenv("ONNXFN_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = make_tiny_llama(tmp_path / "tokenizer")  # beside the GGUF: its tokenizer is not read
    folder, _, _ = gguf_config_folder(
        gguf_path, gguf_path.name, str(gguf_path), StepProgress(), tokenizer_from=tokenizer
    )
    return AutoConfig.from_pretrained(folder)


def _published(model_type: str, **keys: Any) -> Any:
    """A published config's rope (on two heads of the same head size as the GGUF's)."""
    from transformers import AutoConfig

    keys = {"num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 131072, **keys}
    return AutoConfig.for_model(model_type, vocab_size=32064, **keys)


def _rotation(config: Any, positions: int) -> tuple[np.ndarray, float]:
    """transformers' inverse frequencies and attention factor for a sequence of `positions` tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    rotary = type(model.model.rotary_emb)(config)
    rotary(torch.zeros(1), torch.arange(positions)[None, :])  # a longrope module picks its factors here
    return rotary.inv_freq.numpy().copy(), float(rotary.attention_scaling)


def _assert_same_rotation(ours: Any, published: Any, positions: int) -> None:
    (inv_freq, scaling), (expected, expected_scaling) = _rotation(ours, positions), _rotation(published, positions)
    np.testing.assert_allclose(inv_freq, expected, rtol=2e-6)
    assert scaling == pytest.approx(expected_scaling, rel=1e-6)


def test_llama3_rope_freqs_rotate_as_the_published_llama3_scaling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama = published_config("llama-3.2-1b")  # head_dim 64, rope_theta 500000, llama3 factor 32 from 8192
    factors = llama3_rope_factors(llama)  # the converter's rope_freqs.weight
    path = _gguf(tmp_path / "llama.gguf", "llama", 64, {"rope_freq_base": 500000.0}, {"rope_freqs.weight": factors})
    ours = _config_from(path, tmp_path, monkeypatch)
    assert llama.rope_scaling is not None
    scaling = {"rope_type": "llama3", **dataclasses.asdict(llama.rope_scaling)}
    published = _published("llama", hidden_size=128, head_dim=64, rope_theta=500000.0, rope_scaling=scaling)
    for positions in (100, 9000):
        _assert_same_rotation(ours, published, positions)
    unscaled = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    assert not np.allclose(_rotation(ours, 100)[0], unscaled, rtol=1e-3)  # what the config had without the GGUF's


def test_phi3_5_long_and_short_factors_rotate_as_the_published_longrope(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attention = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))  # what the converter writes
    keys = {"rope_freq_base": 10000.0, "rope_scaling_orig_ctx_len": 4096, "rope_scaling_attn_factors": attention}
    tensors = {"rope_factors_long.weight": np.array(PHI3_5_LONG_FACTOR),
               "rope_factors_short.weight": np.array(PHI3_5_SHORT_FACTOR)}  # fmt: skip
    ours = _config_from(_gguf(tmp_path / "phi3.gguf", "phi3", 96, keys, tensors), tmp_path, monkeypatch)
    scaling = {"type": "longrope", "long_factor": list(PHI3_5_LONG_FACTOR), "short_factor": list(PHI3_5_SHORT_FACTOR)}
    published = _published(
        "phi3", hidden_size=192, original_max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=scaling
    )
    for positions in (4096, 4097):  # the short factors, then the long ones
        _assert_same_rotation(ours, published, positions)


def test_yarn_metadata_rotates_as_the_published_yarn_scaling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    keys = {"rope_freq_base": 1000000.0, "rope_scaling_type": gguf.RopeScalingType.YARN, "rope_scaling_factor": 4.0,
            "rope_scaling_orig_ctx_len": 32768}  # fmt: skip
    ours = _config_from(_gguf(tmp_path / "qwen2.gguf", "qwen2", 128, keys, {}), tmp_path, monkeypatch)
    scaling = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    published = _published("qwen2", hidden_size=256, rope_theta=1000000.0, rope_scaling=scaling)
    _assert_same_rotation(ours, published, 100)
    assert _rotation(ours, 100)[1] == pytest.approx(0.1 * math.log(4.0) + 1)  # yarn's attention factor kept
