"""The synthetic gpt-oss GGUF (packager/synthetic/gpt_oss.py), at a tiny shape: onnxfn reads it back as the
gpt-oss config of that shape, each tensor in the type mix llama-quantize's MXFP4_MOE writes, and the random
weights at the spread the generator promises (the MXFP4 experts' exponent bytes included)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from packager.sources.gguf import gguf_architecture
from packager.sources.gguf_gpt_oss import gpt_oss_config
from packager.synthetic.gpt_oss import GPT_OSS_20B, mxfp4_bytes_per_weight, write_gpt_oss_gguf

Q = GGMLQuantizationType
TINY = dataclasses.replace(
    GPT_OSS_20B, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
)  # fmt: skip


def test_the_synthetic_gpt_oss_gguf_reads_back_as_its_shape(tmp_path: Path) -> None:
    path = write_gpt_oss_gguf(TINY, tmp_path / "tiny-gpt-oss.gguf", seed=3)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left beside it
    assert gguf_architecture(path) == "gpt_oss"
    config = gpt_oss_config(path)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window")  # fmt: skip
    for key in keys:
        assert getattr(config, key) == getattr(TINY, key), key
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == TINY.rope_factor
    assert config.rope_parameters["original_max_position_embeddings"] == TINY.original_context

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert len(tensors) == 3 + 19 * TINY.num_hidden_layers
    for name, tensor in tensors.items():
        if "_exps.weight" in name:
            expected = Q.MXFP4
        elif tensor.data.ndim == 1 or "ffn_gate_inp" in name or name.endswith(".bias"):
            expected = Q.F32
        else:
            expected = Q.Q8_0
        assert tensor.tensor_type == expected, name
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert gate.data.nbytes == TINY.num_local_experts * TINY.intermediate_size * TINY.hidden_size * 17 / 32
    assert mxfp4_bytes_per_weight() == 17 / 32
    experts = dequantize(gate.data, gate.tensor_type)
    assert experts.shape == (TINY.num_local_experts, TINY.intermediate_size, TINY.hidden_size)
    assert 0.01 < experts.std() < 0.04  # drawn around 0.02, as the other matrices
    q = tensors["blk.0.attn_q.weight"]
    assert abs(dequantize(q.data, q.tensor_type).std() - 0.02) < 0.002
    norm = tensors["blk.0.attn_norm.weight"].data
    assert abs(norm.mean() - 1) < 0.05
