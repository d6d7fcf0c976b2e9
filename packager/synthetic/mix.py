"""Which block type each tensor of a synthetic file gets: the two type mixes.

- `q4_1`: the demo GGUF's mix. Linear weights Q4_1, the vocabulary matrices (token_embd, and output where it is
  not tied) Q8_0, norms, biases and rope factors F32.
- `q4_k_m`: llama.cpp's Q4_K_M, as `llama_tensor_get_type` in src/llama-quant.cpp chooses (llama.cpp as vendored
  by llama-cpp-python 0.3.36), for a dense model that is neither Falcon nor 70B-sized: Q4_K by default; Q6_K
  for the output matrix (the embedding where it is tied) and for attn_v and ffn_down in the layers that
  `use_more_bits` picks; a row length no multiple of 256 falls back to Q5_0 (for Q4_K) or Q8_0 (for Q6_K, and
  for an output matrix).

What both leave unquantized, as llama.cpp does: tensors of one dimension and norms (the converter writes them
F32; the quantizer quantizes only 2-D tensors whose name ends in "weight" and is no norm).
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, GGMLQuantizationType, LlamaFileType

from packager.errors import UserError
from packager.synthetic.configs import PublishedConfig
from packager.synthetic.layout import NORMS, TensorSpec

Q = GGMLQuantizationType
TYPE_MIXES: dict[str, LlamaFileType] = {"q4_1": LlamaFileType.MOSTLY_Q4_1, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M}
# llama-quant.cpp's tensor_type_fallback: a row length the type's block does not divide.
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


def check_mix(mix: str) -> None:
    if mix not in TYPE_MIXES:
        raise UserError(f"no type mix {mix!r}; choose one of: {', '.join(TYPE_MIXES)}", exit_code=2)


def use_more_bits(index: int, count: int) -> bool:
    """llama.cpp's rule for the layers Q4_K_M gives Q6_K: the first and last eighth, and every third between."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def _fallback(qtype: GGMLQuantizationType, row_length: int) -> GGMLQuantizationType:
    if row_length % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    fallback = _FALLBACK.get(qtype, qtype)
    return fallback if row_length % GGML_QUANT_SIZES[fallback][0] == 0 else Q.F16


def _q4_k_m(spec: TensorSpec, config: PublishedConfig) -> GGMLQuantizationType:
    layers = config.num_hidden_layers
    is_output = spec.kind == MODEL_TENSOR.OUTPUT or (
        config.tie_word_embeddings and spec.kind == MODEL_TENSOR.TOKEN_EMBD
    )
    if is_output:
        return Q.Q6_K if spec.row_length % GGML_QUANT_SIZES[Q.Q4_K][0] == 0 else Q.Q8_0
    # The quantizer counts attn_v and ffn_down tensors as it meets them; in its order (layer by layer) the
    # count is the layer's index.
    if spec.kind in (MODEL_TENSOR.ATTN_V, MODEL_TENSOR.FFN_DOWN) and use_more_bits(spec.layer or 0, layers):
        return Q.Q6_K
    return Q.Q4_K


def tensor_type(spec: TensorSpec, config: PublishedConfig, mix: str) -> GGMLQuantizationType:
    if len(spec.shape) < 2 or spec.is_bias or spec.kind in NORMS:
        return Q.F32
    if mix == "q4_1":
        wanted = Q.Q8_0 if spec.kind in (MODEL_TENSOR.TOKEN_EMBD, MODEL_TENSOR.OUTPUT) else Q.Q4_1
    else:
        wanted = _q4_k_m(spec, config)
    return _fallback(wanted, spec.row_length)
