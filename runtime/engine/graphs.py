"""Which of a bundle's graphs the engine loads, and from where.

A bundle may carry a second graph for prompts, `prefill.onnx` (see packager/export/prefill.py): the
same model with fp32 matmuls and logits for each row's last position only. The engine decodes through
the bundle's model and prefills through that graph; in `throughput` mode (`EngineConfig.decode`) the
prefill graph is its only graph and decodes too. Either may load from a prepacked copy (prepacked.py).
"""

from __future__ import annotations

from pathlib import Path

from runtime.bundle import Bundle
from runtime.engine.config import EngineConfig
from runtime.engine.prepacked import PrepackedGraphs

PREFILL_MODEL_FILE = "prefill.onnx"
# Metadata of a prefill graph whose logits are each row's last prompt position (packager/export/prefill.py,
# graph version 2 on): right-padded first chunks of several prompts may then share one run.
ROW_LAST_POSITIONS = ("onnxfn.prefill_logits", "last position of each row")


def bundle_graphs(bundle: Bundle) -> list[Path]:
    """The decoder graphs of `bundle`: its model and, when it has one, its prefill graph."""
    prefill = [bundle.path / PREFILL_MODEL_FILE] if PREFILL_MODEL_FILE in bundle.manifest.files else []
    return [bundle.model_path, *prefill]


def prefill_graph_usable(bundle: Bundle, config: EngineConfig) -> bool:
    """The bundle carries a prefill graph and the engine may run it (on the CPU: it is built for it)."""
    return config.prefill_graph and config.providers[:1] == ("cpu",) and PREFILL_MODEL_FILE in bundle.manifest.files


def decodes_with_prefill_graph(bundle: Bundle, config: EngineConfig) -> bool:
    """`throughput` mode with a usable prefill graph: that graph is the engine's one session."""
    return config.decode == "throughput" and prefill_graph_usable(bundle, config)


def decode_graph_path(bundle: Bundle, config: EngineConfig) -> Path:
    """The graph decoding runs through: the prefill graph in `throughput` mode (when usable), else the bundle's."""
    if decodes_with_prefill_graph(bundle, config):
        return prefill_graph_path(bundle, config)
    return _loaded_from(bundle, bundle.model_path, config)


def prefill_graph_path(bundle: Bundle, config: EngineConfig) -> Path:
    """Where the bundle's prefill graph loads from."""
    return _loaded_from(bundle, bundle.path / PREFILL_MODEL_FILE, config)


def _loaded_from(bundle: Bundle, graph: Path, config: EngineConfig) -> Path:
    """Where to load the bundle's `graph` from: its prepacked copy when one is configured and valid here."""
    if config.prepacked is None or config.providers[:1] != ("cpu",):
        return graph
    return PrepackedGraphs(config.prepacked).graph_for(bundle, graph)
