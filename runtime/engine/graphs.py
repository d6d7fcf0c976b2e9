"""Which of a bundle's graphs the engine loads, and from where.

A bundle may carry graphs for prompts (see packager/export/prefill.py), each the same model with logits
for each row's last position only: `prefill.onnx` with fp32 matmuls, and, for a quantized model,
`prefill-quantized.onnx` with the model's own matmuls. Prompts run through one of those: the quantized one on
a CPU with int8 dot products (where its matmuls are the faster ones, and it needs no fp32 copy of the weights
in memory), the fp32 one elsewhere (`EngineConfig.prefill_matmuls`). The quantized one then decodes too, as
the engine's only graph (`decodes_with_prefill_graph`); with the fp32 one, the bundle's model decodes, except
in `throughput` mode (`EngineConfig.decode`), where the fp32 prefill graph is the engine's only graph.
A quantized bundle's fp32 prefill graph comes with a recipe for its weights instead of the weights
(derived.py): it loads from the directory they are derived into. `auto` derives them only up to
`FP32_PREFILL_MAX_BYTES`: beyond, the quantized prefill graph runs prompts on every CPU. Any graph may load from a
prepacked copy (prepacked.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from runtime.bundle import Bundle, ModelFacts
from runtime.engine.config import EngineConfig
from runtime.engine.derived import DerivedGraphs, default_directory, recipe_name
from runtime.engine.prepacked import PrepackedGraphs

PREFILL_MODEL_FILE = "prefill.onnx"  # fp32 matmuls
QUANTIZED_PREFILL_FILE = "prefill-quantized.onnx"  # the model's own (MatMulNBits) matmuls
# x86 CPU flags (as Linux names them) of the int8 dot products ONNX Runtime's int8 matmuls use. ARM's
# (asimddp, i8mm) are left out until measured: such a CPU keeps the fp32 prefill graph.
INT8_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
# Metadata of a prefill graph whose logits are each row's last prompt position (packager/export/prefill.py,
# graph version 2 on): right-padded first chunks of several prompts may then share one run.
ROW_LAST_POSITIONS = ("onnxfn.prefill_logits", "last position of each row")
# The largest fp32 copy of a quantized bundle's weights `auto` derives for the fp32 prefill graph. The copy is ~4x
# the bundle and all of it is resident once prompts run: Llama-3.2-1B's shape (Q4_1, 0.83 GiB of weights) derives
# 3.73 GiB in 37 s, and an engine prefilling through it held 5.2 GiB instead of 1.7 GiB (Llama-3.1-8B's shape: ~30 GiB,
# more than the machine). What it buys is prefill speed on CPUs without int8 dot products (fp32 matmuls 2.6x faster
# than int8 ones on AVX2); on those with them the quantized graph is faster anyway. The demo's copy (0.5 GiB) fits.
FP32_PREFILL_MAX_BYTES = 1 << 30


def decoder_facts(bundle: Bundle) -> ModelFacts:
    """The facts of the bundle's decoder; a bundle without one (embedding, classification) has no graph here."""
    return bundle.manifest.decoder


def bundle_graphs(bundle: Bundle, config: EngineConfig | None = None) -> list[Path]:
    """The decoder graphs an engine with `config` (default: the defaults) loads from `bundle`, derived ones from
    where they are derived (writing them first if they are not there yet)."""
    config = config or EngineConfig()
    prefill = prefill_graph_file(bundle, config)
    decode = [] if decodes_with_prefill_graph(bundle, config) else [bundle.model_path]
    return [*decode, *([graph_source(bundle, prefill, config)] if prefill is not None else [])]


def prefill_graph_usable(bundle: Bundle, config: EngineConfig) -> bool:
    """The bundle carries a prefill graph and the engine may run it (on the CPU: it is built for it)."""
    return config.prefill_graph and config.providers[:1] == ("cpu",) and PREFILL_MODEL_FILE in bundle.manifest.files


def prefill_graph_file(bundle: Bundle, config: EngineConfig) -> str | None:
    """The file of the prefill graph prompts run through, None without a usable one (see the module docstring)."""
    if not prefill_graph_usable(bundle, config):
        return None
    if config.decode == "throughput" or QUANTIZED_PREFILL_FILE not in bundle.manifest.files:
        return PREFILL_MODEL_FILE
    quantized = config.prefill_matmuls == "quantized" or (
        config.prefill_matmuls == "auto"
        and (
            bool(cpu_flags() & INT8_DOT_PRODUCT_FLAGS)
            or derived_bytes(bundle, PREFILL_MODEL_FILE) > FP32_PREFILL_MAX_BYTES
        )
    )
    return QUANTIZED_PREFILL_FILE if quantized else PREFILL_MODEL_FILE


def derived_bytes(bundle: Bundle, name: str) -> int:
    """The size of the weights file graph `name` has derived where it runs (0: its weights ship in the bundle)."""
    if recipe_name(name) not in bundle.manifest.files:
        return 0
    return int(json.loads(bundle.file(recipe_name(name)).read_text())["size"])


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags Linux reports for the first CPU (empty where /proc/cpuinfo is unreadable)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def decodes_with_prefill_graph(bundle: Bundle, config: EngineConfig) -> bool:
    """The prefill graph is the engine's one session: in `throughput` mode, and whenever prompts run through the
    quantized prefill graph. Its matmuls are model.onnx's own and a decode step's one position per row is what
    it gathers, so it decodes the same tokens, and one session holds one copy of the packed weights instead of
    two (the demo: 147 MB less resident memory). Speculative decoding keeps model.onnx: verifying a draft needs
    the logits of every position."""
    prefill = prefill_graph_file(bundle, config)
    if config.decode == "throughput":
        return prefill is not None
    return prefill == QUANTIZED_PREFILL_FILE and not config.speculative


def decode_graph_path(bundle: Bundle, config: EngineConfig) -> Path:
    """The graph decoding runs through: the prefill graph when it is the engine's only one, else the bundle's."""
    if decodes_with_prefill_graph(bundle, config):
        return prefill_graph_path(bundle, config)
    return _loaded_from(bundle, bundle.model_path, config)


def prefill_graph_path(bundle: Bundle, config: EngineConfig) -> Path:
    """Where the prefill graph the engine runs loads from (needs `prefill_graph_usable`)."""
    prefill = prefill_graph_file(bundle, config)
    if prefill is None:
        raise ValueError("the engine runs no prefill graph of this bundle")
    return _loaded_from(bundle, graph_source(bundle, prefill, config), config)


def graph_source(bundle: Bundle, name: str, config: EngineConfig) -> Path:
    """The bundle's graph `name`, or its derived copy (written now if need be) when the bundle carries a recipe for its
    weights instead of them."""
    if recipe_name(name) not in bundle.manifest.files:
        return bundle.path / name
    return DerivedGraphs(config.derived or default_directory(bundle)).graph(bundle, name)


def _loaded_from(bundle: Bundle, graph: Path, config: EngineConfig) -> Path:
    """Where to load the bundle's `graph` from: its prepacked copy when one is configured and valid here."""
    if config.prepacked is None or config.providers[:1] != ("cpu",):
        return graph
    return PrepackedGraphs(config.prepacked).graph_for(bundle, graph)
