"""What a Mixture-of-Experts decode step reads: the active-parameter bytes behind the bandwidth limit.

At batch 1 a token reads every weight except the experts' and the embedding's in full, only the routed top-k of n
experts of each layer, and one row of the embedding table. Counted for the GGUF (its blocks, as llama.cpp reads
them) and for onnxfn's decode graph (its QMoE nodes' expert inputs, int8 where the file held MXFP4).
"""

from __future__ import annotations

from pathlib import Path

from packager.bench.footprint import initializer_bytes
from packager.export.graph import all_inputs
from packager.sources.gguf_metadata import read_metadata

EXPERT_MARK = "_exps."  # llama.cpp's stacked expert tensors: ffn_{gate,up,down}_exps and their biases
MOE_OPS = {"MoE", "QMoE"}
ROUTED_INPUTS = 2  # a (Q)MoE node's first two inputs are the hidden states and the router's logits


def active_bytes_per_token(gguf: Path, bundle: Path) -> dict[str, float]:
    """{"gguf": bytes, "bundle": bytes} one decode token reads at batch 1, and the routed share (top-k / n)."""
    metadata = read_metadata(gguf)
    routed = int(metadata.field("{arch}.expert_used_count")) / int(metadata.field("{arch}.expert_count"))
    sizes = {name: info.n_bytes for name, info in metadata.tensors.items()}
    experts = sum(size for name, size in sizes.items() if EXPERT_MARK in name)
    embedding_shape = metadata.tensors["token_embd.weight"].shape
    in_file = _active(sum(sizes.values()), experts, sizes["token_embd.weight"], embedding_shape[-1], routed)
    return {"gguf": in_file, "bundle": _bundle_active(bundle / "model.onnx", routed), "routed_share": routed}


def _active(total: int, experts: int, embedding: int, vocab: int, routed: float) -> float:
    return total - experts * (1 - routed) - embedding * (1 - 1 / vocab)


def _bundle_active(model_path: Path, routed: float) -> float:
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    # Only what some node reads: an embedding carried from a GGUF is two initializers over the same bytes (its
    # blocks as MatMulNBits holds them, and the `.rows` view GatherBlockQuantized reads), one of them unread when
    # the output matrix is not the embedding; counting both put the bundle's figure 100 MB (Q8_0) too high.
    read = {name for node in model.graph.node for name in all_inputs(node)}
    sizes = {name: size for name, size in initializer_bytes(model).items() if name in read}
    rows = {tensor.name: int(tensor.dims[0]) if tensor.dims else 1 for tensor in model.graph.initializer}
    experts = {
        name for node in model.graph.node if node.op_type in MOE_OPS for name in node.input[ROUTED_INPUTS:] if name
    }
    # The embedding: the table the first Gather over input_ids reads (GatherBlockQuantized for a quantized table).
    gathers = [n for n in model.graph.node if n.op_type.startswith("Gather") and "input_ids" in n.input]
    table = gathers[0].input[0] if gathers else ""
    expert_bytes = sum(sizes.get(name, 0) for name in experts)
    return _active(sum(sizes.values()), expert_bytes, sizes.get(table, 0), rows.get(table, 1), routed)
