"""Derive the prefill graphs the runtime runs prompts through, beside the builder's graph in a bundle.

Prompts and decoding want different matmuls, and which prompt matmuls win depends on the CPU:
- Without int8 dot products (AVX2, measured on 2 threads, 32-token prompt): MatMulNBits with int8
  activations (accuracy_level 4) runs M>1 products ~2.6x slower than fp32 MatMul on the same weights.
- With them (AVX-512 VNNI, measured here): the builder's int8 matmuls are the faster ones, 1.2-1.3x
  over fp32 (a 32-token prompt 33 against 42 ms, eight batched 228 against 273 ms).
Logits for every prompt position spend ~25 % of prefill in lm_head although only the last position is
ever sampled; decoding one token per row wants int8 weights on every CPU (4x fewer bytes read).

So a quantized bundle gets two prefill graphs, and the runtime picks by CPU (runtime/engine/graphs.py):
- `prefill-quantized.onnx`: the builder's graph with a per-row gather of each prompt's last position
  before lm_head (logits `[batch, 1, vocab]`). The position is `max(0, S - T + sum(attention_mask[row]) - 1)`
  for S new tokens and a mask T wide, i.e. the last new token of a single row (past or not), each row's
  own last token in a batch of right-padded first prompts (so the engine can prefill several prompts in
  one run), and position 0 of every row of a ragged decode step. Its weights are the builder's: every
  initializer points into `model.onnx.data`, so it costs no bytes of weights on disk.
- `prefill.onnx`: the same, with every MatMulNBits except lm_head replaced by a MatMul on the same
  weights dequantized to fp32 (`prefill.onnx.data`); lm_head stays quantized (one row per prefill).
An fp32 export has nothing to dequantize: it gets `prefill.onnx` alone, whose matmuls are the builder's.
Quality is verified on the builder's graph (all-position logits); the quantized prefill graph computes
exactly its matmuls, the fp32 one the same weights with fp32 activations (closer to the fp32 reference).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from packager.errors import UserError
from runtime.engine.graphs import PREFILL_MODEL_FILE, QUANTIZED_PREFILL_FILE, ROW_LAST_POSITIONS

PREFILL_GRAPH_VERSION = 3  # bump when the graph written here changes, to rebuild bundles
PREFILL_DATA_FILE = PREFILL_MODEL_FILE + ".data"
LM_HEAD_PREFIX = "/lm_head/"
_ALIGN = 4096  # page-aligned tensors in the data file, so ONNX Runtime can map them
_LOGITS = "logits"


def write_prefill_graph(bundle_dir: Path, model_file: str) -> list[str]:
    """Write the prefill graphs of `bundle_dir/model_file` into `bundle_dir`; returns the file names written."""
    model = onnx.load(str(bundle_dir / model_file), load_external_data=False)
    _gather_last_positions(model)
    quantized = onnx.ModelProto()
    quantized.CopyFrom(model)  # before the matmuls are dequantized: kept only if some were
    written = [PREFILL_MODEL_FILE]
    if _dequantize_matmuls(model, bundle_dir):
        _save(quantized, bundle_dir / QUANTIZED_PREFILL_FILE)
        written += [PREFILL_DATA_FILE, QUANTIZED_PREFILL_FILE]
    _save(model, bundle_dir / PREFILL_MODEL_FILE)
    return written


def _save(model: onnx.ModelProto, path: Path) -> None:
    key, value = ROW_LAST_POSITIONS
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, key: value})
    onnx.save(model, str(path))


def _gather_last_positions(model: onnx.ModelProto) -> None:
    graph = model.graph
    heads = [n for n in graph.node if n.name.startswith(LM_HEAD_PREFIX) and _LOGITS in n.output]
    if len(heads) != 1:
        raise UserError(
            f"the exported graph has {len(heads)} lm_head nodes writing {_LOGITS!r}; onnxfn expects exactly one "
            "(is this an onnxruntime-genai builder graph?)"
        )
    head = heads[0]
    inputs = {i.name for i in graph.input}
    ids, mask = "input_ids", "attention_mask"
    if not {ids, mask} <= inputs:
        raise UserError(f"the exported graph lacks {ids!r} or {mask!r}; onnxfn expects a genai builder graph")
    constants = {"prefill/axis1": [1], "prefill/one": [1], "prefill/zero": [0]}
    graph.initializer.extend(helper.make_tensor(name, TensorProto.INT64, [1], v) for name, v in constants.items())

    def node(op: str, inputs: list[str], output: str, **attrs: int) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output], name=f"/prefill/{output.removeprefix('prefill/')}", **attrs)

    nodes = [
        node("Shape", [ids], "prefill/ids_shape"),
        node("Gather", ["prefill/ids_shape", "prefill/one"], "prefill/new", axis=0),  # S
        node("Shape", [mask], "prefill/mask_shape"),
        node("Gather", ["prefill/mask_shape", "prefill/one"], "prefill/width", axis=0),  # T
        node("ReduceSum", [mask, "prefill/axis1"], "prefill/lengths", keepdims=1),  # [batch, 1]
        node("Sub", ["prefill/new", "prefill/width"], "prefill/shift"),
        node("Add", ["prefill/lengths", "prefill/shift"], "prefill/end"),
        node("Sub", ["prefill/end", "prefill/one"], "prefill/last_or_less"),  # [batch, 1]: S - T + length - 1
        # A decode step (S = 1) pads shorter rows' masks on the right: their one position is 0.
        node("Max", ["prefill/last_or_less", "prefill/zero"], "prefill/last"),
        node("GatherND", [head.input[0], "prefill/last"], "prefill/last_hidden_2d", batch_dims=1),  # [batch, H]
        node("Unsqueeze", ["prefill/last_hidden_2d", "prefill/axis1"], "prefill/last_hidden"),  # [batch, 1, H]
    ]
    head.input[0] = "prefill/last_hidden"
    at = list(graph.node).index(head)
    for offset, added in enumerate(nodes):
        graph.node.insert(at + offset, added)
    (logits,) = [o for o in graph.output if o.name == _LOGITS]
    dims = logits.type.tensor_type.shape.dim
    dims[1].Clear()
    dims[1].dim_value = 1


def _dequantize_matmuls(model: onnx.ModelProto, bundle_dir: Path) -> bool:
    """Turn each symmetric 4/8-bit MatMulNBits (lm_head excepted) into an fp32 MatMul; False if none was."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    data_files: dict[str, np.memmap] = {}
    replaced: set[str] = set()
    added: list[TensorProto] = []
    offset = 0
    with (bundle_dir / PREFILL_DATA_FILE).open("wb") as out:
        for node in graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            # A zero-point input (asymmetric) or g_idx would change the formula: those keep MatMulNBits.
            plain = node.op_type == "MatMulNBits" and len(node.input) == 3 and attrs.get("bits") in (4, 8)
            if not plain or node.name.startswith(LM_HEAD_PREFIX):
                continue
            packed = _external_array(initializers[node.input[1]], bundle_dir, data_files)
            scales = _external_array(initializers[node.input[2]], bundle_dir, data_files)
            weight = dequantize_nbits(packed, scales, int(attrs["bits"]), int(attrs["K"]))
            out.write(b"\0" * (-offset % _ALIGN))
            offset += -offset % _ALIGN
            name = f"{node.input[1]}.fp32"
            added.append(_external_tensor(name, weight.shape, PREFILL_DATA_FILE, offset, weight.nbytes))
            out.write(weight.tobytes())
            offset += weight.nbytes
            replaced.update(node.input[1:])
            node.op_type, node.domain = "MatMul", ""
            del node.attribute[:]
            del node.input[1:]
            node.input.append(name)
    if not added:
        (bundle_dir / PREFILL_DATA_FILE).unlink()
        return False
    kept = [t for t in graph.initializer if t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend([*kept, *added])
    return True


def dequantize_nbits(packed: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """MatMulNBits' symmetric weights (`[N, blocks, block_bytes]` uint8, scales `[N, blocks]`) as fp32 `[K, N]`.

    Without a zero-point input the zero point is 2^(bits-1); 4-bit values are packed low nibble first.
    """
    if bits == 8:
        values = packed.astype(np.float32)
    else:
        values = np.empty((*packed.shape[:2], packed.shape[2] * 2), dtype=np.float32)
        values[..., 0::2] = packed & 0x0F
        values[..., 1::2] = packed >> 4
    values -= float(1 << (bits - 1))
    values *= scales[:, :, None]
    return np.ascontiguousarray(values.reshape(values.shape[0], -1)[:, :k].T)


def _external_array(tensor: TensorProto, bundle_dir: Path, files: dict[str, np.memmap]) -> np.ndarray:
    info = {e.key: e.value for e in tensor.external_data}
    if tensor.data_location != TensorProto.EXTERNAL or "location" not in info:
        return onnx.numpy_helper.to_array(tensor)
    location = info["location"]
    if location not in files:
        files[location] = np.memmap(bundle_dir / location, dtype=np.uint8, mode="r")
    start = int(info.get("offset", 0))
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims))
    raw = files[location][start : start + count * dtype.itemsize]
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(tensor.dims))


def _external_tensor(name: str, shape: tuple[int, ...], location: str, offset: int, length: int) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor
