"""A GGUF tensor's quantized blocks, read into the one form ONNX Runtime's block-quantized operators hold.

MatMulNBits and GatherBlockQuantized store a weight row by row (rows = output features, blocks along K,
which is how GGUF stores it too) as unsigned `bits`-wide values with a float scale and an integer zero
point per block: `w = (value - zero_point) * scale`. Every GGUF type is an affine map of small integers
per block, so each one lands in that form without re-quantizing:

- symmetric types (`w = d * (q - center)`: Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, MXFP4) exactly, with the operators'
  default zero point (the values are shifted so that `center` falls on it);
- types with a block minimum (`w = d * q + m`: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) as a uint8 zero point
  `z = round(-m / d)` plus a per-block residual `r = m + z * d`, applied as (the sum of the activations
  over each block) times r. A float zero point `-m / d` would be exact too, but ONNX Runtime then
  dequantizes the whole weight on every call (20-50x slower, shared/probes/gguf-exact).

Types of 4 bits or fewer use a 4-bit container, wider ones an 8-bit container. The K-quants' per-sub-block
scale is `d * sc` in float32, as the `gguf` package (and transformers, which uses it) computes it, so
symmetric types dequantize bit for bit to what the fp32 reference holds and the others to fp32 rounding.

The operators want those scales (and residuals) as float32 per block: 1-2 bits per weight that the file stores in
0.25-0.5. So each weight also keeps its `Factors`, the file's own form of them (a float16 per block, or a K-quant's
small integer per sub-block times a float16 per super-block), which the bundle ships instead of the float32 tables
(runtime/engine/tables.py expands them where the bundle runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from runtime.engine.recipes import expand_factors, residual_table

QK_K = 256  # the K-quants' super-block


@dataclass(frozen=True)
class Factors:
    """Per-block float32 values as a GGUF type stores them: `sign * float32(super)[n, b // per] * float32(sub)[n, b]`,
    `per` the sub-blocks of a super-block (`sub` None: one float16 per block, `super` is the table)."""

    super: np.ndarray  # float16 [rows, supers]
    sub: np.ndarray | None  # int8 or uint8 [rows, blocks]
    negate: bool = False

    def table(self) -> np.ndarray:
        """The float32 values, as the runtime expands them (products of small integers and float16 values are exact
        in float32: bit-equal to `d * sc` as the `gguf` package computes it)."""
        return expand_factors(self.super, self.sub, self.negate)

    def take(self, rows: np.ndarray) -> Factors:
        return Factors(self.super[rows], None if self.sub is None else self.sub[rows], self.negate)

    @property
    def form(self) -> tuple[object, ...]:
        """What factors of several weights must share to be concatenated."""
        return (self.super.shape[1:], None if self.sub is None else (self.sub.dtype, self.sub.shape[1:]), self.negate)


@dataclass(frozen=True)
class BlockWeight:
    """Rows of a weight as `w[n, k] = (values[n, k] - zero[n, b]) * scales[n, b] + residual[n, b]`, `b = k // block`.

    `zero` is `zero_points`, or the operators' default `2 ** (bits - 1)` when it is None; `residual` is 0 when None.
    """

    bits: int  # container width: 4 or 8
    block_size: int
    values: np.ndarray  # uint8 [rows, K], each below 2**bits
    scales: np.ndarray  # float32 [rows, blocks]
    zero_points: np.ndarray | None  # uint8 [rows, blocks]
    residual: np.ndarray | None  # float32 [rows, blocks]
    scale_factors: Factors | None = None  # `scales` as the file stores them (None: only as float32)
    minimum_factors: Factors | None = None  # the block minimum `residual` is made from, as the file stores it

    @property
    def layout(self) -> tuple[int, int, bool, bool]:
        """What one operator node needs to be the same for all its rows."""
        return (self.bits, self.block_size, self.zero_points is not None, self.residual is not None)

    def take(self, rows: np.ndarray) -> BlockWeight:
        def pick(array: np.ndarray | None) -> np.ndarray | None:
            return None if array is None else array[rows]

        return BlockWeight(
            self.bits,
            self.block_size,
            self.values[rows],
            self.scales[rows],
            pick(self.zero_points),
            pick(self.residual),
            None if self.scale_factors is None else self.scale_factors.take(rows),
            None if self.minimum_factors is None else self.minimum_factors.take(rows),
        )

    @staticmethod
    def concatenate(parts: list[BlockWeight]) -> BlockWeight:
        first = parts[0]
        if any(part.layout != first.layout for part in parts):
            raise ValueError("only weights of one layout concatenate")

        def join(arrays: list[np.ndarray | None]) -> np.ndarray | None:
            return None if arrays[0] is None else np.concatenate(arrays)  # type: ignore[arg-type]

        return BlockWeight(
            first.bits,
            first.block_size,
            np.concatenate([p.values for p in parts]),
            np.concatenate([p.scales for p in parts]),
            join([p.zero_points for p in parts]),
            join([p.residual for p in parts]),
            _join_factors([p.scale_factors for p in parts]),
            _join_factors([p.minimum_factors for p in parts]),
        )

    def dequantize(self) -> np.ndarray:
        """The weight as float32 `[rows, K]`, computed as the operators define it."""
        rows, k = self.values.shape
        blocks = self.values.reshape(rows, -1, self.block_size).astype(np.float32)
        zero = self.zero_points if self.zero_points is not None else np.full(self.scales.shape, 1 << (self.bits - 1))
        weight = (blocks - zero[..., None].astype(np.float32)) * self.scales[..., None]
        if self.residual is not None:
            weight += self.residual[..., None]
        return weight.reshape(rows, k)


def _join_factors(parts: list[Factors | None]) -> Factors | None:
    """The parts' factors as one, when all have factors of one form (else the weight ships float32 tables)."""
    first = parts[0]
    if first is None or any(p is None or p.form != first.form for p in parts):
        return None
    chosen = [p for p in parts if p is not None]
    sub = None if first.sub is None else np.concatenate([p.sub for p in chosen if p.sub is not None])
    return Factors(np.concatenate([p.super for p in chosen]), sub, first.negate)


def supported_types() -> tuple[GGMLQuantizationType, ...]:
    return tuple(_DECODERS)


def read_blocks(qtype: GGMLQuantizationType, raw: np.ndarray) -> BlockWeight:
    """`raw`: the tensor's bytes as uint8 `[rows, bytes per row]` (GGUF rows: output features)."""
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        raise ValueError(f"GGUF type {qtype.name} has no exact block form here")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, type_size)
    return decoder(blocks, block_size)


# Each decoder returns the source form: unsigned integers `q` [rows, blocks, block], a float32 scale per
# (sub-)block, and either the integer `center` of a symmetric type or a float32 minimum per (sub-)block.
def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0]


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """16 bytes → 32 values: low nibbles are elements 0-15, high nibbles 16-31 (ggml's Q4_0/Q4_1/Q5 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) → bit j of element j, for 32 elements."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(blocks: np.ndarray, block_size: int) -> BlockWeight:
    return _symmetric(_nibbles_halves(blocks[..., 2:18]), Factors(_half(blocks, 0), None), center=8, source_bits=4)


def _q4_1(blocks: np.ndarray, block_size: int) -> BlockWeight:
    scale, minimum = Factors(_half(blocks, 0), None), Factors(_half(blocks, 2), None)
    return _with_minimum(_nibbles_halves(blocks[..., 4:20]), scale, minimum, source_bits=4)


def _q5_0(blocks: np.ndarray, block_size: int) -> BlockWeight:
    q = _nibbles_halves(blocks[..., 6:22]) | (_high_bits(blocks[..., 2:6]) << 4)
    return _symmetric(q, Factors(_half(blocks, 0), None), center=16, source_bits=5)


def _q5_1(blocks: np.ndarray, block_size: int) -> BlockWeight:
    q = _nibbles_halves(blocks[..., 8:24]) | (_high_bits(blocks[..., 4:8]) << 4)
    return _with_minimum(q, Factors(_half(blocks, 0), None), Factors(_half(blocks, 2), None), source_bits=5)


def _q8_0(blocks: np.ndarray, block_size: int) -> BlockWeight:
    q = blocks[..., 2:34] ^ np.uint8(0x80)  # int8 → uint8 + 128
    return _symmetric(q, Factors(_half(blocks, 0), None), center=128, source_bits=8)


def _mxfp4(blocks: np.ndarray, block_size: int) -> BlockWeight:
    """MXFP4 (gpt-oss's experts): `w = 2**(e - 128) * k[q]`, `k` the e2m1 values doubled (integers -12..12) and
    `e` a power-of-two exponent byte (ggml's `e8m0_to_fp32_half`). The doubled values are integers, so the 8-bit
    container holds them exactly (a 4-bit one cannot: the e2m1 grid is not evenly spaced)."""
    from gguf.quants import MXFP4

    codes = _nibbles_halves(blocks[..., 1:17])
    doubled = np.asarray(MXFP4.kvalues, np.int16)[codes]  # -12..12
    scale = MXFP4.e8m0_to_fp32_half(np.ascontiguousarray(blocks[..., 0]))
    return _symmetric(doubled + 128, scale, center=128, source_bits=8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes → 8 six-bit scales and 8 six-bit minimums (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _split_k(blocks: np.ndarray, q: np.ndarray, *, source_bits: int) -> BlockWeight:
    """Q4_K/Q5_K super-blocks of 8 sub-blocks of 32: `w = d*sc * q - dmin*m`."""
    rows, supers = blocks.shape[:2]
    sc, mn = _k_scale_min(blocks[..., 4:16])
    shape = (rows, supers * 8)
    scale = Factors(_half(blocks, 0), sc.reshape(shape))
    minimum = Factors(_half(blocks, 2), mn.reshape(shape), negate=True)
    return _with_minimum(q.reshape(rows, supers * 8, 32), scale, minimum, source_bits=source_bits)


def _q4_k(blocks: np.ndarray, block_size: int) -> BlockWeight:
    rows, supers = blocks.shape[:2]
    qs = blocks[..., 16:144].reshape(rows, supers, 4, 1, 32)  # four 32-byte runs: low nibbles, then high ones
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    return _split_k(blocks, q, source_bits=4)


def _q5_k(blocks: np.ndarray, block_size: int) -> BlockWeight:
    rows, supers = blocks.shape[:2]
    qh = blocks[..., 16:48].reshape(rows, supers, 1, 32)
    qs = blocks[..., 48:176].reshape(rows, supers, 4, 1, 32)
    low = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(rows, supers, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    return _split_k(blocks, low | (high << 4), source_bits=5)


def _q6_k(blocks: np.ndarray, block_size: int) -> BlockWeight:
    rows, supers = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, supers, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    low = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(rows, supers, 2, 4, 32)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(rows, supers, 2, 4, 32)
    q = (low | (high << 4)).reshape(rows, supers * 16, 16)
    sc = blocks[..., 192:208].copy().view(np.int8).reshape(rows, supers * 16)
    return _symmetric(q, Factors(_half(blocks, 208), sc), center=32, source_bits=6)


def _q2_k(blocks: np.ndarray, block_size: int) -> BlockWeight:
    rows, supers = blocks.shape[:2]
    scales = blocks[..., 0:16]
    qs = blocks[..., 16:80].reshape(rows, supers, 2, 1, 32)
    q = ((qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(rows, supers * 16, 16)
    scale = Factors(_half(blocks, 80), (scales & 0x0F).reshape(rows, supers * 16))
    minimum = Factors(_half(blocks, 82), (scales >> 4).reshape(rows, supers * 16), negate=True)
    return _with_minimum(q, scale, minimum, source_bits=2)


def _q3_k(blocks: np.ndarray, block_size: int) -> BlockWeight:
    rows, supers = blocks.shape[:2]
    hmask = blocks[..., 0:32].reshape(rows, supers, 1, 32)
    qs = blocks[..., 32:96].reshape(rows, supers, 2, 1, 32)
    packed = blocks[..., 96:108]
    low_scales = (packed[..., 0:8].reshape(rows, supers, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high_scales = (packed[..., 8:12].reshape(rows, supers, 1, 4) >> shifts) & 3
    sc = (low_scales.reshape(rows, supers, 16) | (high_scales.reshape(rows, supers, 16) << 4)).astype(np.int16) - 32
    d = Factors(_half(blocks, 108), sc.astype(np.int8).reshape(rows, supers * 16))  # -32..31
    low = ((qs >> shifts.reshape(1, 1, 1, 4, 1)) & 3).reshape(rows, supers, 8, 32)
    high = (hmask >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    # A set hmask bit means +0, a clear one -4 (ggml's q3_K): as unsigned, q = low + 4 * high, centred on 4.
    q = (low | (high << 2)).reshape(rows, supers * 16, 16)
    return _symmetric(q, d, center=4, source_bits=3)


def _container(source_bits: int) -> int:
    return 4 if source_bits <= 4 else 8


def _symmetric(q: np.ndarray, scale: np.ndarray | Factors, *, center: int, source_bits: int) -> BlockWeight:
    """`w = scale * (q - center)`: shift q so that `center` falls on the default zero point `2**(bits-1)`."""
    bits = _container(source_bits)
    rows, _, block_size = q.shape
    values = (q.astype(np.int16) + ((1 << (bits - 1)) - center)).astype(np.uint8)
    factors, table = _table(scale)
    return BlockWeight(bits, block_size, values.reshape(rows, -1), table, None, None, factors)


def _with_minimum(
    q: np.ndarray, scale: np.ndarray | Factors, minimum: np.ndarray | Factors, *, source_bits: int
) -> BlockWeight:
    """`w = scale * q + minimum` as `(q - z) * scale + (minimum + z * scale)`, `z` the nearest uint8 zero point."""
    bits = _container(source_bits)
    rows, _, block_size = q.shape
    scale_factors, scale = _table(scale)
    minimum_factors, minimum = _table(minimum)
    with np.errstate(divide="ignore", invalid="ignore"):
        ideal = np.where(scale != 0, -minimum / scale, 0.0)
    zero = np.clip(np.rint(ideal), 0, (1 << bits) - 1).astype(np.uint8)
    residual = residual_table(minimum, zero, scale)  # as the runtime expands it
    values = q.reshape(rows, -1).astype(np.uint8)
    return BlockWeight(bits, block_size, values, scale, zero, residual, scale_factors, minimum_factors)


def _table(values: np.ndarray | Factors) -> tuple[Factors | None, np.ndarray]:
    if isinstance(values, Factors):
        return values, values.table()
    return None, values.astype(np.float32)


_DECODERS = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.MXFP4: _mxfp4,
    GGMLQuantizationType.Q2_K: _q2_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
