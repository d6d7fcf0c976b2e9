"""The published model shapes a synthetic GGUF can take: the structural keys of each model's config.json.

The hub is unreachable here, so the values are written down, each from the model's published config.json (the
repository named in `source`). Only the vocabulary is not theirs: a synthetic file carries the demo GGUF's
tokenizer (SmolLM2, 49,152 tokens), and `vocab_size` in the file says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from packager.errors import UserError


@dataclass(frozen=True)
class Llama3RopeScaling:
    """`rope_scaling` of type "llama3" (Llama 3.1/3.2): llama.cpp carries it as the `rope_freqs.weight` tensor."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class PublishedConfig:
    name: str  # the registry's key, e.g. "llama-3.2-1b"
    source: str  # the Hugging Face repository whose config.json these values are
    architecture: str  # the GGUF architecture llama.cpp's converter writes: "llama" or "qwen2"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None  # None where config.json has none (then hidden_size / num_attention_heads)
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool  # q/k/v biases (Qwen2)
    published_vocab_size: int  # the published tokenizer's; the synthetic file has the demo's

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def with_layers(self, layers: int) -> PublishedConfig:
        """The same shape with `layers` decoder layers: a small file for tests whose point is the format."""
        if layers < 1:
            raise UserError(f"a synthetic model needs at least one layer, not {layers}", exit_code=2)
        return dataclasses.replace(self, num_hidden_layers=layers)

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        """config.json of the Hugging Face model the synthetic file stands for (its vocabulary: `vocab_size`)."""
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM" if self.architecture == "llama" else "Qwen2ForCausalLM"],
            "model_type": self.architecture,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": vocab_size,
        }
        if self.head_dim is not None:
            config["head_dim"] = self.head_dim
        if self.rope_scaling is not None:
            config["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.architecture == "llama":
            config["attention_bias"] = self.attention_bias
        return config


_LLAMA_3_2_ROPE = Llama3RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA_3_1_ROPE = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

PUBLISHED_CONFIGS: dict[str, PublishedConfig] = {
    config.name: config
    for config in (
        PublishedConfig(
            "llama-3.2-1b", "meta-llama/Llama-3.2-1B", "llama", hidden_size=2048, intermediate_size=8192,
            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
            rope_scaling=_LLAMA_3_2_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=131072, attention_bias=False, published_vocab_size=128256,
        ),
        PublishedConfig(
            "llama-3.2-3b", "meta-llama/Llama-3.2-3B", "llama", hidden_size=3072, intermediate_size=8192,
            num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
            rope_scaling=_LLAMA_3_2_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=131072, attention_bias=False, published_vocab_size=128256,
        ),
        PublishedConfig(
            "llama-3.1-8b", "meta-llama/Llama-3.1-8B", "llama", hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=None, rope_theta=500000.0,
            rope_scaling=_LLAMA_3_1_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=False,
            max_position_embeddings=131072, attention_bias=False, published_vocab_size=128256,
        ),
        # Qwen2.5-0.5B's hidden size (896) is no multiple of 256: under q4_k_m its Q4_K and Q6_K tensors fall
        # back to Q5_0 and Q8_0, as llama.cpp's quantizer does.
        PublishedConfig(
            "qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "qwen2", hidden_size=896, intermediate_size=4864,
            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=None, rope_theta=1000000.0,
            rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=32768, attention_bias=True, published_vocab_size=151936,
        ),
        PublishedConfig(
            "qwen2.5-3b", "Qwen/Qwen2.5-3B", "qwen2", hidden_size=2048, intermediate_size=11008,
            num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, head_dim=None, rope_theta=1000000.0,
            rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=32768, attention_bias=True, published_vocab_size=151936,
        ),
        PublishedConfig(
            "qwen2.5-7b", "Qwen/Qwen2.5-7B", "qwen2", hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=None, rope_theta=1000000.0,
            rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=131072, attention_bias=True, published_vocab_size=152064,
        ),
    )
}  # fmt: skip


def published_config(name: str) -> PublishedConfig:
    try:
        return PUBLISHED_CONFIGS[name]
    except KeyError:
        known = ", ".join(PUBLISHED_CONFIGS)
        raise UserError(f"no published config named {name!r}; known: {known}", exit_code=2) from None
