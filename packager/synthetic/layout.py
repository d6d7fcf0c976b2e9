"""Which tensors a llama.cpp file of a published shape holds, named and shaped as llama.cpp's converter writes
them, in the order llama.cpp's quantizer writes them."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR, TENSOR_NAMES

from packager.synthetic.configs import PublishedConfig

# The decoder layer's tensors (norms, attention, MLP) of both architectures; Qwen2 adds q/k/v biases.
_LAYER_TENSORS = (
    MODEL_TENSOR.ATTN_NORM,
    MODEL_TENSOR.ATTN_Q,
    MODEL_TENSOR.ATTN_K,
    MODEL_TENSOR.ATTN_V,
    MODEL_TENSOR.ATTN_OUT,
    MODEL_TENSOR.FFN_NORM,
    MODEL_TENSOR.FFN_GATE,
    MODEL_TENSOR.FFN_UP,
    MODEL_TENSOR.FFN_DOWN,
)
_BIASED = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V)
NORMS = (MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.FFN_NORM, MODEL_TENSOR.OUTPUT_NORM)


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the GGUF name, e.g. "blk.3.attn_q.weight"
    kind: MODEL_TENSOR
    layer: int | None
    is_bias: bool
    shape: tuple[int, ...]  # numpy order, as Hugging Face holds it: (out_features, in_features), (vocab, hidden)

    @property
    def row_length(self) -> int:
        """ggml's ne[0]: the length of one row, along which quantization blocks run."""
        return self.shape[-1]


def _spec(kind: MODEL_TENSOR, shape: tuple[int, ...], layer: int | None = None, is_bias: bool = False) -> TensorSpec:
    base = TENSOR_NAMES[kind].format(bid=layer) if layer is not None else TENSOR_NAMES[kind]
    return TensorSpec(f"{base}.{'bias' if is_bias else 'weight'}", kind, layer, is_bias, shape)


def _layer_shapes(config: PublishedConfig) -> dict[MODEL_TENSOR, tuple[int, ...]]:
    hidden, ffn = config.hidden_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_size
    kv_rows = config.num_key_value_heads * config.head_size
    return {
        MODEL_TENSOR.ATTN_NORM: (hidden,),
        MODEL_TENSOR.ATTN_Q: (q_rows, hidden),
        MODEL_TENSOR.ATTN_K: (kv_rows, hidden),
        MODEL_TENSOR.ATTN_V: (kv_rows, hidden),
        MODEL_TENSOR.ATTN_OUT: (hidden, q_rows),
        MODEL_TENSOR.FFN_NORM: (hidden,),
        MODEL_TENSOR.FFN_GATE: (ffn, hidden),
        MODEL_TENSOR.FFN_UP: (ffn, hidden),
        MODEL_TENSOR.FFN_DOWN: (hidden, ffn),
    }


def tensor_plan(config: PublishedConfig, vocab_size: int) -> list[TensorSpec]:
    """Every tensor of the file, in llama.cpp's quantizer's order (llama_model_loader's weight_name_comparer):
    the tensors outside any layer by name, then layer by layer, each layer's tensors by name.

    A tied model has no `output.weight` (llama.cpp reads the embedding instead). Llama 3's rope scaling is the
    converter's `rope_freqs.weight`: one factor per rotary frequency pair.
    """
    top = [
        _spec(MODEL_TENSOR.TOKEN_EMBD, (vocab_size, config.hidden_size)),
        _spec(MODEL_TENSOR.OUTPUT_NORM, (config.hidden_size,)),
    ]
    if not config.tie_word_embeddings:
        top.append(_spec(MODEL_TENSOR.OUTPUT, (vocab_size, config.hidden_size)))
    if config.rope_scaling is not None:
        top.append(_spec(MODEL_TENSOR.ROPE_FREQS, (config.head_size // 2,)))
    plan = sorted(top, key=lambda spec: spec.name)
    shapes = _layer_shapes(config)
    for layer in range(config.num_hidden_layers):
        specs = [_spec(kind, shapes[kind], layer) for kind in _LAYER_TENSORS]
        if config.attention_bias:
            specs += [_spec(kind, shapes[kind][:1], layer, is_bias=True) for kind in _BIASED]
        plan += sorted(specs, key=lambda spec: spec.name)
    return plan
