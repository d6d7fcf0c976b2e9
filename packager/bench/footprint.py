"""What each system must read: artifact sizes, bytes per decode token, and the bandwidth limit they imply.

Decode at batch 1 reads every weight once per token plus the KV cache so far, so
`limit tok/s = read bandwidth / (weights bytes + KV bytes at the mean decode context)`. The weights
figure is the file size: an upper bound on what a step reads (an embedding table is gathered, not
streamed), so a system may beat its "limit" slightly when its file holds such tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packager.decoder_facts import decoder_facts
from packager.export.builder import ExportResult
from runtime.bundle import open_bundle
from runtime.engine.graphs import PREFILL_MODEL_FILE


@dataclass(frozen=True)
class Artifact:
    """The files one system loads, and the dtype of its KV cache."""

    label: str
    weights_bytes: int  # what its graph's initializers hold (a GGUF bundle's: with the scale tables it expands)
    total_bytes: int  # its files
    kv_bytes_per_token: int
    expanded_bytes: int = 0  # files it writes where it runs from its own (a GGUF bundle's scale tables)

    def bytes_per_token(self, context: float) -> float:
        return self.weights_bytes + self.kv_bytes_per_token * context


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def artifacts(bundle_dir: Path, gguf: Path, hf_dir: Path, exports: dict[str, ExportResult]) -> dict[str, Artifact]:
    """Per system: onnxfn, genai and ort-loop share the bundle; genai-int* run their own builder export (`exports`,
    by system); llama.cpp keeps an f16 KV; transformers runs fp32."""
    manifest = open_bundle(bundle_dir, verify=False).manifest
    facts = decoder_facts(manifest)
    kv_elements = 2 * facts.num_layers * facts.num_kv_heads * facts.head_dim
    bundle = bundle_artifact(bundle_dir)
    gguf_artifact = Artifact(f"GGUF {gguf.name}", gguf.stat().st_size, gguf.stat().st_size, kv_elements * 2)
    hf_weights = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    hf_artifact = Artifact("HF folder fp32", hf_weights, dir_bytes(hf_dir), kv_elements * 4)
    # Throughput mode decodes through prefill.onnx: its fp32 matmul weights and what it shares of model.onnx.data.
    prefill = bundle_dir / PREFILL_MODEL_FILE
    throughput = bundle
    if prefill.is_file():
        label = "bundle, prefill graph"
        throughput = Artifact(label, graph_weight_bytes(prefill), bundle.total_bytes, bundle.kv_bytes_per_token)
    return {
        "onnxfn": bundle,
        "onnxfn-http": bundle,
        "onnxfn-http-throughput": throughput,
        "genai": bundle,
        **{system: export_artifact(export) for system, export in exports.items()},
        "ort-loop": bundle,
        "llamacpp": gguf_artifact,
        "llamacpp-server": gguf_artifact,
        "transformers": hf_artifact,
    }


def bundle_artifact(bundle_dir: Path) -> Artifact:
    """A bundle as the engine loads it: its graph's weights (the scale tables a GGUF bundle expands included: they
    are what its kernels read), its files, its KV cache's element type."""
    manifest = open_bundle(bundle_dir, verify=False).manifest
    facts = decoder_facts(manifest)
    weights = graph_weight_bytes(bundle_dir / manifest.model_file)
    label = f"bundle ({facts.precision})"
    return Artifact(label, weights, dir_bytes(bundle_dir), facts.kv_bytes_per_token(), manifest.table_bytes)


def export_artifact(export: ExportResult) -> Artifact:
    """A builder export as genai loads it: the files the builder wrote (not the cache's bookkeeping), its graph's
    weights, and its KV cache's element type."""
    decoder = json.loads((export.directory / "genai_config.json").read_text())["model"]["decoder"]
    graph = export.directory / decoder["filename"]
    sizes = {name: int(entry["size"]) for name, entry in export.digests.items()}
    weights = sum(size for name, size in sizes.items() if name.startswith(graph.name))
    past_key = decoder["inputs"]["past_key_names"] % 0
    kv_elements = 2 * decoder["num_hidden_layers"] * decoder["num_key_value_heads"] * decoder["head_size"]
    label = f"genai export ({export.options.precision})"
    return Artifact(label, weights, sum(sizes.values()), kv_elements * input_itemsize(graph, past_key))


def input_itemsize(model_path: Path, name: str) -> int:
    """Bytes per element of a graph input (the graph only: its weights stay unread)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    (value,) = [i for i in model.graph.input if i.name == name]
    return onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).itemsize


def graph_weight_bytes(model_path: Path) -> int:
    """Bytes of every initializer an ONNX graph uses, in its own file or in external data files."""
    import onnx

    return sum(initializer_bytes(onnx.load(str(model_path), load_external_data=False)).values())


def initializer_bytes(model: Any) -> dict[str, int]:
    """Each initializer's bytes (an onnx ModelProto loaded without its external data)."""
    sizes = {}
    for tensor in model.graph.initializer:
        external = {entry.key: entry.value for entry in tensor.external_data}
        sizes[tensor.name] = int(external["length"]) if "length" in external else tensor.ByteSize()
    return sizes


def bandwidth_limits(
    found: dict[str, Artifact], bandwidth: float, context: float, decode: dict[str, Any]
) -> dict[str, dict[str, float]]:
    limits = {}
    for name, artifact in found.items():
        per_token = artifact.bytes_per_token(context)
        entry = {"bytes_per_token": per_token, "limit_tok_s": bandwidth / per_token}
        measured = decode.get(name, {}).get("tok_s")
        if measured is not None:
            entry["fraction"] = measured / entry["limit_tok_s"]
        limits[name] = entry
    return limits


def cold_floor(artifact: Artifact, bandwidth: float, interpreter_s: float) -> float:
    """The least a start can take: reading the files and what it expands from them once, and the interpreter."""
    return (artifact.total_bytes + artifact.expanded_bytes) / bandwidth + interpreter_s
