"""Decoder architectures `pkg build` exports, keyed by the `architectures[0]` of config.json.

Each one goes through onnxruntime-genai's model builder and yields the graph contract the runtime
serves (input_ids + attention_mask, GroupQueryAttention over a shared KV buffer, keys-then-values
past inputs). An architecture is listed only once a test exports it and checks that contract.
"""

from __future__ import annotations

from typing import Any

from packager.errors import UserError

SUPPORTED_DECODERS: dict[str, str] = {
    "LlamaForCausalLM": "llama",  # Llama 2/3, SmolLM and SmolLM2, TinyLlama
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # Phi-3 without rope scaling (its 4k-context models); fused q/k/v and gate/up
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",  # sliding-window layers, logit soft-capping
    "Gemma3ForCausalLM": "gemma3_text",  # text-only Gemma 3 (270M, 1B); sliding-window layers
}

# transformers 5 nests Gemma 3's rope parameters by the layer types that use them.
FULL, SLIDING = "full_attention", "sliding_attention"


def check_config(config: dict[str, Any], where: str) -> None:
    """Refuse, before exporting, a config.json whose model the builder would export wrongly."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and FULL in rope:
        scaled = {kind: p.get("rope_type") for kind, p in rope.items() if p.get("rope_type", "default") != "default"}
        if scaled:
            # The builder makes the sliding layers' rotary cache with the full layers' scaling too.
            raise UserError(
                f"{where} scales rotary embeddings per layer type ({scaled}), which onnxfn cannot export yet: "
                "onnxruntime-genai's builder would apply the full-attention scaling to the sliding-window layers "
                "as well; use a model without rope scaling (Gemma 3 270M and 1B have none)",
                exit_code=2,
            )


def adapt_builder_config(config: Any) -> None:
    """Rewrite, in place, what the builder (0.18) cannot read in a config object loaded by transformers 5.

    Gemma 3's `rope_parameters` are nested by layer type; the builder wants the full-attention layers'
    parameters flat (`rope_type`, `rope_theta`) and the sliding layers' base as `rope_local_base_freq`,
    where transformers 4 kept them. Other configs pass unchanged.
    """
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and FULL in rope:
        config.rope_parameters = dict(rope[FULL])
        if SLIDING in rope:
            config.rope_local_base_freq = rope[SLIDING]["rope_theta"]
