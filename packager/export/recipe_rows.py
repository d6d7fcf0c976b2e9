"""Which source rows a recipe's matrix holds, when it only moves them (lazy.py records the recipes).

The builder concatenates q, k and v, transposes every MatMul weight, and reads a tied embedding through
lm_head's transpose: each only moves rows, so the rows of the weight it makes are rows of named source tensors,
in an order this works out. A recipe that computes anything (a norm's `+ 1`, a scale folded in) holds none.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from packager.export.lazy import LazyTensor, Recipe

# Ops that never change values: they may sit anywhere in a recipe whose rows are carried.
_PASS_THROUGH = {
    "aten.alias.default", "aten.detach.default", "aten.clone.default", "aten.contiguous.default",
    "aten.lift_fresh.default", "aten._to_copy.default", "aten.view.default", "aten._unsafe_view.default",
    "aten.reshape.default",
}  # fmt: skip
_TRANSPOSES = {"aten.t.default", "aten.permute.default", "aten.transpose.int", "aten.numpy_T.default"}


@dataclass(frozen=True)
class SourceRows:
    """A matrix whose rows are, in order, rows of leaves: `rows[i] = (leaf name, row index)`; `transposed` when the
    recipe's value holds them as columns (a MatMul weight `[K, N]`)."""

    rows: tuple[tuple[str, np.ndarray], ...]  # runs of (leaf, row indices into that leaf), in order
    transposed: bool


def row_sources(recipe: Recipe, leaf_rows: Callable[[str], int]) -> SourceRows | None:
    """The source rows `recipe` holds unchanged, or None when it computes anything (then it must be evaluated).

    `leaf_rows(name)` is a 2-D leaf's row count (its first dimension).
    """
    if recipe.leaf is not None:
        return SourceRows(((recipe.leaf, np.arange(leaf_rows(recipe.leaf))),), transposed=False)
    op, args = recipe.op, recipe.args
    if op in _PASS_THROUGH and recipe.index is None:
        inner = _first_lazy(args)
        if inner is None or not _keeps_shape_and_dtype(recipe, inner):
            return None
        return row_sources(inner.recipe, leaf_rows)
    if op in _TRANSPOSES and recipe.index is None:
        inner = _first_lazy(args)
        if inner is None or not _is_2d_swap(op, args):
            return None
        found = row_sources(inner.recipe, leaf_rows)
        return None if found is None else SourceRows(found.rows, not found.transposed)
    if op == "aten.cat.default":
        parts = args[0]
        dim = args[1] if len(args) > 1 else (recipe.kwargs or {}).get("dim", 0)
        found_parts = [row_sources(p.recipe, leaf_rows) if isinstance(p, LazyTensor) else None for p in parts]
        if any(f is None for f in found_parts):
            return None
        orientation = {f.transposed for f in found_parts}  # type: ignore[union-attr]
        if len(orientation) != 1:
            return None
        transposed = orientation.pop()
        if dim % 2 != (1 if transposed else 0):
            return None  # joined along K, not along rows
        return SourceRows(tuple(run for f in found_parts for run in f.rows), transposed)  # type: ignore[union-attr]
    if op == "aten.slice.Tensor":
        inner = _first_lazy(args)
        found = None if inner is None else row_sources(inner.recipe, leaf_rows)
        if found is None:
            return None
        dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1 :])[:4]
        if dim % 2 != (1 if found.transposed else 0):
            return None
        return SourceRows(_select(found.rows, slice(start, end, step)), found.transposed)
    return None


def _first_lazy(args: tuple[Any, ...]) -> LazyTensor | None:
    return args[0] if args and isinstance(args[0], LazyTensor) else None


def _keeps_shape_and_dtype(recipe: Recipe, inner: LazyTensor) -> bool:
    """A view, copy or cast that leaves the matrix as it is (a float32 `_to_copy`, a `view` to the same shape)."""
    kwargs = recipe.kwargs or {}
    if recipe.op == "aten._to_copy.default":
        return kwargs.get("dtype") in (None, torch.float32)
    if recipe.op in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
        return tuple(recipe.shape) == tuple(inner.recipe.shape)
    return True


def _is_2d_swap(op: str, args: tuple[Any, ...]) -> bool:
    if op in ("aten.t.default", "aten.numpy_T.default"):
        return True
    if op == "aten.permute.default":
        return list(args[1]) == [1, 0]
    return sorted(int(a) % 2 for a in args[1:3]) == [0, 1]


def _select(runs: tuple[tuple[str, np.ndarray], ...], window: slice) -> tuple[tuple[str, np.ndarray], ...]:
    flat_leaf = [leaf for leaf, rows in runs for _ in rows]
    flat_rows = np.concatenate([rows for _, rows in runs])[window]
    picked_leaves = np.asarray(flat_leaf, dtype=object)[window]
    out: list[tuple[str, np.ndarray]] = []
    for leaf, group in itertools.groupby(zip(picked_leaves, flat_rows, strict=True), key=lambda p: p[0]):
        out.append((leaf, np.fromiter((row for _, row in group), np.int64)))
    return tuple(out)


@dataclass(frozen=True)
class LeafRows:
    """A 3-D recipe's value as its leaf's: the last two axes swapped or not, the rows (axis 1) in `order`."""

    leaf: Recipe
    swapped: bool
    order: np.ndarray | None  # row i of each expert is the leaf's row order[i]; None: in the leaf's order


def leaf_rows(recipe: Recipe) -> LeafRows | None:
    """The leaf a recipe holds unchanged (views, copies, float32 casts), whether its last two axes are swapped (one
    transpose of them: a Mixture-of-Experts weight `[experts, rows, K]` made from an input-major leaf) and how its
    rows are reordered (one `index_select` along them: gate and up rows interleaved); None when the recipe computes
    anything or moves more than that."""
    swapped = False
    order: np.ndarray | None = None
    node = recipe
    while node.leaf is None:
        inner = _first_lazy(node.args)
        if inner is None or node.index is not None:
            return None
        if node.op in _PASS_THROUGH and _keeps_shape_and_dtype(node, inner):
            node = inner.recipe
            continue
        if node.op in _TRANSPOSES and _swaps_last_two(node, len(inner.recipe.shape)):
            swapped, node = not swapped, inner.recipe
            continue
        rank = len(inner.recipe.shape)
        if node.op == "aten.index_select.default" and order is None and not swapped and rank >= 2:
            dim, index = node.args[1], node.args[2]
            if int(dim) % rank == rank - 2 and isinstance(index, torch.Tensor):
                order, node = index.numpy().astype(np.int64), inner.recipe
                continue
        return None
    if swapped and order is not None:
        return None  # rows picked before a swap would be the leaf's columns
    return LeafRows(node, swapped, order)


def _swaps_last_two(recipe: Recipe, rank: int) -> bool:
    if rank < 2:
        return False
    last_two = [*range(rank - 2), rank - 1, rank - 2]
    if recipe.op == "aten.permute.default":
        return [int(a) % rank for a in recipe.args[1]] == last_two
    if recipe.op in ("aten.t.default", "aten.numpy_T.default"):
        return rank == 2
    return sorted(int(a) % rank for a in recipe.args[1:3]) == [rank - 2, rank - 1]
