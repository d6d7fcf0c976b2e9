"""Tiny models of rope-scaled decoders, each made from its real published config, checked past the original context.

Each keeps the published rope parameters (kind, factors, partial rotary) with the original context shrunk to
ORIGINAL_CONTEXT and `max_position_embeddings` to TINY's 256, so that the 200-token test prompt runs past the original
context. Long lists of per-dimension factors (longrope) keep every k-th published value, as many as the tiny rotary
dimension has frequencies. GroupQueryAttention wants the half rotary dimension a multiple of 8, as every published
model has it: the tiny head dimensions are chosen for that.
"""

from __future__ import annotations

from tests.architectures.cases import ORIGINAL_CONTEXT, Case
from tests.architectures.published_rope import PHI3_5_LONG_FACTOR, PHI3_5_SHORT_FACTOR, PHI4_MINI_LONG_FACTOR


def every(values: tuple[float, ...], count: int) -> list[float]:
    """`count` of the published per-frequency factors, evenly spread, first and last kept."""
    step = (len(values) - 1) / (count - 1)
    return [float(values[round(i * step)]) for i in range(count)]


ROPE_CASES: tuple[Case, ...] = (
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
        "phi4-mini-longrope",
        "Phi3ForCausalLM",
        "phi3",
        source="microsoft/Phi-4-mini-instruct",
        published={
            "attention_bias": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "tie_word_embeddings": True,
            "sliding_window": 262144,
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": every(PHI4_MINI_LONG_FACTOR, 24),
                "short_factor": [1.0] * 24,
            },
        },
        # 3 query heads to 1 KV head (the published 24:8) of head_dim 64: 48 rotary dims, 24 frequencies.
        shrink={"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1},
        long_prompt=True,
    ),
    Case(
        "phi3-5-mini-longrope",
        "Phi3ForCausalLM",
        "phi3",
        source="microsoft/Phi-3.5-mini-instruct",
        published={
            "attention_bias": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "sliding_window": 262144,
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": every(PHI3_5_LONG_FACTOR, 8),
                "short_factor": every(PHI3_5_SHORT_FACTOR, 8),
            },
        },
        shrink={"num_key_value_heads": 4},  # as many KV heads as query heads, as published; head_dim 16
        long_prompt=True,
    ),
    Case(
        "qwen2-5-yarn",
        "Qwen2ForCausalLM",
        "qwen2",
        # the YaRN rope_scaling its model card adds for contexts past 32768, without beta_fast/beta_slow
        source="Qwen/Qwen2.5-7B-Instruct",
        published={
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT, "type": "yarn"},
        },
        long_prompt=True,
    ),
    Case(
        "qwen3-yarn",
        "Qwen3ForCausalLM",
        "qwen3",
        # the YaRN rope_scaling its model card adds for contexts past 32768 (q/k norms, head_dim 128 published)
        source="Qwen/Qwen3-8B",
        published={
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
            },
        },
        shrink={"head_dim": 16},
        long_prompt=True,
    ),
    Case(
        "deepseek-coder-linear",
        "LlamaForCausalLM",
        "llama",
        # linear scaling by 4 of a 4096-token Llama to 16384; here of ORIGINAL_CONTEXT to TINY's 256
        source="deepseek-ai/deepseek-coder-6.7b-instruct",
        published={
            "rope_theta": 100000.0,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_scaling": {"factor": 4.0, "type": "linear"},
        },
        long_prompt=True,
    ),
    Case(
        "internvl3-qwen2-dynamic",
        "Qwen2ForCausalLM",
        "qwen2",
        # InternVL3-1B's language model: dynamic NTK by 2, which rescales only past max_position_embeddings
        source="OpenGVLab/InternVL3-1B (llm_config)",
        published={
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_scaling": {"factor": 2.0, "type": "dynamic"},
        },
        long_prompt=True,
    ),
    Case(
        "gemma3-4b-linear-global",
        "Gemma3ForCausalLM",
        "gemma3_text",
        # Gemma 3 4B+: linear scaling by 8 on the global layers only, the sliding layers' rope unscaled
        source="google/gemma-3-4b-it (text_config)",
        published={
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
        # one sliding and one global layer (the published 5:1 pattern cut to 2 layers); a window the prompt passes
        shrink={
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        long_prompt=True,
    ),
)
