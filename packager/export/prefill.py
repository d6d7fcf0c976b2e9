"""Derive the prefill graphs the runtime runs prompts through, beside the builder's graph in a bundle.

Prompts and decoding want different matmuls, and which prompt matmuls win depends on the CPU:
- Without int8 dot products (AVX2, measured on 2 threads, 32-token prompt): MatMulNBits with int8
  activations (accuracy_level 4) runs M>1 products ~2.6x slower than fp32 MatMul on the same weights.
- With them (AVX-512 VNNI, measured here): the model's own int8 matmuls are the faster ones, 1.2-1.3x
  over fp32 (a 32-token prompt 33 against 42 ms, eight batched 228 against 273 ms).
Logits for every prompt position spend ~25 % of prefill in lm_head although only the last position is
ever sampled; decoding one token per row wants quantized weights on every CPU (4x fewer bytes read).

So a quantized bundle gets two prefill graphs, and the runtime picks by CPU (runtime/engine/graphs.py):
- `prefill-quantized.onnx`: the model's graph with a per-row gather of each prompt's last position
  before lm_head (logits `[batch, 1, vocab]`). The position is `max(0, S - T + sum(attention_mask[row]) - 1)`
  for S new tokens and a mask T wide, i.e. the last new token of a single row (past or not), each row's
  own last token in a batch of right-padded first prompts (so the engine can prefill several prompts in
  one run), and position 0 of every row of a ragged decode step. Its weights are the model's: every
  initializer points into `model.onnx.data`, so it costs no bytes of weights on disk.
- `prefill.onnx`: the same, with every MatMulNBits except lm_head replaced by a MatMul on the same weights
  dequantized to fp32 (a GGUF type's block residual folded in); lm_head stays quantized (one row per prefill).
  Its weights file would be 4-8x the quantized model, so the bundle carries the recipe instead
  (`prefill.onnx.derive.json`) and the runtime writes the file where that graph runs (runtime/engine/derived.py).
An fp32 export has nothing to dequantize: it gets `prefill.onnx` alone, whose weights are `model.onnx.data`'s.
Quality is verified on the model's graph (all-position logits); the quantized prefill graph computes
exactly its matmuls, the fp32 one the same weights with fp32 activations (closer to the fp32 reference).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper

from packager.errors import UserError
from packager.export.external_data import PAGE, external_tensor
from packager.export.graph import drop_dead_nodes
from runtime.engine.derived import recipe_name
from runtime.engine.graphs import PREFILL_MODEL_FILE, QUANTIZED_PREFILL_FILE, ROW_LAST_POSITIONS

PREFILL_GRAPH_VERSION = 4  # bump when the graphs written here change, to rebuild bundles
PREFILL_DATA_FILE = PREFILL_MODEL_FILE + ".data"
PREFILL_RECIPE_FILE = recipe_name(PREFILL_MODEL_FILE)
LM_HEAD_PREFIX = "/lm_head/"
_LOGITS = "logits"


def write_prefill_graphs(bundle_dir: Path, model_file: str) -> list[str]:
    """Write the prefill graphs of `bundle_dir/model_file` into `bundle_dir`; returns the file names written."""
    model = onnx.load(str(bundle_dir / model_file), load_external_data=False)
    _gather_last_positions(model)
    quantized = onnx.ModelProto()
    quantized.CopyFrom(model)  # before the matmuls are dequantized: kept only if some were
    recipe = _dequantize_matmuls(model)
    if recipe is None:
        _save(model, bundle_dir / PREFILL_MODEL_FILE)
        return [PREFILL_MODEL_FILE]
    _save(quantized, bundle_dir / QUANTIZED_PREFILL_FILE)
    _save(model, bundle_dir / PREFILL_MODEL_FILE)
    (bundle_dir / PREFILL_RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
    return [PREFILL_MODEL_FILE, PREFILL_RECIPE_FILE, QUANTIZED_PREFILL_FILE]


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
    inputs = {i.name for i in graph.input}
    ids, mask = "input_ids", "attention_mask"
    if not {ids, mask} <= inputs:
        raise UserError(f"the exported graph lacks {ids!r} or {mask!r}; onnxfn expects a genai builder graph")
    # lm_head may be several nodes (a GGUF weight with a block residual): each one reading the hidden state
    # from outside lm_head reads the gathered rows instead.
    head_nodes = [n for n in graph.node if n.name.startswith(LM_HEAD_PREFIX)]
    # Not the hidden state: lm_head's own outputs, weights, and constants (Gemma 2's logit soft-cap).
    known = {o for n in head_nodes for o in n.output} | {t.name for t in graph.initializer}
    known |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    hidden = {i for n in head_nodes for i in n.input if i and i not in known}
    if len(hidden) != 1:
        raise UserError(f"lm_head reads {sorted(hidden)}; onnxfn expects it to read one hidden state")
    (hidden_state,) = hidden
    constants = {"prefill/axis1": [1], "prefill/one": [1], "prefill/zero": [0]}
    graph.initializer.extend(helper.make_tensor(name, TensorProto.INT64, [1], v) for name, v in constants.items())

    def node(op: str, inputs: list[str], output: str, **attrs: Any) -> NodeProto:  # ONNX attributes, as make_node
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
        node("GatherND", [hidden_state, "prefill/last"], "prefill/last_hidden_2d", batch_dims=1),  # [batch, H]
        node("Unsqueeze", ["prefill/last_hidden_2d", "prefill/axis1"], "prefill/last_hidden"),  # [batch, 1, H]
    ]
    for head_node in head_nodes:
        for position, name in enumerate(head_node.input):
            if name == hidden_state:
                head_node.input[position] = "prefill/last_hidden"
    at = list(graph.node).index(head_nodes[0])
    for offset, added in enumerate(nodes):
        graph.node.insert(at + offset, added)
    (logits,) = [o for o in graph.output if o.name == _LOGITS]
    dims = logits.type.tensor_type.shape.dim
    dims[1].Clear()
    dims[1].dim_value = 1


def _dequantize_matmuls(model: onnx.ModelProto) -> dict[str, Any] | None:
    """Turn each 4/8-bit MatMulNBits (lm_head excepted) into an fp32 MatMul whose weight the recipe derives, and
    move every external tensor into the prefill graph's own data file; None when there was nothing to turn."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    derived: dict[str, dict[str, Any]] = {}
    removed: list[NodeProto] = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        # A g_idx (act-order) input would change the formula: such nodes keep MatMulNBits.
        plain = node.op_type == "MatMulNBits" and len(node.input) <= 4 and attrs.get("bits") in (4, 8)
        if not plain or node.name.startswith(LM_HEAD_PREFIX):
            continue
        spec: dict[str, Any] = {"bits": int(attrs["bits"]), "K": int(attrs["K"])}
        for key, name in zip(("blocks", "scales", "zero_points"), node.input[1:], strict=False):
            if name:
                spec[key] = _ref(initializers[name])
        residual = _residual_of(node, producers, readers, initializers)
        if residual is not None:
            add, correction, residual_t = residual
            spec["residual_t"] = _ref(initializers[residual_t])
            node.output[0] = add.output[0]
            removed += [add, correction]
        name = f"{node.input[1]}.fp32"
        derived[name] = {"dequantize": spec, "shape": [spec["K"], int(attrs["N"])]}
        node.op_type, node.domain = "MatMul", ""
        del node.attribute[:]
        del node.input[1:]
        node.input.append(name)
    if not derived:
        return None
    kept = [n for n in graph.node if not any(n is r for r in removed)]
    del graph.node[:]
    graph.node.extend(kept)
    drop_dead_nodes(graph)
    return _relocate(graph, derived)


def _residual_of(
    node: NodeProto,
    producers: dict[str, NodeProto],
    readers: dict[str, list[NodeProto]],
    initializers: dict[str, TensorProto],
) -> tuple[NodeProto, NodeProto, str] | None:
    """The `Add(node, MatMul(block sums, residual_t))` a GGUF weight with a block minimum adds to `node`, if any."""
    users = readers.get(node.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add":
        return None
    add = users[0]
    other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    correction = producers.get(other)
    if correction is None or correction.op_type != "MatMul" or correction.input[1] not in initializers:
        return None
    sums = producers.get(correction.input[0])  # ReduceSum(Reshape(x)): x's block sums (gguf/operators.py)
    grouped = producers.get(sums.input[0]) if sums is not None and sums.op_type == "ReduceSum" else None
    if grouped is None or grouped.op_type != "Reshape" or grouped.input[0] != node.input[0]:
        return None
    return add, correction, correction.input[1]


def _ref(tensor: TensorProto) -> dict[str, Any]:
    """Where a tensor's bytes are: a file range of the model's data, or (small tensors) inline."""
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type).str
    shape = list(tensor.dims)
    if tensor.data_location != TensorProto.EXTERNAL:
        values = onnx.numpy_helper.to_array(tensor)
        return {"inline": base64.b64encode(values.tobytes()).decode(), "dtype": dtype, "shape": shape}
    info = {e.key: e.value for e in tensor.external_data}
    return {"file": info["location"], "offset": int(info.get("offset", 0)), "dtype": dtype, "shape": shape}


def _relocate(graph: onnx.GraphProto, derived: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Point every external tensor of the graph (and the derived weights) into the prefill data file, page-aligned,
    and return the recipe that writes that file."""
    used = {i for n in graph.node for i in n.input}
    tensors: list[dict[str, Any]] = []
    initializers: list[TensorProto] = []
    placed: dict[tuple[str, int, int], int] = {}  # a copied byte range -> its offset (aliased tensors share it)
    offset = 0

    def place(name: str, data_type: int, shape: list[int], nbytes: int, entry: dict[str, Any]) -> None:
        nonlocal offset
        source = entry.get("copy")
        key = (source["file"], source["offset"], nbytes) if source is not None else None
        if key is not None and key in placed:
            initializers.append(external_tensor(name, data_type, tuple(shape), PREFILL_DATA_FILE, placed[key], nbytes))
            return
        offset += -offset % PAGE
        initializers.append(external_tensor(name, data_type, tuple(shape), PREFILL_DATA_FILE, offset, nbytes))
        tensors.append({"offset": offset, **entry})
        if key is not None:
            placed[key] = offset
        offset += nbytes

    for tensor in graph.initializer:
        if tensor.name not in used:
            continue
        if tensor.data_location != TensorProto.EXTERNAL:
            initializers.append(tensor)
            continue
        nbytes = int(np.prod(tensor.dims)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        place(tensor.name, tensor.data_type, list(tensor.dims), nbytes, {"copy": _ref(tensor)})
    for name, entry in derived.items():
        shape = entry["shape"]
        place(name, TensorProto.FLOAT, shape, int(np.prod(shape)) * 4, {"dequantize": entry["dequantize"]})
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return {"format": 1, "data": PREFILL_DATA_FILE, "size": offset, "tensors": tensors}
