"""Tiny Mixture-of-Experts models, each made from its real published config (experts and sizes shrunk).

Every structural key of the published config.json is kept: the number of experts per token, the router's
normalisation, sliding windows and attention sinks, the SwiGLU clamp; the expert count shrinks with the sizes.
"""

from __future__ import annotations

from tests.architectures.cases import ORIGINAL_CONTEXT, Case

GPT_OSS = Case(
    "gpt-oss",
    "GptOssForCausalLM",
    "gpt_oss",
    source="openai/gpt-oss-20b",
    published={
        "attention_bias": True,
        "head_dim": 64,
        "hidden_act": "silu",
        "layer_types": ["sliding_attention", "full_attention"],
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "truncate": False,
        },
        "rope_theta": 150000.0,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
    },
    # 8 of gpt-oss-20b's 32 experts, 4 per token as published; a window and an original context (4096 published)
    # the test prompts run past.
    shrink={"num_local_experts": 8, "intermediate_size": 64, "sliding_window": 32},
    long_prompt=True,
)

# GraniteMoeHybrid as Granite 4.0 Micro publishes it: attention layers only and no routed experts (the MoE class's
# dense member; its Mamba-2 and expert configs, Granite 4.0 H, are refused: test_moe.py).
GRANITE_4_MICRO = Case(
    "granite-4-micro",
    "GraniteMoeHybridForCausalLM",
    "granitemoehybrid",
    source="ibm-granite/granite-4.0-micro",
    published={
        "attention_bias": False,
        "attention_multiplier": 0.015625,
        "embedding_multiplier": 12.0,
        "hidden_act": "silu",
        "layer_types": ["attention", "attention"],
        "logits_scaling": 10.0,
        "normalization_function": "rmsnorm",
        "num_experts_per_tok": 0,
        "num_local_experts": 0,
        "position_embedding_type": "rope",
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": True,
    },
    shrink={"shared_intermediate_size": 128},  # its MLP's size (intermediate_size is the absent experts')
)

# Qwen3-30B-A3B: 8 of 128 experts a token, renormalised; q/k norms; untied head. 16 experts here, 8 a token.
QWEN3_MOE = Case(
    "qwen3-moe",
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    source="Qwen/Qwen3-30B-A3B",
    published={
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_experts_per_tok": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    shrink={"num_experts": 16, "moe_intermediate_size": 32, "head_dim": 16},
)

# Qwen1.5-MoE-A2.7B: 4 of 60 experts a token, not renormalised, plus a shared expert behind a sigmoid gate; q/k/v
# biases. 16 experts here, 4 a token.
QWEN2_MOE = Case(
    "qwen2-moe",
    "Qwen2MoeForCausalLM",
    "qwen2_moe",
    source="Qwen/Qwen1.5-MoE-A2.7B",
    published={
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "num_experts_per_tok": 4,
        "qkv_bias": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    shrink={"num_experts": 16, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128},
)

MOE_CASES: tuple[Case, ...] = (GPT_OSS, GRANITE_4_MICRO, QWEN3_MOE, QWEN2_MOE)
