"""`pkg build` for `[[adapters]]`: read and check each adapter, plan the graph's adapter inputs, measure each one.

Each adapter gets the two figures the base gets (packager/verify/), on graphs that take adapters:
- parity: the fp32 graph with the adapter in slot 1 against PyTorch with it merged, `W + scale * (a @ b)^T` on
  each adapted weight as it is read (PEFT's `merge_and_unload` computes the same sum; tests check our reading of
  PEFT folders against it): the same top-1 at every answer position;
- quality: the chosen precision with the adapter against the fp32 graph with it, under the function's budget.
Both run a few layers at a time, like the base's. The base stays quantized; the adapter computes in fp32 beside it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from packager.adapters.convert import check_fits, read_adapter_source, to_adapter_file
from packager.adapters.weights import LoraWeights
from packager.cache import cached_dir, cached_json, digest_of
from packager.errors import UserError
from packager.export.builder import ExportOptions, ExportResult, StructureResult, precision_rewrite
from packager.export.lora import LORA_GRAPH_VERSION, add_adapter_inputs, plan_layout
from packager.export.materialize import Structure
from packager.progress import StepProgress
from packager.sources import SourceModel
from packager.spec import FunctionSpec
from packager.verify import CandidateQuality, ExportSystem, QualityBudget, ReferenceParity, StructureSystem, Verifier
from runtime.adapters.files import AdapterFile, pack
from runtime.adapters.layout import INDEX_INPUT, AdapterLayout
from runtime.bundle import ModelFacts

ADAPTER_VERIFY_VERSION = 3  # bump when the figures below change meaning
DEFAULT_RANK = 16  # the rank a graph takes when the function declares modules but no adapter
ADAPTER_DIR = "adapters"  # in the bundle


@dataclass(frozen=True)
class DeclaredAdapter:
    name: str
    source: Path
    weights: LoraWeights
    file: AdapterFile
    digest: str  # of the source's converted tensors: what cached figures are keyed by


@dataclass(frozen=True)
class AdapterQuality:
    name: str
    rank: int
    modules: list[str]
    bytes: int
    parity: ReferenceParity
    quality: CandidateQuality


def read_declared(spec: FunctionSpec, facts: ModelFacts, progress: StepProgress) -> list[DeclaredAdapter]:
    declared = []
    for entry in spec.adapters:
        source = (spec.directory / entry.source).resolve()
        with progress.step(f"adapter {entry.name}", f"read adapter {entry.name} ({entry.source})"):
            weights = read_adapter_source(source, facts)
            adapter = to_adapter_file(weights, facts)
        tensors = hashlib.sha256()
        for key in sorted(adapter.tensors):
            tensors.update(key.encode() + str(adapter.tensors[key].dtype).encode() + adapter.tensors[key].tobytes())
        digest = digest_of("adapter", tensors.hexdigest(), adapter.rank, adapter.scale)
        declared.append(DeclaredAdapter(entry.name, source, weights, adapter, digest))
    return declared


def graph_plan(spec: FunctionSpec, declared: list[DeclaredAdapter]) -> tuple[tuple[str, ...], int] | None:
    """The modules and rank the graph takes adapters on; None: the function has no adapters."""
    modules = tuple(spec.export.adapter_modules) or tuple(dict.fromkeys(m for a in declared for m in a.weights.modules))
    if not modules:
        return None
    largest = max((a.weights.rank for a in declared), default=0)
    rank = spec.export.adapter_rank or largest or DEFAULT_RANK
    if rank < largest:
        raise UserError(f"export.adapter_rank = {rank} is below the rank of a declared adapter ({largest})")
    return modules, rank


def layout_for(model_path: Path, facts: ModelFacts, modules: tuple[str, ...], rank: int) -> AdapterLayout:
    model = onnx.load(str(model_path), load_external_data=False)
    return plan_layout(model, facts, modules, rank)


def adapt_graph(model_path: Path, layout: AdapterLayout) -> None:
    """Rewrite `model_path` in place to take adapters (its weights file is untouched)."""
    model = onnx.load(str(model_path), load_external_data=False)
    add_adapter_inputs(model, layout)
    onnx.save(model, str(model_path))


def check_declared(declared: list[DeclaredAdapter], layout: AdapterLayout) -> None:
    for adapter in declared:
        check_fits(adapter.name, str(adapter.source), adapter.file, layout)


def adapter_feeds(adapter: AdapterFile, layout: AdapterLayout) -> dict[str, np.ndarray]:
    """The graph inputs running one row with `adapter`, the one slot bound (index 1)."""
    feeds: dict[str, np.ndarray] = {INDEX_INPUT: np.ones(1, np.int64)}
    for a_name, (a, b) in pack(adapter, layout).items():
        feeds[a_name] = a
        feeds[a_name[: -len(".A")] + ".B"] = b
    return feeds


def verify_adapters(
    declared: list[DeclaredAdapter],
    source: SourceModel,
    structure: StructureResult,
    chosen: ExportResult,
    layout: AdapterLayout,
    budget: QualityBudget,
    max_positions: int,
    progress: StepProgress,
) -> list[AdapterQuality]:
    if not declared:
        return []
    adapted = onnx.ModelProto()
    adapted.CopyFrom(structure.structure.model)
    add_adapter_inputs(adapted, layout)
    chosen_dir = adapted_export(chosen, layout)
    results = []
    for adapter in declared:
        key = digest_of(
            "adapter-quality", ADAPTER_VERIFY_VERSION, LORA_GRAPH_VERSION, adapter.digest, structure.key, chosen.key,
            layout.to_json(), asdict(budget), max_positions,
        )  # fmt: skip
        with progress.step(f"verify {adapter.name}", f"verify adapter {adapter.name} against PyTorch + it") as step:

            def measure(adapter: DeclaredAdapter = adapter) -> dict[str, Any]:
                feeds = adapter_feeds(adapter.file, layout)
                reference = Structure(structure.directory, adapted)
                rewrite = precision_rewrite(reference, source, ExportOptions("fp32"), max_positions)
                system = StructureSystem(reference, rewrite, "fp32")
                verifier = Verifier(structure, source, max_positions, extra=feeds, graph=system)
                parity = verifier.parity(adapt=_merger(adapter), progress=step.update)
                candidate = ExportSystem(chosen_dir, chosen.options.precision)
                quality = verifier.evaluate(candidate, chosen.options.precision, budget, step.update)
                return {"parity": asdict(parity), "quality": asdict(quality)}

            data, reused = cached_json("adapter-quality", key, measure)
            if reused:
                step.cached()
        parity = ReferenceParity(**data["parity"])
        quality = CandidateQuality(**{**data["quality"], "failures": tuple(data["quality"]["failures"])})
        results.append(
            AdapterQuality(
                adapter.name, adapter.weights.rank, list(adapter.weights.modules), adapter.file.nbytes, parity, quality
            )
        )
    _check(results)
    return results


def quality_json(results: list[AdapterQuality]) -> dict[str, Any]:
    return {r.name: asdict(r) for r in results}


def adapted_export(export: ExportResult, layout: AdapterLayout) -> Path:
    """A copy of `export` whose graph takes adapters (its weights file linked, not copied), cached."""
    key = digest_of("adapted-export", LORA_GRAPH_VERSION, export.key, layout.to_json())

    def produce(out: Path) -> None:
        for path in export.directory.iterdir():
            if path.is_file() and path.name != "model.onnx":
                _link(path, out / path.name)
        shutil.copyfile(export.directory / "model.onnx", out / "model.onnx")
        adapt_graph(out / "model.onnx", layout)

    directory, _ = cached_dir("adapted-export", key, produce)
    return directory


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copyfile(source, target)


def _merger(adapter: DeclaredAdapter) -> Any:
    """PyTorch's weight with the adapter merged, as each is read: `W + scale * (a @ b)^T` on the adapted ones."""
    deltas = {}
    for (layer, module), m in adapter.weights.matrices.items():
        deltas[(layer, module)] = adapter.weights.scale * (m.a.astype(np.float32) @ m.b.astype(np.float32)).T

    def merge(name: str, tensor: Any) -> Any:
        import torch

        parts = name.split(".")
        if parts[-1] != "weight" or "layers" not in parts:
            return tensor
        layer = int(parts[parts.index("layers") + 1])
        delta = deltas.get((layer, parts[-2]))
        return tensor if delta is None else tensor + torch.from_numpy(np.ascontiguousarray(delta))

    return merge


def _check(results: list[AdapterQuality]) -> None:
    for r in results:
        if r.parity.identical_greedy != r.parity.prompts:
            raise UserError(
                f"adapter {r.name}: the fp32 ONNX graph with it disagrees with PyTorch + the merged adapter on "
                f"{r.parity.prompts - r.parity.identical_greedy} of {r.parity.prompts} prompts "
                f"(first divergences: {r.parity.first_divergence}); the adapter's conversion is wrong, not lossy"
            )
        if r.quality.failures:
            raise UserError(
                f"adapter {r.name} on the {r.quality.precision} base is outside the quality budget: "
                f"{'; '.join(r.quality.failures)}; loosen [export.quality] or choose a less compressed precision"
            )


def bundled_files(declared: list[DeclaredAdapter]) -> dict[str, str]:
    return {a.name: f"{ADAPTER_DIR}/{a.name}.safetensors" for a in declared}


def manifest_entry(layout: AdapterLayout, declared: list[DeclaredAdapter]) -> dict[str, Any]:
    return {"layout": layout.to_json(), "bundled": bundled_files(declared)}
