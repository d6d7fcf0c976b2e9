"""The systems under test, imported lazily so a cold start pays only for its own libraries."""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, class). The SERVERS are reached over HTTP; the others run inside the worker.
REGISTRY = {
    "onnxfn": ("packager.bench.systems.onnxfn", "OnnxfnSystem"),
    "onnxfn-http": ("packager.bench.systems.server", "ServerSystem"),
    # The same server with `--decode throughput`: the prefill graph decodes too (EngineConfig.decode).
    "onnxfn-http-throughput": ("packager.bench.systems.server", "ServerSystem"),
    "genai": ("packager.bench.systems.genai", "GenaiSystem"),
    # genai on the builder's int8 / int4 export of the function's source (models.GENAI_EXPORTS), not the bundle.
    "genai-int8": ("packager.bench.systems.genai", "GenaiSystem"),
    "genai-int4": ("packager.bench.systems.genai", "GenaiSystem"),
    # No engine at all: a bare ONNX Runtime loop over the same graph, the ceiling of a Python-driven engine.
    "ort-loop": ("packager.bench.systems.ortloop", "OrtLoopSystem"),
    "llamacpp": ("packager.bench.systems.llamacpp", "LlamaCppSystem"),
    "llamacpp-server": ("packager.bench.systems.server", "ServerSystem"),
    "transformers": ("packager.bench.systems.hf", "TransformersSystem"),
}
SERVERS = ("onnxfn-http", "onnxfn-http-throughput", "llamacpp-server")
# The `local` target's server resumed from a CRIU process snapshot: a cold-start row only.
PROCESS_SNAPSHOT = "onnxfn-http-process-snapshot"
# onnxfn run another way than the baseline: measured beside it, not compared with it.
VARIANTS = {
    "onnxfn-http-throughput": "onnxfn, decode = throughput",
    PROCESS_SNAPSHOT: "onnxfn, resumed from a process snapshot",
}


def import_system(name: str) -> type[Any]:
    module_name, class_name = REGISTRY[name]
    return getattr(importlib.import_module(module_name), class_name)
