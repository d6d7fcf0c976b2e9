"""The synthetic Qwen3-MoE GGUF (packager/synthetic/qwen3_moe.py), at a tiny shape: a qwen3moe file whose metadata
says that shape, every tensor named as llama.cpp's QWEN3MOE architecture names them, in the mix asked for, at the
spread promised. (That onnxfn reads a qwen3moe file's config, the expert length transformers drops included, is
tests/architectures/test_qwen_moe.py's; that llama.cpp runs this generator's file is the MoE bench's.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from gguf import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType
from gguf.quants import dequantize

from packager.sources.gguf import gguf_architecture
from packager.sources.gguf_metadata import mapped_tensors, read_metadata
from packager.synthetic.qwen3_moe import MIXES, QWEN3_30B_A3B, write_qwen3_moe_gguf

Q = GGMLQuantizationType
TINY = dataclasses.replace(
    QWEN3_30B_A3B, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
)  # fmt: skip


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_the_synthetic_qwen3_moe_gguf_reads_back_as_its_shape(mix: str, tmp_path: Path) -> None:
    path = write_qwen3_moe_gguf(TINY, tmp_path / "tiny-qwen3-moe.gguf", mix, seed=3)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left beside it
    assert gguf_architecture(path) == "qwen3_moe"
    fields = read_metadata(path).fields
    for key, value in (("embedding_length", TINY.hidden_size), ("expert_feed_forward_length",
                       TINY.moe_intermediate_size), ("block_count", TINY.num_hidden_layers), ("attention.head_count",
                       TINY.num_attention_heads), ("attention.head_count_kv", TINY.num_key_value_heads),
                       ("attention.key_length", TINY.head_dim), ("expert_count", TINY.num_experts),
                       ("expert_used_count", TINY.num_experts_per_tok)):  # fmt: skip
        assert fields[f"qwen3moe.{key}"] == value, key

    known = {TENSOR_NAMES[kind] for kind in MODEL_TENSORS[MODEL_ARCH.QWEN3MOE]}
    _, tensors = mapped_tensors(path)  # gguf's ReaderTensors, without GGUFReader's parse of the vocabulary
    assert len(tensors) == 3 + 12 * TINY.num_hidden_layers
    for name, tensor in tensors.items():
        assert name.removesuffix(".weight").replace(".0.", ".{bid}.").replace(".1.", ".{bid}.") in known, name
        kind = name.removesuffix(".weight").split(".")[-1]
        if tensor.data.ndim == 1 or kind == "ffn_gate_inp" or kind.endswith("_norm"):
            expected = Q.F32
        else:
            expected = MIXES[mix].get(kind, Q.Q8_0)
        assert tensor.tensor_type == expected, name
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    experts = dequantize(gate.data, gate.tensor_type)
    assert experts.shape == (TINY.num_experts, TINY.moe_intermediate_size, TINY.hidden_size)
    assert 0.01 < experts.std() < 0.04  # drawn around 0.02, as the other matrices
