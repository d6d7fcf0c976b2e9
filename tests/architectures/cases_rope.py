"""Tiny models of rope-scaled decoders, each made from its real published config, checked past the original context.

Each keeps the published rope parameters (kind, factors, partial rotary) with the original context shrunk to
ORIGINAL_CONTEXT and `max_position_embeddings` to TINY's 256, so that the 200-token test prompt runs past the original
context. Long lists of per-dimension factors (longrope) keep every k-th published value, as many as the tiny rotary
dimension has frequencies. GroupQueryAttention wants the half rotary dimension a multiple of 8, as every published
model has it: the tiny head dimensions are chosen for that.
"""

from __future__ import annotations

from tests.architectures.cases import ORIGINAL_CONTEXT, Case

# microsoft/Phi-3.5-mini-instruct, config.json's rope_scaling (48 frequencies: head_dim 96, full rotary).
PHI3_5_LONG_FACTOR = (
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
)  # fmt: skip
PHI3_5_SHORT_FACTOR = (
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533,
)  # fmt: skip
# microsoft/Phi-4-mini-instruct, config.json's rope_scaling (48 frequencies: head_dim 128, partial rotary 0.75);
# its short factors are all 1.0.
PHI4_MINI_LONG_FACTOR = (
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23,
    32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
)  # fmt: skip


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
