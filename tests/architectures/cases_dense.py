"""Tiny dense decoders (no Mixture-of-Experts, no rope scaling), each made from its real published config.

Every structural key of the config.json named in `source` is kept (norms and their epsilons, activations, tied or
untied heads, biases, partial rotary, q/k norms, NoPE layers, sliding windows, soft-capping, the multipliers);
sizes shrink to TINY. Where ONNX Runtime's GroupQueryAttention needs it (a head size and half a rotary dimension
that are multiples of 8, as every published model has them) the tiny head size is chosen for that, and a layer
pattern (Gemma 3's every sixth layer global, SmolLM3's every fourth without rope) gets enough layers to show.
"""

from __future__ import annotations

from tests.architectures.cases import Case

DENSE_CASES: tuple[Case, ...] = (
    Case(
        "smollm2",
        "LlamaForCausalLM",
        "llama",
        source="HuggingFaceTB/SmolLM2-135M-Instruct",
        published={
            "attention_bias": False,
            "hidden_act": "silu",
            "mlp_bias": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000,
            "tie_word_embeddings": True,
        },
        shrink={"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48},  # 9:3 heads of 16
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
    Case(
        "gemma",
        "GemmaForCausalLM",
        "gemma",
        source="google/gemma-2b",
        published={
            "attention_bias": False,
            "head_dim": 256,
            "hidden_act": "gelu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },
        shrink={"head_dim": 32, "num_key_value_heads": 1},  # 8:1 heads published
    ),
    Case(
        "gemma2",
        "Gemma2ForCausalLM",
        "gemma2",
        source="google/gemma-2-2b-it",
        published={
            "attention_bias": False,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": True,
        },
        # Sliding and global layers alternate; the window shrinks below the test prompts.
        shrink={"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 32},
    ),
    Case(
        "gemma3-1b",
        "Gemma3ForCausalLM",
        "gemma3_text",
        source="google/gemma-3-1b-it",
        published={
            "attention_bias": False,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-6,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "tie_word_embeddings": True,
        },
        # Six layers: five sliding, the sixth global, as published; one KV head.
        shrink={
            "head_dim": 32,
            "num_key_value_heads": 1,
            "query_pre_attn_scalar": 32,
            "sliding_window": 32,
            "num_hidden_layers": 6,
        },
    ),
    Case(
        "granite-3-1",
        "GraniteForCausalLM",
        "granite",
        source="ibm-granite/granite-3.1-2b-instruct",
        published={
            "attention_bias": False,
            "attention_multiplier": 0.015625,
            "embedding_multiplier": 12.0,
            "hidden_act": "silu",
            "logits_scaling": 8.0,
            "mlp_bias": False,
            "residual_multiplier": 0.22,
            "rms_norm_eps": 1e-5,
            "rope_theta": 5000000.0,
            "tie_word_embeddings": True,
        },
    ),
    Case(
        "olmo",
        "OlmoForCausalLM",
        "olmo",
        source="allenai/OLMo-1B-hf",
        published={
            "attention_bias": False,
            "clip_qkv": None,
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },
        shrink={"num_key_value_heads": 4},  # multi-head attention, as published
    ),
    Case(
        "nemotron-mini",
        "NemotronForCausalLM",
        "nemotron",
        source="nvidia/Nemotron-Mini-4B-Instruct",
        published={
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "relu2",
            "mlp_bias": False,
            "norm_eps": 1e-5,
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000,
            "tie_word_embeddings": False,
        },
        # head_dim = hidden / heads as published, 32: 16 rotary dimensions, 8 frequencies.
        shrink={"hidden_size": 128, "head_dim": 32},
    ),
    Case(
        "phi-2",
        "PhiForCausalLM",
        "phi",
        source="microsoft/phi-2",
        published={
            "hidden_act": "gelu_new",
            "layer_norm_eps": 1e-5,
            "partial_rotary_factor": 0.4,
            "qk_layernorm": False,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        # Phi-2's head size (80: 32 rotary dimensions), with multi-head attention as published.
        shrink={"hidden_size": 160, "num_attention_heads": 2, "num_key_value_heads": 2},
    ),
    Case(
        "smollm3",
        "SmolLM3ForCausalLM",
        "smollm3",
        source="HuggingFaceTB/SmolLM3-3B",
        published={
            "attention_bias": False,
            "hidden_act": "silu",
            "mlp_bias": False,
            "no_rope_layer_interval": 4,
            "rms_norm_eps": 1e-6,
            "rope_theta": 5000000.0,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
        },
        # Every fourth layer without rotary embedding (the published `no_rope_layers` pattern).
        shrink={"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]},
    ),
    Case(
        "ernie-4-5",
        "Ernie4_5ForCausalLM",
        "ernie4_5",
        source="baidu/ERNIE-4.5-0.3B-PT",
        published={
            "head_dim": 128,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000,
            "tie_word_embeddings": True,
            "use_bias": False,
        },
        shrink={"head_dim": 16},
    ),
    Case(
        "hunyuan-dense",
        "HunYuanDenseV1ForCausalLM",
        "hunyuan_v1_dense",
        source="tencent/Hunyuan-0.5B-Instruct",
        published={
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "silu",
            "mlp_bias": False,
            "rms_norm_eps": 1e-5,
            # NTK-alpha: a fixed stretch of the rope base (the checkpoints call it "dynamic").
            "rope_scaling": {
                "alpha": 1000.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "type": "dynamic",
            },
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "use_qk_norm": True,
        },
        shrink={"head_dim": 16},
    ),
)

# The GGUF twin of each dense case whose architecture llama.cpp converts (read back by transformers 5.23 or, where
# it cannot, by packager/sources/gguf_dense.py): test_gguf_decoders.py writes it with tests/fixtures/hf_to_gguf.py.
# Rows of 256 and more so that K-quant blocks fit; where transformers' GGUF reader takes a value from its config
# defaults rather than the file (Qwen3's and Gemma's head_dim, Gemma's query_pre_attn_scalar, Phi-3's original
# context) the published value is kept, so that the file means what llama.cpp reads in it.
GGUF_SIZES: dict[str, object] = {"hidden_size": 256, "intermediate_size": 512}
GGUF_TWINS: dict[str, dict[str, object]] = {
    "smollm2": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen2-5": {},
    "qwen3": {"head_dim": 128},
    "phi3-mini-4k": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256},
    "gemma3-1b": {"head_dim": 256, "query_pre_attn_scalar": 256},
    "nemotron-mini": {"num_attention_heads": 8, "head_dim": 32},
    "gemma": {},
    "granite-3-1": {},
    "olmo": {},
    # Phi-2's converter writes ffn = 4 x hidden and every head as a KV head; head size 80 with 32 rotary dimensions
    # as published (its 320-wide rows take Q8_0: only the 1280-wide ffn_down rows fit K-quant blocks).
    "phi-2": {"hidden_size": 320, "intermediate_size": 1280, "num_attention_heads": 4, "num_key_value_heads": 4},
    "smollm3": {},
    "ernie-4-5": {"head_dim": 128},
    "hunyuan-dense": {"head_dim": 128},
}
