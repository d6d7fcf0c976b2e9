"""Dense architectures whose GGUF files transformers 5.23 cannot read (its GGUF_SUPPORTED_ARCHITECTURES lacks them):
the config from the file's metadata, and the inverse of what llama.cpp's converter did to their tensors.

For each, what llama.cpp's convert_hf_to_gguf.py writes (its `conversion/` modules) read back:
- the metadata keys `TextModel.set_gguf_parameters` writes (lengths, head counts, rope base, norm epsilon) and the
  architecture's own (Granite's four multipliers, OLMo's q/k/v clamp, Phi-2's partial rotary as a rotary
  dimension count, `key_length` where the config has a `head_dim`); what llama.cpp hard-codes instead of writing
  (SmolLM3's NoPE every fourth layer, HunYuan's q/k norms, OLMo's norm epsilon) comes from the config's defaults;
- tensors: the converter's Llama q/k row permutation (Granite, OLMo and SmolLM3 convert as Llama subclasses)
  and Gemma's `+ 1` on norm weights are undone by transformers' own processors for those operations.
`tie_word_embeddings` is whether the file has an `output.weight`, as transformers decides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packager.sources.gguf_metadata import read_metadata

_COMMON = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}


@dataclass(frozen=True)
class DenseGguf:
    model_type: str  # transformers'
    keys: dict[str, str]  # GGUF metadata key (after "<architecture>.") -> config key
    undo: str = ""  # the converter's tensor transform to undo: "llama" (q/k permutation), "gemma" (norm + 1)
    fixed: dict[str, Any] = field(default_factory=dict)  # config values the converter does not write


DENSE_GGUF: dict[str, DenseGguf] = {
    "gemma": DenseGguf("gemma", {**_COMMON, "attention.key_length": "head_dim"}, undo="gemma"),
    "granite": DenseGguf(
        "granite",
        {
            **_COMMON,
            "attention.scale": "attention_multiplier",
            "embedding_scale": "embedding_multiplier",
            "residual_scale": "residual_multiplier",
            "logit_scale": "logits_scaling",
        },
        undo="llama",
    ),
    "olmo": DenseGguf("olmo", {**_COMMON, "attention.clamp_kqv": "clip_qkv"}, undo="llama"),
    "phi2": DenseGguf("phi", {**_COMMON, "attention.layer_norm_epsilon": "layer_norm_eps"}),
    "smollm3": DenseGguf("smollm3", dict(_COMMON), undo="llama", fixed={"no_rope_layer_interval": 4}),
    "ernie4_5": DenseGguf("ernie4_5", {**_COMMON, "attention.key_length": "head_dim"}),
    "hunyuan-dense": DenseGguf(
        "hunyuan_v1_dense", {**_COMMON, "attention.key_length": "head_dim"}, fixed={"use_qk_norm": True}
    ),
}
MODEL_TYPES = {architecture: entry.model_type for architecture, entry in DENSE_GGUF.items()}


def dense_config(gguf_path: Path) -> Any:
    """The transformers config of a GGUF file of one of DENSE_GGUF's architectures."""
    from transformers import AutoConfig

    metadata = read_metadata(gguf_path)
    architecture = metadata.architecture
    entry = DENSE_GGUF[architecture]
    values: dict[str, Any] = dict(entry.fixed)
    for key, config_key in entry.keys.items():
        if (value := metadata.fields.get(f"{architecture}.{key}")) is not None:
            values[config_key] = value
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if (value := metadata.fields.get(f"tokenizer.ggml.{key}")) is not None:
            values[key.replace("padding", "pad")] = int(value)
    tensors = metadata.tensors
    values["vocab_size"] = tensors["token_embd.weight"].shape[-1]
    values["tie_word_embeddings"] = "output.weight" not in tensors
    if architecture == "phi2":  # a rotary dimension count per head (the converter's int(partial * hidden) // heads)
        rotary = int(metadata.fields["phi2.rope.dimension_count"])
        values["partial_rotary_factor"] = rotary * values["num_attention_heads"] / values["hidden_size"]
    if architecture == "ernie4_5":
        values["use_bias"] = "blk.0.attn_q.bias" in tensors
    return AutoConfig.for_model(entry.model_type, **values)


def dense_processor(architecture: str, config: dict[str, Any]) -> Any | None:
    """transformers' processor that undoes the converter's transform of `architecture`'s tensors (None: not ours)."""
    from transformers.modeling_gguf_pytorch_utils import Gemma2TensorProcessor, LlamaTensorProcessor, TensorProcessor

    entry = DENSE_GGUF.get(architecture)
    if entry is None:
        return None
    processor = {"llama": LlamaTensorProcessor, "gemma": Gemma2TensorProcessor}.get(entry.undo, TensorProcessor)
    return processor(config=config)
