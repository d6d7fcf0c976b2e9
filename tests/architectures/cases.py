"""Tiny models of the architectures users bring, each made from its real published config.

Every structural key of the published config.json is kept (rope type and scaling, sliding windows, soft-capping,
partial rotary, q/k norms, tied or untied heads, biases, head_dim); only the sizes shrink (`TINY`), and context
lengths shrink with them so that a test prompt runs past a rope-scaled model's original context. The tokenizer and
ChatML template are the tiny Llama's (tests/fixtures/tiny_llama.py): 384 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 384,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
ORIGINAL_CONTEXT = 64  # the tiny stand-in for a rope-scaled model's original_max_position_embeddings
LONG_PROMPT = 200  # tokens: past ORIGINAL_CONTEXT, within max_position_embeddings


@dataclass(frozen=True)
class Case:
    name: str  # the test id
    hf_class: str  # config.json's architectures[0]
    model_type: str
    published: dict[str, Any]  # the structural keys of the published config named in `source`
    source: str  # which published config they come from
    shrink: dict[str, Any] = field(default_factory=dict)  # sizes of this case on top of TINY
    long_prompt: bool = False  # also checked on a LONG_PROMPT-token prompt (rope scaling past ORIGINAL_CONTEXT)

    def config(self) -> dict[str, Any]:
        return {**self.published, **TINY, **self.shrink, "architectures": [self.hf_class]}


CASES: tuple[Case, ...] = (
    Case(
        "llama3-2",
        "LlamaForCausalLM",
        "llama",
        source="meta-llama/Llama-3.2-1B",
        published={
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
            },
        },
        shrink={"head_dim": 16},
        long_prompt=True,
    ),
    Case(
        "mistral",
        "MistralForCausalLM",
        "mistral",
        source="mistralai/Mistral-7B-v0.1",
        published={"rope_theta": 10000.0, "sliding_window": 32, "tie_word_embeddings": False, "hidden_act": "silu"},
    ),
    Case(
        "qwen2-5",
        "Qwen2ForCausalLM",
        "qwen2",
        source="Qwen/Qwen2.5-1.5B-Instruct",
        published={
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
        },
    ),
    Case(
        "qwen3",
        "Qwen3ForCausalLM",
        "qwen3",
        source="Qwen/Qwen3-0.6B",
        published={
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "head_dim": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
        },
    ),
    Case(
        "phi3-mini-4k",
        "Phi3ForCausalLM",
        "phi3",
        source="microsoft/Phi-3-mini-4k-instruct",
        published={
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "sliding_window": 2047,
            "original_max_position_embeddings": 256,
            "hidden_act": "silu",
        },
    ),
)
