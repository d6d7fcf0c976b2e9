"""Execution providers: fallback, TensorRT's engine / EP-context cache beside the bundle, the error off-GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.bundle import Bundle
from runtime.engine.providers import EP_CONTEXT_MODEL, ProviderUnavailableError, TensorRTCache, plan_providers
from runtime.engine.session_build import SessionOptions, create_session

GPU_BUILD = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_tensorrt_caches_its_engine_beside_the_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "build" / "bundle"
    plan = plan_providers(["tensorrt", "cuda", "cpu"], GPU_BUILD, bundle)
    assert plan.names == tuple(GPU_BUILD) and plan.primary == "TensorrtExecutionProvider"
    cache = plan.tensorrt_cache
    assert cache == TensorRTCache(tmp_path / "build" / ".bundle-tensorrt-cache")
    trt, cuda, cpu = plan.options
    assert trt == {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache.directory / "engines"),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache.directory / "timing"),
        "trt_dump_ep_context_model": "True",  # first start: compile and persist
        "trt_ep_context_file_path": str(cache.directory),
    }
    assert cuda == cpu == {}
    assert cache.model_to_load(bundle / "model.onnx") == bundle / "model.onnx"


def test_a_persisted_ep_context_model_is_loaded_instead(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    cache = TensorRTCache.beside(bundle)
    cache.directory.mkdir(parents=True)
    (cache.directory / EP_CONTEXT_MODEL).write_bytes(b"onnx")
    assert cache.model_to_load(bundle / "model.onnx") == cache.directory / EP_CONTEXT_MODEL
    assert cache.provider_options()["trt_dump_ep_context_model"] == "False"


def test_missing_accelerators_fall_back_to_a_listed_cpu(tmp_path: Path) -> None:
    plan = plan_providers(["tensorrt", "cuda", "cpu"], ["CPUExecutionProvider"], tmp_path)
    assert plan.names == ("CPUExecutionProvider",) and plan.tensorrt_cache is None


def test_tensorrt_alone_off_hardware_fails_precisely(tmp_path: Path) -> None:
    with pytest.raises(ProviderUnavailableError, match=r"\['tensorrt'\] were requested.*offers only") as err:
        plan_providers(["tensorrt"], ["CPUExecutionProvider"], tmp_path)
    assert "onnxruntime-gpu" in str(err.value) and "add 'cpu'" in str(err.value)
    with pytest.raises(ValueError, match="unknown execution provider"):
        plan_providers(["rocm"], GPU_BUILD, tmp_path)


def test_this_machine_cannot_create_a_tensorrt_session(bundle: Bundle) -> None:
    """The real ONNX Runtime here has no TensorRT: the session fails before touching the model."""
    with pytest.raises(ProviderUnavailableError, match="TensorrtExecutionProvider|offers only"):
        create_session(bundle.model_path, SessionOptions(providers=("tensorrt",)))
    assert not TensorRTCache.beside(bundle.path).directory.exists()
