"""A GGUF's rope scaling, in the config transformers makes from the GGUF (which keeps only `rope_theta`).

llama.cpp's converter writes rope scaling three ways, and transformers' GGUF reader (5.23) reads none of them but
gpt-oss's, so a Llama 3.x, Phi-3.5 or YaRN GGUF built into a config rotated unscaled (its reference too: parity
could not see it):
- per-frequency divisors, `rope_freqs.weight` (Llama 3.1/3.2's llama3 scaling, as the converter computes it):
  llama.cpp rotates pair i by `position * base^(-2i/d) / rope_freqs[i]`, which is transformers' longrope with these
  factors as both its short and long factors and an attention factor of 1;
- short and long factors, `rope_factors_short.weight` / `rope_factors_long.weight` (Phi-3 longrope), with
  `rope.scaling.original_context_length` and `rope.scaling.attn_factor`;
- `rope.scaling.type` linear or yarn, with `rope.scaling.factor`, `original_context_length` and yarn's betas
  (llama.cpp's defaults for missing betas and its attention factor `0.1 ln(factor) + 1` are transformers' too).
On a model with a rope per layer type (Gemma 3) the scaling is the global layers', as llama.cpp applies it, and the
sliding layers' base is `rope.freq_base_swa` where the GGUF has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packager.sources.gguf_metadata import read_metadata

FULL, SLIDING = "full_attention", "sliding_attention"


def gguf_rope_scaling(gguf_path: Path, max_position_embeddings: int) -> dict[str, Any] | None:
    """The rope scaling parameters (transformers' names) the GGUF carries, or None."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

    metadata = read_metadata(gguf_path)
    field = metadata.field

    def factors(tensor: MODEL_TENSOR) -> list[float] | None:
        name = TENSOR_NAMES[tensor] + ".weight"
        return [float(x) for x in metadata.float32(name)] if name in metadata.tensors else None

    original = field(Keys.Rope.SCALING_ORIG_CTX_LEN)
    long, short = factors(MODEL_TENSOR.ROPE_FACTORS_LONG), factors(MODEL_TENSOR.ROPE_FACTORS_SHORT)
    if long is not None:
        scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short or long}
        scaling["original_max_position_embeddings"] = int(original or max_position_embeddings)
        attention = field(Keys.Rope.SCALING_ATTN_FACTOR)
        if attention is not None:
            scaling["attention_factor"] = float(attention)
        return scaling
    divisors = factors(MODEL_TENSOR.ROPE_FREQS)
    if divisors is not None:
        return {
            "rope_type": "longrope", "long_factor": divisors, "short_factor": divisors, "attention_factor": 1.0,
            "original_max_position_embeddings": max_position_embeddings,
        }  # fmt: skip
    kind = field(Keys.Rope.SCALING_TYPE)
    if kind not in ("linear", "yarn"):
        return None
    scaling = {"rope_type": str(kind), "factor": float(field(Keys.Rope.SCALING_FACTOR))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(original or max_position_embeddings)
        betas = ((Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"), (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow"))
        scaling.update({name: float(field(key)) for key, name in betas if field(key) is not None})
    return scaling


def add_gguf_rope(gguf_path: Path, config: Any) -> None:
    """Put the GGUF's rope scaling into `config` (a transformers config read from it), beside its `rope_theta`;
    on a model with a rope per layer type, the sliding layers' base too (`rope.freq_base_swa`)."""
    scaling = gguf_rope_scaling(gguf_path, config.max_position_embeddings)
    rope = dict(config.rope_parameters or {})  # rope_theta, partial_rotary_factor stay
    if isinstance(rope.get(FULL), dict):  # one rope per layer type: llama.cpp scales the global layers'
        rope[FULL] = {**rope[FULL], **(scaling or {})}
        sliding_base = read_metadata(gguf_path).field("{arch}.rope.freq_base_swa")
        if sliding_base is not None and isinstance(rope.get(SLIDING), dict):
            rope[SLIDING] = {**rope[SLIDING], "rope_theta": float(sliding_base)}
    elif scaling is not None:
        rope = {**rope, **scaling}
    config.rope_parameters = rope
