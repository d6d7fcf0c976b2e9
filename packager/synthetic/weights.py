"""Seeded random tensors for a synthetic GGUF, one at a time and in bounded memory.

Each tensor is drawn in the Hugging Face model's row order from its own generator (seeded by the file's seed
and the tensor's name, so any one tensor can be drawn again alone), then laid out as llama.cpp's converter
writes it: Llama's q and k rows permuted (`permute_rows`); nothing else moves.

The values, and why:
- linear weights: normal, std 0.02 (the published configs' `initializer_range`);
- the output matrix (the embedding where it is tied): std 4 / sqrt(hidden), so that the logits over the
  normalized last hidden state have std ~4. At std 0.02 they have std ~1 and the next-token distribution over
  49,152 tokens is nearly flat (top-1 probability ~0.001, FIELD-NOTES "Random weights and the quality gate");
  at std 4 it peaks (top-1 ~0.3) as a trained model's does;
- norm weights: normal around 1 (std 0.1), so a build that ignored them would show;
- Qwen2's q/k/v biases: normal, std 0.5, comparable to the projections' outputs (std ~0.9), for the same reason;
- `rope_freqs.weight`: the converter's Llama 3 rope factors, computed as it computes them.

Block types `gguf.quants.quantize` implements (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) are quantized from the normal values by
the gguf package's port of ggml's reference quantizers. K-quants it cannot produce (NotImplementedError): Q4_K
and Q6_K tensors are random valid blocks, every code uniform, with sub-block scales (and Q4_K's minimums) drawn so
that each sub-block is centred and the tensor has the wanted std; the Hugging Face weights they stand for are
their dequantized values, which the blocks hold exactly.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, GGMLQuantizationType
from gguf.quants import quantize

from packager.synthetic.configs import PublishedConfig
from packager.synthetic.layout import NORMS, TensorSpec

Q = GGMLQuantizationType
LINEAR_STD = 0.02
LOGIT_STD = 4.0
NORM_STD = 0.1
BIAS_STD = 0.5
# Values drawn per step (16 MiB of float32): what bounds the memory a tensor takes beyond its own blocks. A
# function of the shape only, so a tensor's values never depend on how it was chunked.
_CHUNK_VALUES = 1 << 22
_QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)

# Q4_K: w = d * sc * q - dmin * m, q uniform in 0..15 (std sqrt(255/12)), sc uniform in 16..63 and dmin = 8 d, so
# m = round(7.5 sc / 8) centres each sub-block of 32 (|mean| <= 4 d against a std >= 74 d).
_Q4_K_SCALES = np.arange(16, 64)
_Q4_K_SPREAD = math.sqrt(np.mean(_Q4_K_SCALES.astype(np.float64) ** 2) * (16**2 - 1) / 12)
# Q6_K: w = d * sc * (q - 32), q uniform in 0..63, sc a signed byte of magnitude 16..127 (one per 16 values).
_Q6_K_SCALES = np.arange(16, 128)
_Q6_K_SPREAD = math.sqrt(np.mean(_Q6_K_SCALES.astype(np.float64) ** 2) * ((64**2 - 1) / 12 + 0.25))
# Each block's d varies by up to ±20 %, so that d's bits vary as a quantizer's would.
_JITTER = (0.8, 1.2)
_JITTER_RMS = math.sqrt(1 + 0.2**2 / 3)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of one tensor: a function of the file's seed and the tensor's name only."""
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, name_key]))


def value_std(spec: TensorSpec, config: PublishedConfig) -> float:
    if spec.kind == MODEL_TENSOR.OUTPUT or (config.tie_word_embeddings and spec.kind == MODEL_TENSOR.TOKEN_EMBD):
        return LOGIT_STD / math.sqrt(config.hidden_size)
    return LINEAR_STD


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation (LlamaModel.permute): within each head, the rotary pairs of the
    Hugging Face layout (i, i + d/2) become adjacent rows (2i, 2i + 1). `rows` may be values or rows of blocks."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_factors(config: PublishedConfig) -> np.ndarray:
    """The converter's `rope_freqs.weight` (LlamaModel.generate_extra_tensors), in float32 as it computes it."""
    scaling = config.rope_scaling
    assert scaling is not None
    dim = config.head_size
    # float32 throughout, as the converter's torch arithmetic on float32 tensors (python numbers stay weak).
    freqs = np.float32(1.0) / (np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    factors: list[float | np.float32] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(factors, dtype=np.float32)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[:, None].view(np.uint8)


def random_q4_k_blocks(rng: np.random.Generator, blocks: int, std: float) -> np.ndarray:
    """`blocks` valid Q4_K blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of
    4-bit codes) of values with standard deviation ~`std`; uint8 `[blocks, 144]`."""
    raw = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    scales = rng.integers(_Q4_K_SCALES[0], _Q4_K_SCALES[-1] + 1, size=(blocks, 8), dtype=np.uint8)
    mins = np.rint(scales * (7.5 / 8)).astype(np.uint8)
    d = std / (_Q4_K_SPREAD * _JITTER_RMS) * rng.uniform(*_JITTER, size=blocks)
    raw[:, 0:2] = _fp16_bytes(d)
    raw[:, 2:4] = _fp16_bytes(8 * d)
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums);
    # sub-blocks 4-7 in the low and high nibbles of bytes 8-11, their top two bits in the top bits of bytes 0-7.
    packed = raw[:, 4:16]  # a view: writing it writes the blocks
    packed[:, 0:4] = (scales[:, :4] & 63) | ((scales[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4)
    return raw


def random_q6_k_blocks(rng: np.random.Generator, blocks: int, std: float) -> np.ndarray:
    """`blocks` valid Q6_K blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 signed 8-bit scales,
    fp16 d) of values with standard deviation ~`std`; uint8 `[blocks, 210]`."""
    raw = rng.integers(0, 256, size=(blocks, 210), dtype=np.uint8)
    magnitudes = rng.integers(_Q6_K_SCALES[0], _Q6_K_SCALES[-1] + 1, size=(blocks, 16), dtype=np.int16)
    signs = rng.choice(np.array([-1, 1], dtype=np.int16), size=(blocks, 16))
    raw[:, 192:208] = (magnitudes * signs).astype(np.int8).view(np.uint8)
    # ggml's Q6_K quantizer writes d = -max_scale / 128: either sign occurs.
    d = std / (_Q6_K_SPREAD * _JITTER_RMS) * rng.uniform(*_JITTER, size=blocks) * rng.choice([-1.0, 1.0], blocks)
    raw[:, 208:210] = _fp16_bytes(d)
    return raw


_RANDOM_BLOCKS = {Q.Q4_K: random_q4_k_blocks, Q.Q6_K: random_q6_k_blocks}


def random_matrix(
    rng: np.random.Generator, shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float
) -> np.ndarray:
    """A `[rows, row_length]` matrix of values with standard deviation ~`std` in `qtype`'s storage (valid random
    K-quant blocks; other types quantized from normal values), drawn a chunk of rows at a time."""
    rows, row_length = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = row_length // block_size * type_size
    if qtype == Q.F16:  # what a row no block type divides falls back to
        out = np.empty((rows, row_length), dtype=np.float16)
    else:
        out = np.empty((rows, row_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // row_length)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if qtype in _RANDOM_BLOCKS:
            blocks = _RANDOM_BLOCKS[qtype](rng, (stop - start) * (row_length // block_size), std)
            out[start:stop] = blocks.reshape(stop - start, row_bytes)
            continue
        values = rng.standard_normal((stop - start, row_length), dtype=np.float32) * np.float32(std)
        out[start:stop] = quantize(values, qtype) if qtype in _QUANTIZABLE else values.astype(np.float16)
    return out


def hf_order_tensor(spec: TensorSpec, qtype: GGMLQuantizationType, config: PublishedConfig, seed: int) -> np.ndarray:
    """The tensor as the Hugging Face model holds its rows, in `qtype`'s storage: float32 for the 1-D tensors and
    norms (F32 in every mix), float16 for F16, uint8 rows of blocks otherwise."""
    rng = tensor_rng(seed, spec.name)
    if spec.kind == MODEL_TENSOR.ROPE_FREQS:
        return llama3_rope_factors(config)
    if spec.kind in NORMS:
        return (1 + NORM_STD * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
    if spec.is_bias:
        return (BIAS_STD * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
    return random_matrix(rng, spec.shape, qtype, value_std(spec, config))


def file_tensor(spec: TensorSpec, qtype: GGMLQuantizationType, config: PublishedConfig, seed: int) -> np.ndarray:
    """The tensor as llama.cpp's converter lays it out: Llama's q and k rows (weights and biases) permuted."""
    data = hf_order_tensor(spec, qtype, config, seed)
    if config.architecture == "llama" and spec.kind == MODEL_TENSOR.ATTN_Q:
        return permute_rows(data, config.num_attention_heads)
    if config.architecture == "llama" and spec.kind == MODEL_TENSOR.ATTN_K:
        return permute_rows(data, config.num_key_value_heads)
    return data
