"""Execution providers: the spec's short names mapped to ONNX Runtime's, with the options each one needs.

TensorRT compiles an engine for the model and the GPU on its first session (minutes on a Jetson). Its
engine and timing caches, and the EP-context model that points ONNX Runtime at the compiled engine, are
kept in a cache directory beside the bundle (never inside it: the bundle's manifest lists every file it
holds), so the build happens once per device and every later start loads the engine instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
EP_CONTEXT_MODEL = "model_ctx.onnx"


def short_name(ort_name: str) -> str:
    """`CPUExecutionProvider` → `cpu`; a provider without a short name keeps ORT's."""
    return next((short for short, full in PROVIDER_NAMES.items() if full == ort_name), ort_name)


class ProviderUnavailableError(RuntimeError):
    """None of the requested execution providers exists in this onnxruntime build."""


@dataclass(frozen=True)
class TensorRTCache:
    """Where TensorRT keeps what it compiled for one bundle on one device."""

    directory: Path

    @classmethod
    def beside(cls, bundle_dir: Path) -> TensorRTCache:
        return cls(bundle_dir.parent / f".{bundle_dir.name}-tensorrt-cache")

    @property
    def context_model(self) -> Path:
        return self.directory / EP_CONTEXT_MODEL

    def provider_options(self) -> dict[str, str]:
        # The EP-context model is written on the first start only; later starts load it (see `model_to_load`).
        dump_context = not self.context_model.is_file()
        return {
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(self.directory / "engines"),
            "trt_timing_cache_enable": "True",
            "trt_timing_cache_path": str(self.directory / "timing"),
            "trt_dump_ep_context_model": "True" if dump_context else "False",
            "trt_ep_context_file_path": str(self.directory),
        }

    def model_to_load(self, bundle_model: Path) -> Path:
        """The EP-context model once a first start has compiled the engine; the bundle's model before that."""
        return self.context_model if self.context_model.is_file() else bundle_model


@dataclass(frozen=True)
class ProviderPlan:
    """The providers a session is created with, in priority order, and the options of each."""

    names: tuple[str, ...]  # ONNX Runtime's names
    options: tuple[dict[str, str], ...]
    tensorrt_cache: TensorRTCache | None = None

    @property
    def primary(self) -> str:
        return self.names[0]


def plan_providers(requested: Sequence[str], available: Sequence[str], bundle_dir: Path) -> ProviderPlan:
    """Keep the requested providers this build offers, in the requested order.

    A provider that is missing is skipped when a later one in the list can take over (the spec lists
    `cpu` last as the fallback); when none is left the error names what was asked and what exists.
    """
    unknown = [n for n in requested if n not in PROVIDER_NAMES]
    if unknown or not requested:
        raise ValueError(f"unknown execution provider(s) {list(unknown)}; allowed: {sorted(PROVIDER_NAMES)}")
    offered = set(available)
    chosen = [n for n in requested if PROVIDER_NAMES[n] in offered]
    if not chosen:
        raise ProviderUnavailableError(
            f"execution providers {list(requested)} were requested, but this onnxruntime build offers only "
            f"{sorted(offered)}: install onnxruntime-gpu (with TensorRT for 'tensorrt') on a machine with an "
            "NVIDIA GPU, or add 'cpu' to [runtime].providers to allow running on the CPU"
        )
    cache = TensorRTCache.beside(bundle_dir) if "tensorrt" in chosen else None
    options = tuple(cache.provider_options() if n == "tensorrt" and cache else {} for n in chosen)
    return ProviderPlan(tuple(PROVIDER_NAMES[n] for n in chosen), options, cache)
