"""The graph's rotary tables, computed by transformers' own rotary embedding, for every kind of rope scaling.

GroupQueryAttention rotates q and k with a cos and a sin table, one row per position (`[positions, rotary_dim / 2]`).
onnxruntime-genai's builder (0.18) computes them itself and gets several kinds of scaling wrong or not at all:
yarn without `beta_fast`/`beta_slow` divides by zero, its `mscale` and `attention_factor` differ from transformers',
`linear` and `yarn` on a Llama are silently dropped, `dynamic` is refused, and Gemma 3's sliding layers get the
global layers' scaling. So the builder is only made to run (`builder_rope`), and every table its graph reads is
replaced here by the `cos`/`sin` transformers' rotary embedding module computes for those positions (its
`attention_scaling` included), per layer type where the model has several (Gemma 3).

Rope kinds whose frequencies depend on the sequence, not only on the position:
- `longrope` (Phi-3.5, Phi-4-mini): transformers rotates a whole sequence with the short factors while it fits the
  original context and with the long factors once it is longer (Phi-3's generate recomputes the cache at the switch).
  A bundle serves rows of any length from one KV cache with chunked prefill, a prefix cache and batching, so its
  table must be a function of the position alone: the structure keeps both tables and a bundle whose context fits
  the original context uses the short one (exactly transformers' for every sequence it can hold), a longer bundle
  the long one (exactly transformers' for every sequence past the original context; what llama.cpp does for a
  context past it). `bundle_config` gives the config whose transformers model computes what a bundle computes.
- `dynamic` (NTK): transformers rescales only past `max_position_embeddings`, every position by the sequence
  length; up to there it is plain rope, which a bundle serves exactly, and a `max_context` past it is refused
  (`check_rope`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

SHORT = ".short"  # suffix of a longrope table's short-factor twin in the structure
_LAYER = re.compile(r"/model/layers\.(\d+)/")
_COS, _SIN = 7, 8  # GroupQueryAttention's cos_cache and sin_cache inputs
# The ops that read rotary tables and the inputs they read them at (RotaryEmbedding: HunYuan rotates outside attention).
_TABLE_INPUTS = {"GroupQueryAttention": (_COS, _SIN), "RotaryEmbedding": (2, 3)}


def rope_parameter_sets(config: Any) -> Iterator[dict[str, Any]]:
    """Each set of rope parameters in a transformers config: one, or one per layer type (Gemma 3)."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return
    if all(isinstance(p, dict) for p in rope.values()) and rope:
        yield from rope.values()
    else:
        yield rope


def _json_rope_sets(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Each set of rope parameters in a config.json: `rope_scaling` (transformers 4) or `rope_parameters`, flat or
    one per layer type."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, dict):
        return []
    nested = [p for p in rope.values() if isinstance(p, dict)]
    return nested if nested and len(nested) == len(rope) else [rope]


def check_rope(config: dict[str, Any], where: str, max_context: int | None) -> None:
    """Refuse a config.json's rope that a bundle cannot compute as transformers does (into `max_context` positions).

    - GroupQueryAttention (ONNX Runtime's group_query_attention_helper.h) takes rotary tables whose width, half
      the rotary dimension, is a multiple of 8 and at most `head_dim // 16 * 8`: every published model's is
      (Phi-4-mini: 128 x 0.75 / 2 = 48);
    - dynamic NTK rescales every position by the sequence length once it passes `max_position_embeddings`.
    """
    from packager.errors import UserError

    sets = _json_rope_sets(config)
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    partial = config.get("partial_rotary_factor") or next(
        (p["partial_rotary_factor"] for p in sets if p.get("partial_rotary_factor")), 1.0
    )
    width = int(head_dim * partial) // 2
    if head_dim and (width % 8 or width > head_dim // 16 * 8):
        raise UserError(
            f"{where}: head_dim {head_dim} x partial_rotary_factor {partial} gives rotary tables {width} wide; "
            f"ONNX Runtime's GroupQueryAttention needs a multiple of 8, at most {head_dim // 16 * 8}",
            exit_code=2,
        )
    longest = config.get("max_position_embeddings")
    dynamic = any(p.get("rope_type", p.get("type")) == "dynamic" for p in sets)
    if dynamic and max_context is not None and longest and max_context > longest:
        raise UserError(
            f"{where} scales rope with dynamic NTK, which rescales every position by the sequence length past "
            f"max_position_embeddings = {longest}, and a bundle's rotary table is one fixed row per position; "
            f"set export.max_context to at most {longest} (up to there dynamic NTK is plain rope, served exactly)",
            exit_code=2,
        )


def builder_rope(config: Any) -> None:
    """Rope parameters the builder runs with: its tables are replaced by transformers' own (`correct_tables`).

    `longrope` and `dynamic` become plain rope: the builder refuses dynamic, and for longrope it makes an If node
    that picks a table by the attention mask's width; `original_max_position_embeddings` is set to
    `max_position_embeddings` so that a Phi-3 gets the builder's one-table model. (Its rescaling of the frequencies,
    which yarn without `beta_fast`/`beta_slow` divides by zero in, is skipped: structure.py.)
    """
    longrope = False
    for parameters in rope_parameter_sets(config):
        kind = parameters.get("rope_type", parameters.get("type"))
        longrope = longrope or kind == "longrope"
        if kind in ("longrope", "dynamic"):
            parameters["rope_type"] = "default"
    if longrope:
        config.original_max_position_embeddings = config.max_position_embeddings


def _rotary_module(model: Any) -> Any:
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(found) != 1:
        raise ValueError(f"expected one rotary embedding module in {type(model).__name__}, found {len(found)}")
    return found[0]


def _original_context(rotary: Any, layer_type: str | None) -> int | None:
    """A longrope module's original context (where transformers switches from the short to the long factors)."""
    kind = rotary.rope_type[layer_type] if layer_type is not None else rotary.rope_type
    if kind != "longrope":
        return None
    parameters = rotary.config.rope_parameters
    parameters = parameters[layer_type] if layer_type is not None else parameters
    return int(parameters["original_max_position_embeddings"])


def _table(rotary: Any, positions: int, layer_type: str | None, width: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' cos and sin for a sequence of `positions` tokens, `width` (one per frequency) as the graph reads
    them: the first half of rotate_half's `cat(freqs, freqs)` layout, or all of a module that returns `freqs` alone
    (gpt-oss)."""
    import torch

    ids = torch.arange(positions)[None, :]
    x = torch.zeros(1, dtype=torch.float32)
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    cos, sin = rotary(x, ids, **kwargs)
    if cos.shape[-1] not in (width, 2 * width):
        raise ValueError(f"the graph's rotary tables are {width} wide, transformers' rotary embedding {cos.shape[-1]}")
    return cos[0, :, :width].numpy().astype(np.float32), sin[0, :, :width].numpy().astype(np.float32)


def correct_tables(graph: Any, model: Any, layer_types: list[str] | None) -> list[str]:
    """Replace every rotary table `graph` (an onnx_ir graph) feeds attention or a rotation with transformers'.

    `model`: the transformers model the builder walked (its rotary module has real buffers: they are not weights).
    A longrope table also gets its short-factor twin, an initializer named `<table>.short`. Returns the tables set.
    """
    import onnx_ir as ir

    rotary = _rotary_module(model)
    per_type = isinstance(rotary.rope_type, dict)
    tables: dict[str, str | None] = {}  # table name -> the layer type it serves
    for node in graph:
        indices = _TABLE_INPUTS.get(node.op_type)
        if indices is None or len(node.inputs) <= indices[1] or not getattr(node.inputs[indices[0]], "name", None):
            continue  # not a rotation, or attention that does not rotate (a NoPE layer, rotation done before it)
        match = _LAYER.match(node.name or "")
        if match is None:
            raise ValueError(f"cannot tell the layer of attention node {node.name!r}")
        layer_type = layer_types[int(match.group(1))] if per_type and layer_types else None
        for index in indices:
            name = node.inputs[index].name
            if tables.setdefault(name, layer_type) != layer_type:
                raise ValueError(f"rotary table {name!r} serves layers of types {tables[name]!r} and {layer_type!r}")
    values = {v.name: v for v in graph.initializers.values()}
    for name, layer_type in tables.items():
        value = values[name]
        rows, width = value.const_value.shape
        cos, sin = _table(rotary, rows, layer_type, width)
        is_cos = name.startswith("cos")
        value.const_value = ir.tensor(cos if is_cos else sin, name=name)
        original = _original_context(rotary, layer_type)
        if original is not None and original < rows:
            cos, sin = _table(rotary, original, layer_type, width)
            twin = cos if is_cos else sin
            short = ir.Value(name=name + SHORT, const_value=ir.tensor(twin, name=name + SHORT))
            short.type, short.shape = value.type, ir.Shape(twin.shape)
            graph.register_initializer(short)
    return sorted(tables)


def table_for(name: str, max_positions: int, array: Callable[[str], np.ndarray], names: set[str]) -> np.ndarray:
    """The rows of rotary table `name` a bundle of `max_positions` positions ships: a longrope table's short twin
    when the bundle fits the original context (the twin's rows), else the table itself."""
    if name + SHORT in names:
        short = array(name + SHORT)
        if max_positions <= short.shape[0]:
            return short[:max_positions]
    return array(name)[:max_positions]


def bundle_config(config: Any, max_positions: int) -> Any:
    """The transformers config whose model computes what a bundle of `max_positions` positions computes.

    The same config, except for a longrope model whose bundle runs past the original context: its short factors
    become the long ones, so that transformers rotates every sequence as it rotates one past the original context.
    """
    changed = None
    for parameters in rope_parameter_sets(config):
        if parameters.get("rope_type") != "longrope":
            continue
        if max_positions <= int(parameters["original_max_position_embeddings"]):
            continue
        changed = changed or copy.deepcopy(config)
    if changed is None:
        return config
    for parameters in rope_parameter_sets(changed):
        if parameters.get("rope_type") == "longrope":
            parameters["short_factor"] = list(parameters["long_factor"])
    return changed
