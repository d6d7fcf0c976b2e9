"""Where a bundle's decoder graph takes LoRA adapters: which projections, at what rank, under which input names.

The packager adds to each adapted projection `y = x @ W` of the graph (packager/export/lora.py)

    y + Where(mask, x @ A, 0) @ B

with `A` `[in, slots * C]` and `B` `[slots * C, out]` graph inputs (slot j, counted from 1, owns columns
`(j - 1) * C .. j * C` of A and those rows of B; C = rank times the modules the projection computes) and `index`
`[batch]` each row's adapter: 0 for the base model, j for slot j. The mask keeps, in each row, the columns of its
own slot, and writes exact zeros in the others whatever they held (a NaN times 0 would be NaN); the slots hold only
finite values (files.py refuses others), so the second matmul adds exact zeros for them. This is S-LoRA /
punica's design in plain ONNX ops (MatMul, Where), which every execution provider runs: two matmuls over the
step's rows read each bound adapter's weights once, where gathering each row's weights copied them once per row
(measured here: the gather took 15 % of an 8-row step over 4 adapters). The runtime binds only the slots the
step's rows use, none for base rows alone, so a batch pays for the adapters in it. A slot's columns sit at the
same place whatever else is bound and the second matmul adds exact zeros for every other column, so a row's
output depends neither on its batch nor on its neighbours' adapters, and a base row adds exact zeros. A
projection that computes several modules at once (the builder's fused `qkv_proj`) gives each targeted module
`rank` columns of its own, its rows of `B` reaching only that module's outputs, so one adapter's q, k and v never
mix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

INDEX_INPUT = "adapter_index"
# An adapter's name, as clients send it after the function's (`model: "FUNCTION:NAME"`) and as its file is named.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_RULE = "1-64 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class ModuleRange:
    """A module a projection computes: its output columns `start:stop` of the projection's."""

    module: str  # the Hugging Face name adapters target, e.g. `k_proj`
    start: int
    stop: int


@dataclass(frozen=True)
class Projection:
    """One adapted matmul of every layer, e.g. the fused `qkv_proj`."""

    name: str
    in_features: int
    out_features: int
    modules: tuple[ModuleRange, ...]  # the targeted modules it computes, in column order


@dataclass(frozen=True)
class AdapterLayout:
    rank: int  # the most an adapter may have; smaller ranks are zero-padded (exact)
    num_layers: int
    projections: tuple[Projection, ...]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(m.module for p in self.projections for m in p.modules)

    def columns(self, projection: Projection) -> int:
        return self.rank * len(projection.modules)

    @staticmethod
    def input_names(layer: int, projection: str) -> tuple[str, str]:
        return f"adapters.{layer}.{projection}.A", f"adapters.{layer}.{projection}.B"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "num_layers": self.num_layers,
            "projections": [
                {
                    "name": p.name,
                    "in_features": p.in_features,
                    "out_features": p.out_features,
                    "modules": [[m.module, m.start, m.stop] for m in p.modules],
                }
                for p in self.projections
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AdapterLayout:
        projections = tuple(
            Projection(
                name=p["name"],
                in_features=int(p["in_features"]),
                out_features=int(p["out_features"]),
                modules=tuple(ModuleRange(str(m), int(a), int(b)) for m, a, b in p["modules"]),
            )
            for p in data["projections"]
        )
        return cls(rank=int(data["rank"]), num_layers=int(data["num_layers"]), projections=projections)
