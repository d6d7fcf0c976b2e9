"""The decoder architectures `pkg build` knows: one registry every part of onnxfn reads its facts from.

Each entry is keyed by `config.json`'s `architectures[0]` and says what onnxruntime-genai's builder (0.18) does
with it, what llama.cpp calls it (its GGUF `general.architecture`), and whether onnxfn supports it: an architecture
is `supported` only once a test builds a tiny model of its published config and checks it against transformers
(tests/architectures/); the others are refused up front with the reason and the nearest supported one.
`python -m packager.models_reference` writes docs/models.md from this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from packager.errors import UserError
from packager.export.builder_fixes import fix_config
from packager.export.rotary import builder_rope, check_rope

SUPPORTED, REFUSED = "supported", "refused"


@dataclass(frozen=True)
class Architecture:
    hf_class: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type (what the runtime and bundle facts call it)
    family: str  # the published models users know it by
    status: str  # SUPPORTED or REFUSED
    gguf: str | None = None  # llama.cpp's general.architecture, where its converter writes this architecture
    exact_gguf: bool = False  # a GGUF of it builds at precision `gguf` with every block carried (tested)
    rope: tuple[str, ...] = ("default",)  # rope scaling kinds proven past the original context (tested)
    moe: bool = False
    reason: str = ""  # why it is refused, or what to know about it
    nearest: str = ""  # for a refused one: the supported architecture closest to it
    tested_by: str = ""  # the test that proves a supported one
    notes: tuple[str, ...] = field(default_factory=tuple)
    # config.json keys whose set value the builder ignores (the export would be wrong): (key, what it does)
    refused_keys: tuple[tuple[str, str], ...] = ()


_TESTS = "tests/architectures/test_decoders.py"
_REMOTE = "transformers 5.23 has no such model class (its checkpoints need trust_remote_code, which onnxfn never runs)"
_STATE = (
    "besides the KV cache its {layers} layers carry a per-sequence {state}, which onnxfn's engine (a KV pool, prefix "
    "cache and snapshots, all indexed by position) does not hold"
)
_MULTIMODAL = "a multimodal wrapper whose text decoder onnxfn does not split out"

# Text decoders (and wrappers of one) the builder exports that onnxfn refuses, each with why.
_REFUSED_DENSE: tuple[Architecture, ...] = (
    Architecture("ChatGLMModel", "chatglm", "ChatGLM2/3 6B", REFUSED, gguf="chatglm", reason=_REMOTE,
                 nearest="LlamaForCausalLM"),
    Architecture("ChatGLMForConditionalGeneration", "chatglm", "ChatGLM (quantized checkpoints)", REFUSED,
                 gguf="chatglm", reason=_REMOTE, nearest="LlamaForCausalLM"),
    Architecture("InternLM2ForCausalLM", "internlm2", "InternLM2, InternLM2.5", REFUSED, gguf="internlm2",
                 reason=_REMOTE, nearest="LlamaForCausalLM"),
    Architecture("Phi3SmallForCausalLM", "phi3small", "Phi-3 small", REFUSED,
                 reason=_REMOTE + "; block-sparse attention", nearest="Phi3ForCausalLM"),
    Architecture("VideoChatFlashQwenForCausalLM", "qwen2", "VideoChat-Flash", REFUSED,
                 reason=_REMOTE + "; a video-language model", nearest="Qwen2ForCausalLM"),
    Architecture("Lfm2ForCausalLM", "lfm2", "LFM2 (Liquid AI)", REFUSED, gguf="lfm2",
                 reason=_STATE.format(layers="short-convolution", state="convolution state (`past.conv`)"),
                 nearest="LlamaForCausalLM"),
    Architecture("Lfm2VlForConditionalGeneration", "lfm2_vl", "LFM2-VL", REFUSED,
                 reason=_MULTIMODAL + "; " + _STATE.format(layers="short-convolution", state="convolution state"),
                 nearest="LlamaForCausalLM"),
    Architecture("Lfm2AudioForConditionalGeneration", "lfm2_audio", "LFM2-Audio", REFUSED,
                 reason=_MULTIMODAL + "; " + _STATE.format(layers="short-convolution", state="convolution state"),
                 nearest="LlamaForCausalLM"),
    Architecture("Qwen3_5ForConditionalGeneration", "qwen3_5", "Qwen3.5 dense", REFUSED,
                 reason="the builder exports its Gated DeltaNet (linear attention) layers for the CUDA provider only, "
                 + _STATE.format(layers="linear-attention", state="recurrent state"), nearest="Qwen3ForCausalLM"),
    Architecture("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "Qwen2.5-VL", REFUSED,
                 reason=_MULTIMODAL + "; its text graph takes 3-D multimodal rotary position ids",
                 nearest="Qwen2ForCausalLM"),
    Architecture("Qwen3VLForConditionalGeneration", "qwen3_vl", "Qwen3-VL", REFUSED,
                 reason=_MULTIMODAL + "; its text graph takes 3-D multimodal rotary position ids",
                 nearest="Qwen3ForCausalLM"),
    Architecture("Phi3VForCausalLM", "phi3_v", "Phi-3 vision, Phi-3.5 vision", REFUSED,
                 reason=_MULTIMODAL + "; " + _REMOTE, nearest="Phi3ForCausalLM"),
    Architecture("Phi4MMForCausalLM", "phi4mm", "Phi-4 multimodal", REFUSED, reason=_MULTIMODAL + "; " + _REMOTE,
                 nearest="Phi3ForCausalLM"),
    Architecture("Mistral3ForConditionalGeneration", "mistral3", "Mistral Small 3.1/3.2", REFUSED,
                 reason=_MULTIMODAL + " (transformers loads it only as an image-text-to-text model)",
                 nearest="MistralForCausalLM"),
    Architecture("Gemma4ForConditionalGeneration", "gemma4", "Gemma 4", REFUSED, gguf="gemma4",
                 reason="its global layers have their own head size and KV head count (`global_head_dim`, "
                 "`num_global_key_value_heads`) where the engine's KV pool holds one shape for every layer, and the "
                 "builder takes this class as its Mixture-of-Experts model", nearest="Gemma3ForCausalLM"),
    Architecture("Gemma4UnifiedForConditionalGeneration", "gemma4", "Gemma 4 unified", REFUSED,
                 reason="transformers 5.23 has no Gemma4Unified model; per-layer KV shapes as Gemma 4",
                 nearest="Gemma3ForCausalLM"),
)  # fmt: skip

# Mixture-of-Experts decoders the builder or llama.cpp knows that onnxfn refuses, each with why.
_NO_BUILDER = "onnxruntime-genai 0.18's builder has no export for it (not in its model dispatch)"
_REFUSED_MOE: tuple[Architecture, ...] = (
    Architecture("PhiMoEForCausalLM", "phimoe", "Phi-3.5-MoE", REFUSED, gguf="phimoe", moe=True,
                 reason="the builder exports it for CUDA only (it switches to the CUDA provider and int4, with "
                 "CUTLASS-prepacked experts) and reads per-expert `block_sparse_moe.experts[i].w1` modules, which "
                 "transformers 5 (`PhimoeForCausalLM`) stacks into `mlp.experts.gate_up_proj`",
                 nearest="Phi3ForCausalLM (dense), GptOssForCausalLM (MoE)"),
    Architecture("PhimoeForCausalLM", "phimoe", "Phi-3.5-MoE (as transformers 5 saves it)", REFUSED, gguf="phimoe",
                 moe=True, reason=_NO_BUILDER + "; under its published name PhiMoEForCausalLM, CUDA only",
                 nearest="Phi3ForCausalLM (dense), GptOssForCausalLM (MoE)"),
    Architecture("Lfm2MoeForCausalLM", "lfm2_moe", "LFM2-8B-A1B, LFM2-24B-A2B", REFUSED, gguf="lfm2moe", moe=True,
                 reason="the builder exports it for the CPU (an fp32 MoE op with its sigmoid router in the graph), "
                 "but " + _STATE.format(layers="short-convolution", state="convolution state (`past.conv`)"),
                 nearest="GptOssForCausalLM"),
    Architecture("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "Qwen3.5 MoE", REFUSED, gguf="qwen35moe",
                 moe=True, reason="the builder exports its Gated DeltaNet (linear attention) layers for the CUDA "
                 "provider only; " + _STATE.format(layers="linear-attention", state="recurrent state"),
                 nearest="Qwen3ForCausalLM (dense), GptOssForCausalLM (MoE)"),
)  # fmt: skip

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "LlamaForCausalLM",
        "llama",
        "Llama 2/3/3.1/3.2, SmolLM2, TinyLlama",
        SUPPORTED,
        gguf="llama",
        exact_gguf=True,
        rope=("default", "llama3", "linear"),
        tested_by=_TESTS,
    ),
    Architecture(
        "MistralForCausalLM",
        "mistral",
        "Mistral 7B",
        SUPPORTED,
        gguf="llama",
        exact_gguf=True,
        tested_by=_TESTS,
    ),
    Architecture(
        "Qwen2ForCausalLM",
        "qwen2",
        "Qwen2, Qwen2.5",
        SUPPORTED,
        gguf="qwen2",
        exact_gguf=True,
        rope=("default", "yarn", "dynamic"),
        tested_by=_TESTS,
        notes=("dynamic NTK: max_context up to max_position_embeddings, where it is plain rope",),
    ),
    Architecture(
        "Qwen3ForCausalLM",
        "qwen3",
        "Qwen3 (dense)",
        SUPPORTED,
        gguf="qwen3",
        exact_gguf=True,
        rope=("default", "yarn"),
        tested_by=_TESTS,
    ),
    Architecture(
        "Phi3ForCausalLM",
        "phi3",
        "Phi-3 mini, Phi-3.5 mini, Phi-4-mini",
        SUPPORTED,
        gguf="phi3",
        exact_gguf=True,
        rope=("default", "longrope"),
        tested_by=_TESTS,
        notes=(
            "fused q/k/v and gate/up",
            "partial rotary (Phi-4-mini)",
            "longrope: the short factors while max_context fits the original context, else the long ones throughout",
        ),
    ),
    Architecture("GemmaForCausalLM", "gemma", "Gemma", SUPPORTED, gguf="gemma", exact_gguf=True, tested_by=_TESTS),
    Architecture(
        "Gemma2ForCausalLM",
        "gemma2",
        "Gemma 2",
        SUPPORTED,
        gguf="gemma2",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("sliding-window layers", "logit soft-capping"),
    ),
    Architecture(
        "Gemma3ForCausalLM",
        "gemma3_text",
        "Gemma 3 text (270M, 1B; the 4B+ decoder)",
        SUPPORTED,
        gguf="gemma3",
        exact_gguf=True,
        rope=("default", "linear"),
        tested_by=_TESTS,
        notes=("sliding-window layers", "rope scaling per layer type (4B+: the global layers' only)"),
    ),
    Architecture(
        "GraniteForCausalLM",
        "granite",
        "Granite 3.x dense (IBM)",
        SUPPORTED,
        gguf="granite",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("embedding, attention, residual and logit multipliers",),
    ),
    Architecture(
        "OlmoForCausalLM",
        "olmo",
        "OLMo 1B/7B (AI2)",
        SUPPORTED,
        gguf="olmo",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("layer norm without parameters (the builder's RMS norm corrected: builder_fixes.py)",),
        refused_keys=(("clip_qkv", "q/k/v clipped, as OLMo 1.7 7B does"),),
    ),
    Architecture(
        "NemotronForCausalLM",
        "nemotron",
        "Nemotron-Mini 4B, Minitron (NVIDIA)",
        SUPPORTED,
        gguf="nemotron",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("partial rotary", "layer norm with weight + 1", "squared-ReLU MLP without gate"),
    ),
    Architecture(
        "PhiForCausalLM",
        "phi",
        "Phi-2, Phi-1.5",
        SUPPORTED,
        gguf="phi2",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("parallel attention and MLP", "partial rotary", "layer norms and biases"),
        refused_keys=(("qk_layernorm", "layer norms on q and k"),),
    ),
    Architecture(
        "SmolLM3ForCausalLM",
        "smollm3",
        "SmolLM3 3B",
        SUPPORTED,
        gguf="smollm3",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("every fourth layer without rotary embedding (NoPE; builder corrected: builder_fixes.py)",),
    ),
    Architecture(
        "Ernie4_5ForCausalLM",
        "ernie4_5",
        "ERNIE 4.5 0.3B (Baidu)",
        SUPPORTED,
        gguf="ernie4_5",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("interleaved rotary embedding",),
    ),
    Architecture(
        "HunYuanDenseV1ForCausalLM",
        "hunyuan_v1_dense",
        "Hunyuan dense 0.5B-7B (Tencent)",
        SUPPORTED,
        gguf="hunyuan-dense",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=("q/k norms after the rotation (positions computed in the graph: positions.py)", "NTK-alpha rope base"),
    ),
    *_REFUSED_DENSE,
    Architecture(
        "GraniteMoeHybridForCausalLM",
        "granitemoehybrid",
        "Granite 4.0 Micro (attention layers, no routed experts); not Granite 4.0 H",
        SUPPORTED,
        gguf="granite",
        exact_gguf=True,
        tested_by=_TESTS,
        notes=(
            "Mamba-2 layers and routed experts refused (check_config)",
            "llama.cpp writes an attention-only model as a `granite` file (its shared MLP as ffn_gate/up/down), which "
            "builds as Granite: test_gguf_decoders.py; `granitehybrid` files (Granite 4.0 H) have Mamba layers",
        ),
    ),
    Architecture(
        "GptOssForCausalLM",
        "gpt_oss",
        "gpt-oss (20b, 120b)",
        SUPPORTED,
        gguf="gpt-oss",
        exact_gguf=True,
        rope=("yarn",),
        moe=True,
        tested_by=_TESTS,
        notes=(
            "attention sinks",
            "sliding-window layers",
            "clamped SwiGLU experts (ONNX Runtime's MoE/QMoE)",
            "GGUF MXFP4 experts carried exactly as int8 blocks (QMoE has no CPU MXFP4 kernel): ~2.1x their bytes",
        ),
    ),
    Architecture(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        "Qwen3-30B-A3B, Qwen3-235B-A22B",
        SUPPORTED,
        gguf="qwen3moe",
        exact_gguf=True,
        moe=True,
        tested_by=_TESTS,
        notes=(
            "the builder's Qwen3 attention with its Qwen3.5-MoE routed block (builder_moe.py: the builder has no "
            "dispatch entry for it)",
            "GGUF experts: test_qwen_moe.py (Q4_K experts re-quantized to int8, Q8_0/Q4_0/Q6_K exact)",
        ),
    ),
    Architecture(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
        SUPPORTED,
        gguf="qwen2moe",
        exact_gguf=True,
        moe=True,
        tested_by=_TESTS,
        notes=(
            "the builder's Qwen2 attention with the routed block and Qwen3.5-MoE's shared expert (builder_moe.py)",
            "routing weights not renormalised (norm_topk_prob false): the operator renormalises and the output is "
            "scaled by the top k's share (ONNX Runtime's CPU MoE without renormalising reads stale output memory)",
            "GGUF experts: test_qwen_moe.py; the shared-expert gate stays float32 (one row)",
        ),
    ),
    *_REFUSED_MOE,
)
_BY_CLASS = {a.hf_class: a for a in ARCHITECTURES}
SUPPORTED_DECODERS: dict[str, str] = {a.hf_class: a.model_type for a in ARCHITECTURES if a.status == SUPPORTED}

# transformers 5 nests Gemma 3's rope parameters by the layer types that use them.
FULL, SLIDING = "full_attention", "sliding_attention"


def architecture_of(config: dict[str, Any], where: str, max_context: int | None = None) -> Architecture:
    """The registry's entry for a config.json, or a UserError saying why onnxfn cannot build it (into a bundle of
    `max_context` positions, when given)."""
    hf_class = (config.get("architectures") or ["<none>"])[0]
    entry = _BY_CLASS.get(hf_class)
    if entry is None:
        supported = ", ".join(sorted(SUPPORTED_DECODERS))
        raise UserError(
            f"{where} declares architecture {hf_class!r}, which onnxfn cannot export yet; supported: {supported}",
            exit_code=2,
        )
    if entry.status != SUPPORTED:
        raise UserError(
            f"{where} declares architecture {hf_class!r} ({entry.family}), which onnxfn refuses: {entry.reason}; "
            f"the nearest supported architecture is {entry.nearest}",
            exit_code=2,
        )
    for key, meaning in entry.refused_keys:
        if config.get(key):
            raise UserError(
                f"{where} sets {key} = {config[key]!r} ({meaning}), which onnxruntime-genai's builder ignores: the "
                f"export would compute another model; onnxfn builds {hf_class} models without it",
                exit_code=2,
            )
    check_config(config, where, max_context)
    return entry


def check_config(config: dict[str, Any], where: str, max_context: int | None = None) -> None:
    """Refuse, before exporting, a config.json whose model the builder would export wrongly."""
    check_rope(config, where, max_context)
    if (config.get("architectures") or [None])[0] == "GraniteMoeHybridForCausalLM":
        _check_granite_hybrid(config, where)


def _check_granite_hybrid(config: dict[str, Any], where: str) -> None:
    """GraniteMoeHybrid builds only as Granite 4.0 Micro is: attention layers, no routed experts (the builder exports
    a layer's attention and its shared MLP, nothing else)."""
    mamba = sum(1 for kind in config.get("layer_types") or [] if kind == "mamba")
    if mamba:
        raise UserError(
            f"{where} has {mamba} Mamba-2 layers (layer_types), which onnxruntime-genai's builder does not export "
            "(it fails on a layer without attention) and onnxfn's engine could not serve (a per-sequence SSM state "
            "besides the KV cache): Granite 4.0 H models are refused; Granite 4.0 Micro (attention only) builds",
            exit_code=2,
        )
    if config.get("num_local_experts"):
        raise UserError(
            f"{where} routes each token to experts (num_local_experts = {config['num_local_experts']}), which "
            "onnxruntime-genai's builder has no Mixture-of-Experts export for in GraniteMoeHybrid (it fails looking "
            "for them); Granite 4.0 Micro (shared MLP only) builds",
            exit_code=2,
        )


def adapt_builder_config(config: Any) -> None:
    """Rewrite, in place, what the builder (0.18) cannot read in a config object loaded by transformers 5.

    - Gemma 3's `rope_parameters` are nested by layer type; the builder wants the full-attention layers'
      parameters flat (`rope_type`, `rope_theta`) and the sliding layers' base as `rope_local_base_freq`,
      where transformers 4 kept them.
    - A `sliding_window` without `layer_types` (Mistral, Phi-3): transformers windows every layer, the builder
      only the layers `layer_types` marks as sliding, so none; they are marked here.
    - Rope scaling: only what lets the builder run (rotary.builder_rope); its rotary tables are replaced by
      transformers' own (rotary.correct_tables).
    - A multimodal wrapper's decoder (Gemma 3 4B+, Mistral 3): its `text_config` is adapted, which the builder
      copies to the top level.
    """
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        adapt_builder_config(text_config)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "layer_types", None) is None:
        config.layer_types = [SLIDING] * config.num_hidden_layers
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and FULL in rope:
        config.rope_parameters = dict(rope[FULL])
        if SLIDING in rope:
            config.rope_local_base_freq = rope[SLIDING]["rope_theta"]
    builder_rope(config)
    fix_config(config)  # norm epsilons under other names (builder_fixes.py)
