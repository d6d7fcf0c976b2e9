"""gpt-oss's config.json from a GGUF file's metadata, which transformers (5.23) cannot read.

transformers' GGUF loader fails on every gpt-oss file llama.cpp writes: it reads the `gpt-oss.rope.scaling.*`
values from the field's first part (the key's length, not its value) and raises `TypeError`. So the config is read
here, from the keys convert_hf_to_gguf.py's GptOssModel writes (TextModel's, the sliding window, the experts'
feed-forward length, YaRN's type, factor and original context). What the file does not say is gpt-oss's own,
as published (openai/gpt-oss-20b's config.json) and as llama.cpp hard-codes it: the SwiGLU clamp (7.0), biased
attention, sliding windows on the even layers, and YaRN's `beta_fast` 32, `beta_slow` 1 and `truncate: false`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packager.sources.gguf_metadata import read_metadata

ARCHITECTURE = "gpt-oss"  # llama.cpp's general.architecture
_PUBLISHED = {
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "hidden_act": "silu",
}
_YARN_PUBLISHED = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def gpt_oss_config(path: Path) -> Any:
    """The `GptOssConfig` of the gpt-oss GGUF at `path`."""
    from transformers import GptOssConfig

    metadata = read_metadata(path)
    fields = metadata.fields

    def value(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    def required(key: str) -> Any:
        found = value(f"{ARCHITECTURE}.{key}")
        if found is None:
            raise ValueError(f"{path.name} has no {ARCHITECTURE}.{key}")
        return found

    layers = int(required("block_count"))
    heads = int(required("attention.head_count"))
    hidden = int(required("embedding_length"))
    tokens = value("tokenizer.ggml.tokens")
    vocab = value(f"{ARCHITECTURE}.vocab_size", len(tokens) if tokens is not None else None)
    rope: dict[str, Any] = {"rope_type": "default"}
    if value(f"{ARCHITECTURE}.rope.scaling.type") == "yarn":
        rope = {
            "rope_type": "yarn",
            "factor": float(required("rope.scaling.factor")),
            "original_max_position_embeddings": int(required("rope.scaling.original_context_length")),
            **_YARN_PUBLISHED,
        }
    rope["rope_theta"] = float(required("rope.freq_base"))
    config: dict[str, Any] = {
        **_PUBLISHED,
        "num_hidden_layers": layers,
        "max_position_embeddings": int(required("context_length")),
        "hidden_size": hidden,
        "intermediate_size": int(value(f"{ARCHITECTURE}.expert_feed_forward_length", required("feed_forward_length"))),
        "num_attention_heads": heads,
        "num_key_value_heads": int(required("attention.head_count_kv")),
        "head_dim": int(value(f"{ARCHITECTURE}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "num_local_experts": int(required("expert_count")),
        "num_experts_per_tok": int(required("expert_used_count")),
        "experts_per_token": int(required("expert_used_count")),
        "sliding_window": int(required("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in metadata.tensors,
        "vocab_size": int(vocab) if vocab is not None else None,
    }
    for name, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        token = value(f"tokenizer.ggml.{key}")
        if token is not None:
            config[name] = int(token)
    return GptOssConfig(**{k: v for k, v in config.items() if v is not None})
