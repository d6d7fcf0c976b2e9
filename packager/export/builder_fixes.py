"""Corrections to what onnxruntime-genai's builder (0.18) makes of some dense architectures, each found by a parity
test against transformers (tests/architectures/) and fixed where the builder reads its input.

- Layer-norm epsilon: the builder reads only `rms_norm_eps` (else 1e-6), so models whose config names it
  `layer_norm_eps` (Phi-2) or `norm_eps` (Nemotron) were normalised with the wrong epsilon (probabilities off by
  ~5e-4 on a tiny model); OLMo's layer norm has a fixed 1e-5 that no config key holds.
- OLMo: its builder class gives the norms unit weights and zero biases but keeps the RMS norm (no mean
  subtracted), where OLMo's norm is a LayerNorm without parameters: the graph disagreed from the first position.
- SmolLM3: a NoPE layer (`no_rope_layers[i] == 0`) is built by turning off the rotary embedding inside attention,
  which sends the builder to its separate-rotary path (a RotaryEmbedding node on a `position_ids` input the graph
  does not have: the export fails). A NoPE layer has no rotary embedding at all.
"""

from __future__ import annotations

from typing import Any

OLMO_NORM_EPS = 1e-5  # transformers' OlmoLayerNorm: F.layer_norm(..., eps=1e-5), not configurable


def fix_config(config: Any) -> None:
    """Set, in place, the config keys the builder reads where the architecture keeps them under another name."""
    if getattr(config, "model_type", None) == "olmo":
        config.rms_norm_eps = OLMO_NORM_EPS
    elif not hasattr(config, "rms_norm_eps"):
        for key in ("layer_norm_eps", "norm_eps"):
            if getattr(config, key, None) is not None:
                config.rms_norm_eps = getattr(config, key)
                break


def fix_model(model: Any) -> None:
    """Correct, in place, a builder model object (after its `__init__`, before it walks the layers)."""
    kind = type(model).__name__
    if kind == "OLMoModel":
        model.layernorm_attrs["simple"] = False  # LayerNormalization with the ones/zeros it sets, as OLMo computes
    elif kind == "SmolLM3Model":
        _no_rope_where_nope(model)


def _no_rope_where_nope(model: Any) -> None:
    make_attention = model.make_attention

    def attention_without_rope_on_nope_layers(layer_id: int, attention: Any, root_input: str, **kwargs: Any) -> None:
        rope = model.attention_attrs["rope"]
        model.attention_attrs["rope"] = rope and bool(model.no_rope_layers[layer_id])
        try:
            make_attention(layer_id, attention, root_input, **kwargs)
        finally:
            model.attention_attrs["rope"] = rope

    model.make_attention = attention_without_rope_on_nope_layers
