"""Mixture-of-Experts layers: the builder's float `MoE` node as ONNX Runtime's block-quantized `QMoE`, and back.

The structure (the builder run at fp32) holds each MoE layer as one `com.microsoft` `MoE` node whose experts are
two 3-D weights: fc1 `[experts, 2 * inter, hidden]` (gate and up rows interleaved, `swiglu_fusion = 1`) and fc2
`[experts, hidden, inter]`, output features as rows, input features last. `QMoE` stores them as MatMulNBits does
a 2-D weight, expert by expert: each row's values along K in blocks with a float scale per block, 4-bit values two
to a byte (low nibble first), and the default zero point `2 ** (bits - 1)` (the builder's CPU path quantizes
with the same MLAS quantizer, `_matmulnbits_blockwise_quantize`).

Measured on ONNX Runtime 1.31's CPU kernels (shared/probes are not needed: the checks are in tests/architectures):
- `MoE` runs fp32 with fused SwiGLU only (an unfused fc3 is "not implemented for CPU MoE"); `QMoE` runs int4 and
  int8 block-wise (block 16, 32, 64) but not MXFP4 (`quant_type = "fp4"` has no CPU kernel), and neither runs
  the `geglu` activation.
- `QMoE` always renormalises the selected experts' routing weights (`normalize_routing_weights = 0` is ignored):
  equal to `MoE` only for models that renormalise (gpt-oss does).
- `MoE` with `normalize_routing_weights = 0` is right alone but wrong inside a whole graph unless its output is a
  graph output of its own (a Qwen2-MoE graph: logits off by 1.8): it depends on what its output buffer held. So
  no export uses it: a model that does not renormalise is exported renormalised and scaled by the top k's share of
  the softmax (builder_moe.py).
- 8-bit experts always compute with int8 activations (block-wise per row, whatever `accuracy_level` says); 4-bit
  ones with fp32 activations at accuracy level 0 and int8 ones at 4.
- Batch invariance: a token's output from int8 `QMoE`, and from int4 at accuracy level 4, is bit for bit the same
  whatever else is in the call; fp32 `MoE` and int4 at level 0 differ in the last bits (up to ~1e-6 relative)
  with how many tokens share an expert in the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import NodeProto, TensorProto, helper

MS_DOMAIN = "com.microsoft"
# The MoE node's inputs: [input, router_probs, fc1_weights, fc1_bias, fc2_weights, fc2_bias, fc3_weights, fc3_bias]
FC1, FC1_BIAS, FC2, FC2_BIAS = 2, 3, 4, 5
# MoE's attributes QMoE shares (the rest are QMoE's own: bits, block size, accuracy level)
_SHARED_ATTRIBUTES = (
    "activation_alpha", "activation_beta", "activation_type", "k", "normalize_routing_weights", "swiglu_fusion",
    "swiglu_limit", "use_sparse_mixer",
)  # fmt: skip


@dataclass(frozen=True)
class QuantizedExperts:
    """One projection of every expert: `w[e, n, k] = (values[e, n, k] - 2 ** (bits - 1)) * scales[e, n, k // block]`."""

    bits: int  # 4 or 8
    block_size: int
    values: np.ndarray  # uint8 [experts, rows, K], each below 2 ** bits
    scales: np.ndarray  # float32 [experts, rows, K / block_size]

    def packed(self) -> np.ndarray:
        """QMoE's weight input: `[experts, rows, K * bits / 8]` uint8, 4-bit values two to a byte, low nibble first."""
        if self.bits == 8:
            return self.values
        return (self.values[..., 0::2] | (self.values[..., 1::2] << 4)).astype(np.uint8)

    def dequantize(self) -> np.ndarray:
        experts, rows, k = self.values.shape
        blocks = self.values.reshape(experts, rows, k // self.block_size, self.block_size).astype(np.float32)
        weight = (blocks - np.float32(1 << (self.bits - 1))) * self.scales[..., None]
        return weight.reshape(experts, rows, k)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """QMoE's weight input back to one value per byte."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def quantize_experts(weights: np.ndarray, bits: int, block_size: int) -> QuantizedExperts:
    """`weights` `[experts, rows, K]` float32 quantized expert by expert with ONNX Runtime's MLAS block quantizer
    (symmetric, the MatMulNBits grid: what the builder's CPU QMoE path writes)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    experts, rows, k = weights.shape
    if k % block_size:
        raise ValueError(f"QMoE needs K ({k}) to be a multiple of the block size ({block_size})")
    blocks = k // block_size
    values = np.empty((experts, rows, k), np.uint8)
    scales = np.empty((experts, rows, blocks), np.float32)
    quantize = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    for expert in range(experts):
        packed = np.zeros((rows, blocks, block_size * bits // 8), np.uint8)
        zero_points = np.zeros((rows, (blocks * bits + 7) // 8), np.uint8)
        matrix = np.ascontiguousarray(weights[expert].T, dtype=np.float32)  # the quantizer reads MatMul's [K, N]
        quantize(packed, matrix, scales[expert], zero_points, block_size, rows, k, True)
        values[expert] = unpack(packed.reshape(rows, -1), bits)
    return QuantizedExperts(bits, block_size, values, scales)


def qmoe_node(
    moe: NodeProto, fc1: tuple[str, str], fc2: tuple[str, str], bits: int, block_size: int, accuracy_level: int
) -> NodeProto:
    """The QMoE node computing what `moe` computes, its experts' (weights, scales) initializers named in fc1, fc2."""
    inputs = list(moe.input) + [""] * (8 - len(moe.input))
    attributes: dict[str, Any] = {
        a.name: helper.get_attribute_value(a) for a in moe.attribute if a.name in _SHARED_ATTRIBUTES
    }
    attributes |= {"expert_weight_bits": bits, "block_size": block_size, "accuracy_level": accuracy_level}
    qmoe_inputs = [inputs[0], inputs[1], fc1[0], fc1[1], inputs[FC1_BIAS], fc2[0], fc2[1], inputs[FC2_BIAS]]
    name = moe.name.removesuffix("/MoE") + "/QMoE" if moe.name.endswith("/MoE") else f"{moe.name}/QMoE"
    return helper.make_node("QMoE", qmoe_inputs, list(moe.output), name=name, domain=MS_DOMAIN, **attributes)


def qmoe_nodes(
    moe: NodeProto, fc1: tuple[str, str], fc2: tuple[str, str], bits: int, block_size: int, accuracy_level: int
) -> list[NodeProto]:
    """The nodes computing what `moe` computes with its experts in QMoE, a token's output independent of the others.

    QMoE sums a token's expert outputs in an order that depends on the other tokens in the call: with more than two
    experts per token (gpt-oss: 4) the float sum then differs in its last bits with the batch. So the experts are
    mixed two at a time: the router's top k (TopK, in the graph) split into pairs of ranks, each pair one QMoE call
    that selects exactly those two (the other logits masked) and mixes them with the model's routing weights
    (`router_weights`, given, not renormalised), the calls' outputs added in rank order. A sum of two is the same
    in either order, so every step is batch invariant. The work is the same: each (token, expert) once.
    """
    attributes = {a.name: helper.get_attribute_value(a) for a in moe.attribute}
    k = int(attributes.get("k", 1))
    if k <= 2 or attributes.get("use_sparse_mixer", 0):
        return [qmoe_node(moe, fc1, fc2, bits, block_size, accuracy_level)]
    base = moe.name.removesuffix("/MoE")
    probs = moe.input[1]
    nodes: list[NodeProto] = []

    def node(op: str, inputs: list[str], outputs: list[str] | str, **attrs: Any) -> list[str]:
        outs = [outputs] if isinstance(outputs, str) else outputs
        nodes.append(helper.make_node(op, inputs, outs, name=f"{base}/pairs/{outs[0].rsplit('/', 1)[-1]}", **attrs))
        return outs

    def constant(name: str, values: list[int]) -> str:
        tensor = helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
        return node("Constant", [], f"{base}/pairs/{name}", value=tensor)[0]

    values, indices = node(
        "TopK", [probs, constant("k", [k])], [f"{base}/pairs/top_values", f"{base}/pairs/top_indices"], axis=-1
    )
    if attributes.get("normalize_routing_weights", 0):
        (mixing,) = node("Softmax", [values], f"{base}/pairs/top_weights", axis=-1)
    else:
        (all_weights,) = node("Softmax", [probs], f"{base}/pairs/all_weights", axis=-1)
        (mixing,) = node("GatherElements", [all_weights, indices], f"{base}/pairs/top_weights", axis=1)
    (shape,) = node("Shape", [probs], f"{base}/pairs/shape")
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    lowest = helper.make_tensor("lowest", TensorProto.FLOAT, [1], [float(np.finfo(np.float32).min)])
    (zeros,) = node("ConstantOfShape", [shape], f"{base}/pairs/zeros", value=zero)
    (masked,) = node("ConstantOfShape", [shape], f"{base}/pairs/masked", value=lowest)
    (router_weights,) = node("ScatterElements", [zeros, indices, mixing], f"{base}/pairs/router_weights", axis=1)
    axis = constant("axis", [1])
    outputs = []
    for pair, start in enumerate(range(0, k, 2)):
        end = min(start + 2, k)
        bounds = [constant(f"start{pair}", [start]), constant(f"end{pair}", [end]), axis]
        (pair_indices,) = node("Slice", [indices, *bounds], f"{base}/pairs/indices{pair}")
        (pair_values,) = node("Slice", [values, *bounds], f"{base}/pairs/values{pair}")
        (pair_probs,) = node(
            "ScatterElements", [masked, pair_indices, pair_values], f"{base}/pairs/probs{pair}", axis=1
        )
        call = qmoe_node(moe, fc1, fc2, bits, block_size, accuracy_level)
        call.name = f"{call.name}{pair}"
        call.input[1] = pair_probs
        call.input.extend([""] * (14 - len(call.input)) + [router_weights])
        call.output[0] = f"{call.name}/output_0"
        for attribute in call.attribute:
            if attribute.name == "k":
                attribute.i = end - start
            elif attribute.name == "normalize_routing_weights":
                attribute.i = 0
        nodes.append(call)
        outputs.append(call.output[0])
    total = outputs[0]
    for pair, output in enumerate(outputs[1:], start=1):
        last = pair == len(outputs) - 1
        total = node("Add", [total, output], moe.output[0] if last else f"{base}/pairs/sum{pair}")[0]
    return nodes


def float_moe_nodes(qmoe: NodeProto, fc1: str, fc2: str) -> list[NodeProto]:
    """The MoE nodes computing in float32 what `qmoe` computes, with fc1/fc2 (its experts dequantized): a GGUF's fp32
    reference. A QMoE of a pair (`qmoe_nodes`) mixes with given routing weights, which MoE cannot take: MoE then
    mixes the pair renormalised and its output is scaled by the pair's share of the routing weights."""
    attributes = {a.name: helper.get_attribute_value(a) for a in qmoe.attribute if a.name in _SHARED_ATTRIBUTES}
    name = qmoe.name.replace("/QMoE", "/MoE")
    inputs = [qmoe.input[0], qmoe.input[1], fc1, qmoe.input[4], fc2, qmoe.input[7]]
    router_weights = qmoe.input[14] if len(qmoe.input) > 14 else ""
    if not router_weights:
        return [helper.make_node("MoE", inputs, list(qmoe.output), name=name, domain=MS_DOMAIN, **attributes)]
    attributes["normalize_routing_weights"] = 1
    mixed = f"{name}/renormalised"
    lowest = helper.make_tensor("lowest", TensorProto.FLOAT, [], [float(np.finfo(np.float32).min)])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    return [
        helper.make_node("MoE", inputs, [mixed], name=name, domain=MS_DOMAIN, **attributes),
        helper.make_node("Constant", [], [f"{name}/lowest"], name=f"{name}/lowest", value=lowest),
        helper.make_node("Greater", [qmoe.input[1], f"{name}/lowest"], [f"{name}/chosen"], name=f"{name}/chosen"),
        helper.make_node("Cast", [f"{name}/chosen"], [f"{name}/mask"], name=f"{name}/mask", to=TensorProto.FLOAT),
        helper.make_node("Mul", [router_weights, f"{name}/mask"], [f"{name}/pair"], name=f"{name}/pair"),
        helper.make_node("Constant", [], [f"{name}/axes"], name=f"{name}/axes", value=axes),
        helper.make_node("ReduceSum", [f"{name}/pair", f"{name}/axes"], [f"{name}/share"], name=f"{name}/share"),
        helper.make_node("Mul", [mixed, f"{name}/share"], list(qmoe.output), name=f"{name}/scaled"),
    ]


def qmoe_layout(qmoe: NodeProto) -> tuple[int, int]:
    """(bits, block size) of a QMoE node."""
    attributes = {a.name: helper.get_attribute_value(a) for a in qmoe.attribute}
    return int(attributes.get("expert_weight_bits", 4)), int(attributes["block_size"])
