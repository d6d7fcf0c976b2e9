"""An adapter source (a PEFT folder or a GGUF LoRA file) → onnxfn's adapter file, checked against the base.

Used by `pkg build` for `[[adapters]]` and by `pkg adapter add` for an adapter added to a running endpoint:
both read the source, check it against the base model (layer count, each module's shapes, the rank and modules
the bundle's graph takes) and write `runtime/adapters/files.py`'s format, which the runtime reads without torch.
"""

from __future__ import annotations

from pathlib import Path

from packager.adapters.gguf_lora import GGUF_MAGIC, read_gguf_lora
from packager.adapters.peft import is_peft_folder, read_peft_adapter
from packager.adapters.weights import LoraWeights
from packager.errors import UserError
from runtime.adapters.files import AdapterFile, misfit, unusable_values
from runtime.adapters.layout import AdapterLayout
from runtime.bundle import ModelFacts


def read_adapter_source(path: Path, facts: ModelFacts) -> LoraWeights:
    """The LoRA weights at `path`: a PEFT folder or a GGUF LoRA file (what the path holds decides)."""
    if is_peft_folder(path):
        weights = read_peft_adapter(path)
    elif path.is_file() and path.read_bytes()[:4] == GGUF_MAGIC:
        weights = read_gguf_lora(path, n_head=facts.num_heads, n_head_kv=facts.num_kv_heads)
    elif path.exists():
        raise UserError(
            f"{path} is neither a PEFT adapter folder (with adapter_config.json) nor a GGUF LoRA file; "
            "point at the folder `save_pretrained` wrote, or at llama.cpp's convert_lora_to_gguf.py output"
        )
    else:
        raise UserError(f"adapter source {path} does not exist; give a PEFT folder or a GGUF LoRA file")
    deepest = max(layer for layer, _ in weights.matrices)
    if deepest >= facts.num_layers:
        raise UserError(
            f"{path} adapts layer {deepest}, but the base model has {facts.num_layers} layers: "
            "the adapter was trained on another model"
        )
    return weights


def to_adapter_file(weights: LoraWeights, facts: ModelFacts) -> AdapterFile:
    tensors = {}
    for (layer, module), matrices in weights.matrices.items():
        tensors[f"layers.{layer}.{module}.a"] = matrices.a
        tensors[f"layers.{layer}.{module}.b"] = matrices.b
    base: dict[str, int | str] = {
        "architecture": facts.architecture,
        "hidden_size": facts.hidden_size,
        "num_layers": facts.num_layers,
    }
    adapter = AdapterFile(rank=weights.rank, scale=weights.scale, base=base, tensors=tensors)
    # Refused before anything is built on it, as every runtime refuses it (a NaN would poison its batch's rows).
    problem = unusable_values(adapter)
    if problem is not None:
        raise UserError(f"adapter {weights.source} cannot be served: {problem}; retrain or re-export it")
    return adapter


def check_fits(name: str, source: str, adapter: AdapterFile, layout: AdapterLayout) -> None:
    """`UserError` when the adapter cannot load into a graph with `layout` (shapes, rank, modules)."""
    problem = misfit(adapter, layout)
    if problem is not None:
        raise UserError(f"adapter {name!r} ({source}) does not fit the base model: {problem}")
