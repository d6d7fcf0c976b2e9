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


_TESTS = "tests/architectures/test_decoders.py"

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
        rope=("default", "yarn", "dynamic"),
        tested_by=_TESTS,
        notes=("dynamic NTK: max_context up to max_position_embeddings, where it is plain rope",),
    ),
    Architecture("Qwen3ForCausalLM", "qwen3", "Qwen3 (dense)", SUPPORTED, gguf="qwen3", tested_by=_TESTS),
    Architecture(
        "Phi3ForCausalLM",
        "phi3",
        "Phi-3 mini, Phi-3.5 mini, Phi-4-mini",
        SUPPORTED,
        gguf="phi3",
        rope=("default", "longrope"),
        tested_by=_TESTS,
        notes=(
            "fused q/k/v and gate/up",
            "partial rotary (Phi-4-mini)",
            "longrope: the short factors while max_context fits the original context, else the long ones throughout",
        ),
    ),
    Architecture("GemmaForCausalLM", "gemma", "Gemma", SUPPORTED, gguf="gemma", tested_by=_TESTS),
    Architecture(
        "Gemma2ForCausalLM",
        "gemma2",
        "Gemma 2",
        SUPPORTED,
        gguf="gemma2",
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
    check_config(config, where, max_context)
    return entry


def check_config(config: dict[str, Any], where: str, max_context: int | None = None) -> None:
    """Refuse, before exporting, a config.json whose model the builder would export wrongly."""
    check_rope(config, where, max_context)


def adapt_builder_config(config: Any) -> None:
    """Rewrite, in place, what the builder (0.18) cannot read in a config object loaded by transformers 5.

    - Gemma 3's `rope_parameters` are nested by layer type; the builder wants the full-attention layers'
      parameters flat (`rope_type`, `rope_theta`) and the sliding layers' base as `rope_local_base_freq`,
      where transformers 4 kept them.
    - A `sliding_window` without `layer_types` (Mistral, Phi-3): transformers windows every layer, the builder
      only the layers `layer_types` marks as sliding, so none; they are marked here.
    - Rope scaling: only what lets the builder run (rotary.builder_rope); its rotary tables are replaced by
      transformers' own (rotary.correct_tables).
    """
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "layer_types", None) is None:
        config.layer_types = [SLIDING] * config.num_hidden_layers
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and FULL in rope:
        config.rope_parameters = dict(rope[FULL])
        if SLIDING in rope:
            config.rope_local_base_freq = rope[SLIDING]["rope_theta"]
    builder_rope(config)
