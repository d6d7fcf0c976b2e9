"""Lazy tensors: a model's weights as recipes over named source tensors, computed one tensor at a time.

onnxruntime-genai's builder walks a PyTorch module tree and turns each weight it meets into an initializer,
often after moving it around (`torch.cat` of q/k/v, a transpose, Gemma's `+ 1` on norms). Run on a module
tree whose parameters are `LazyTensor`s, it records those steps instead of computing them: every tensor it
derives is a recipe (an aten op applied to other recipes) whose leaves are the model's parameter names. The
graph's structure thus comes without any weight in memory (llama.cpp's converter and mobius work this way),
and each initializer is computed afterwards, alone, from the source by name (`evaluate`), or, when its recipe
only moves rows, carried as those rows of the source (recipe_rows.py).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

RECIPE_FORMAT = 1
_SCALAR_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}

Loader = Callable[[str], torch.Tensor]  # a leaf's name -> its values


class LazyTensor(torch.Tensor):
    """A tensor known by its shape, dtype and recipe; its values exist only when `evaluate` computes them.

    Ops on it return new lazy tensors (their shapes computed on the meta device). Only reading a scalar out of
    one (`bool(...)`, `.item()`: the builder asks whether a bias is all zeros) computes values, through the
    `Loader` installed with `loading`.
    """

    _meta: torch.Tensor
    recipe: Recipe

    @staticmethod
    def __new__(cls, meta: torch.Tensor, recipe: Recipe) -> LazyTensor:
        tensor = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, meta.shape, strides=meta.stride(), dtype=meta.dtype, device=torch.device("cpu"), requires_grad=False
        )
        tensor._meta = meta
        tensor.recipe = recipe
        return tensor  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LazyTensor({tuple(self.shape)}, {self.dtype}, {self.recipe.describe()})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if str(func) in _SCALAR_READS:
            real_args, real_kwargs = tree_map(_computed, (args, kwargs))
            return func(*real_args, **real_kwargs)
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        if "device" in meta_kwargs:
            meta_kwargs["device"] = torch.device("meta")
        result = func(*meta_args, **meta_kwargs)
        if isinstance(result, torch.Tensor):
            return LazyTensor(result, Recipe(str(func), args, kwargs, None, **_facts(result)))
        if isinstance(result, tuple | list):
            return type(result)(
                LazyTensor(r, Recipe(str(func), args, kwargs, i, **_facts(r))) if isinstance(r, torch.Tensor) else r
                for i, r in enumerate(result)
            )
        return result


@dataclass(frozen=True, eq=False)
class Recipe:
    """`op(*args, **kwargs)[index]`, or a leaf: the source tensor `leaf` (its other names in `aliases`)."""

    op: str | None
    args: tuple[Any, ...] = ()
    kwargs: Any = None
    index: int | None = None
    leaf: str | None = None
    aliases: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    def describe(self) -> str:
        if self.leaf is not None:
            return self.leaf
        inner = ", ".join(_describe(a) for a in self.args)
        return f"{self.op}({inner})" + (f"[{self.index}]" if self.index is not None else "")


def _describe(value: Any) -> str:
    if isinstance(value, LazyTensor):
        return value.recipe.describe()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


def _facts(meta: torch.Tensor) -> dict[str, Any]:
    return {"shape": tuple(meta.shape), "dtype": str(meta.dtype).removeprefix("torch.")}


def lazy_leaf(name: str, meta: torch.Tensor, aliases: tuple[str, ...] = ()) -> LazyTensor:
    meta = meta.detach().to("meta")
    return LazyTensor(meta, Recipe(None, leaf=name, aliases=aliases, **_facts(meta)))


def make_lazy(module: torch.nn.Module) -> list[str]:
    """Replace every parameter (and persistent buffer) of `module`, built on the meta device, by a lazy leaf named
    after it; a tied parameter is one leaf under its first name with the others as aliases. Returns the names."""
    seen: dict[int, LazyTensor] = {}
    names: dict[int, list[str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attribute, tensor in [*sub._parameters.items(), *_persistent_buffers(sub)]:
            if tensor is not None:
                names.setdefault(id(tensor), []).append(f"{prefix}.{attribute}" if prefix else attribute)
    for _, sub in module.named_modules(remove_duplicate=False):
        for attribute, tensor in [*sub._parameters.items(), *_persistent_buffers(sub)]:
            if tensor is None:
                continue
            key = id(tensor)
            if key not in seen:
                first, *others = names[key]
                seen[key] = lazy_leaf(first, tensor, tuple(others))
            sub._parameters.pop(attribute, None)
            sub._buffers.pop(attribute, None)
            object.__setattr__(sub, attribute, seen[key])
    return [t.recipe.leaf for t in seen.values() if t.recipe.leaf is not None]


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    skipped = module._non_persistent_buffers_set
    return [(name, buffer) for name, buffer in module._buffers.items() if name not in skipped]


def _to_meta(value: Any) -> Any:
    if isinstance(value, LazyTensor):
        return value._meta
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return value


_LOADER: list[Loader] = []


class loading:
    """Within it, a lazy tensor read as a scalar is computed with `loader`."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def __enter__(self) -> None:
        _LOADER.append(self._loader)

    def __exit__(self, *exc: object) -> None:
        _LOADER.pop()


def _computed(value: Any) -> Any:
    if not isinstance(value, LazyTensor):
        return value
    if not _LOADER:
        raise RuntimeError(f"a scalar of {value!r} was read with no source to compute it from")
    return evaluate(value.recipe, _LOADER[-1])


def evaluate(recipe: Recipe, load: Loader) -> torch.Tensor:
    """Compute `recipe`'s values, loading its leaves with `load` (each at most once)."""
    memo: dict[int, torch.Tensor] = {}

    def compute(node: Recipe) -> torch.Tensor:
        if id(node) in memo:
            return memo[id(node)]
        if node.leaf is not None:
            value = load(node.leaf)
        else:

            def real(v: Any) -> Any:
                return compute(v.recipe) if isinstance(v, LazyTensor) else v

            args, kwargs = tree_map(real, (node.args, node.kwargs or {}))
            value = _resolve(node.op)(*args, **kwargs)  # type: ignore[arg-type]
            if node.index is not None:
                value = value[node.index]
        memo[id(node)] = value
        return value

    with torch.inference_mode():
        return compute(recipe)


def _resolve(op: str) -> Any:
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def leaves(recipe: Recipe) -> Iterator[Recipe]:
    """The leaves `recipe` reads."""
    stack = [recipe]
    while stack:
        node = stack.pop()
        if node.leaf is not None:
            yield node
            continue
        for value in _flatten((node.args, node.kwargs or {})):
            if isinstance(value, LazyTensor):
                stack.append(value.recipe)


def _flatten(value: Any) -> Iterator[Any]:
    if isinstance(value, list | tuple):
        for v in value:
            yield from _flatten(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)
    else:
        yield value


# Serialization: recipes cross from the builder's process to the packager's as JSON.
def to_json(recipes: dict[str, Recipe]) -> dict[str, Any]:
    """`{"format", "nodes": [...], "tensors": {initializer: node id}}`; shared sub-recipes are written once."""
    ids: dict[int, int] = {}
    nodes: list[dict[str, Any]] = []

    def node_id(recipe: Recipe) -> int:
        if id(recipe) in ids:
            return ids[id(recipe)]
        if recipe.leaf is not None:
            entry: dict[str, Any] = {"leaf": recipe.leaf, "aliases": list(recipe.aliases)}
        else:
            entry = {"op": recipe.op, "args": encode(recipe.args), "kwargs": encode(recipe.kwargs or {})}
            if recipe.index is not None:
                entry["index"] = recipe.index
        entry |= {"shape": list(recipe.shape), "dtype": recipe.dtype}
        ids[id(recipe)] = len(nodes)
        nodes.append(entry)
        return ids[id(recipe)]

    def encode(value: Any) -> Any:
        if isinstance(value, LazyTensor):
            return {"recipe": node_id(value.recipe)}
        if isinstance(value, torch.Tensor):
            array = value.detach().cpu().contiguous()
            return {
                "tensor": str(array.dtype).removeprefix("torch."),
                "shape": list(array.shape),
                "data": base64.b64encode(array.view(torch.uint8).numpy().tobytes()).decode(),
            }
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, torch.memory_format | torch.layout):
            return {"torch": str(value).removeprefix("torch.")}
        if isinstance(value, float) and not np.isfinite(value):
            return {"float": repr(value)}
        if isinstance(value, list | tuple):
            return [encode(v) for v in value]
        if isinstance(value, dict):
            return {"dict": {k: encode(v) for k, v in value.items()}}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise TypeError(f"a recipe argument of type {type(value).__name__} cannot be written: {value!r}")

    tensors = {name: node_id(recipe) for name, recipe in recipes.items()}
    return {"format": RECIPE_FORMAT, "nodes": nodes, "tensors": tensors}


def from_json(data: dict[str, Any]) -> dict[str, Recipe]:
    if data.get("format") != RECIPE_FORMAT:
        raise ValueError(f"recipes of format {data.get('format')}, this onnxfn reads {RECIPE_FORMAT}")
    built: dict[int, Recipe] = {}
    nodes = data["nodes"]

    def node(index: int) -> Recipe:
        if index not in built:
            entry = nodes[index]
            facts = {"shape": tuple(entry["shape"]), "dtype": entry["dtype"]}
            if "leaf" in entry:
                built[index] = Recipe(None, leaf=entry["leaf"], aliases=tuple(entry["aliases"]), **facts)
            else:
                args, kwargs = decode(entry["args"]), decode(entry["kwargs"])
                built[index] = Recipe(entry["op"], tuple(args), kwargs, entry.get("index"), **facts)
        return built[index]

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "recipe" in value:
            recipe = node(value["recipe"])
            return LazyTensor(torch.empty(recipe.shape, dtype=getattr(torch, recipe.dtype), device="meta"), recipe)
        if "tensor" in value:
            raw = np.frombuffer(base64.b64decode(value["data"]), np.uint8).copy()
            dtype = getattr(torch, value["tensor"])
            return torch.from_numpy(raw).view(dtype).reshape(value["shape"])
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "device" in value:
            return torch.device(value["device"])
        if "torch" in value:
            return getattr(torch, value["torch"])
        if "float" in value:
            return float(value["float"])
        if "dict" in value:
            return {k: decode(v) for k, v in value["dict"].items()}
        raise ValueError(f"unknown recipe argument {value!r}")

    return {name: node(index) for name, index in data["tensors"].items()}
