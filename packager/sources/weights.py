"""A model's weights as a source to read one tensor at a time, by its Hugging Face name.

- `SafetensorsWeights`: a Hugging Face folder's `*.safetensors`, memory-mapped; a tensor is read when asked.
  A Mixture-of-Experts checkpoint saved expert by expert (`mlp.experts.E.gate_proj.weight`: Qwen3-MoE as
  published, and as transformers 5 saves it) gives its model's stacked `mlp.experts.gate_up_proj` /
  `down_proj` stacked from those, as transformers' own checkpoint conversion does (`_stacked_experts`).
- `GgufWeights`: a GGUF file, memory-mapped; each Hugging Face name maps to a GGUF tensor through gguf's
  `TensorNameMap` (as transformers' GGUF loader maps them), read by dequantizing that tensor alone and undoing
  what llama.cpp's converter did to it (transformers' per-architecture `TensorProcessor`: the llama q/k row
  permutation, Gemma's `+ 1` on norms). Its `rows` says which GGUF rows a weight's rows are, so precision
  `gguf` can carry the blocks without computing anything. Mixture-of-Experts tensors that transformers does not
  map (gpt-oss's) are described as GGUF expert rows by sources/gguf_experts.py (`experts`).

Neither holds more than the tensor asked for: a build's memory is bounded by its largest tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from packager.errors import UserError
from packager.mapped import release
from packager.sources.gguf_dense import DENSE_GGUF, dense_processor
from packager.sources.gguf_experts import ExpertTensor, expert_tensors
from packager.sources.gguf_metadata import mapped_tensors, read_metadata


class WeightSource(Protocol):
    def load(self, name: str) -> Any:
        """The tensor `name` as a float32 torch tensor."""
        ...

    def has(self, name: str) -> bool: ...

    def describe(self) -> dict[str, str]:
        """What `open_weights` needs to open this source again (in another process)."""
        ...


def open_weights(description: dict[str, str]) -> WeightSource:
    if description["kind"] == "safetensors":
        return SafetensorsWeights(Path(description["folder"]))
    if description["kind"] == "gguf":
        return GgufWeights(Path(description["file"]), Path(description["config_dir"]))
    raise ValueError(f"unknown weight source {description!r}")


def load_any(source: WeightSource, names: Iterable[str]) -> Any:
    """The first of `names` (a tied weight's names) that `source` holds."""
    names = list(names)
    for name in names:
        if source.has(name):
            return source.load(name)
    raise UserError(f"the model's weights hold none of {', '.join(names)}: is the source complete?")


_STACKED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")


class SafetensorsWeights:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @cached_property
    def _files(self) -> dict[str, Path]:
        from safetensors import safe_open

        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.folder / file for name, file in weight_map.items()}
        files: dict[str, Path] = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                files.update(dict.fromkeys(f.keys(), path))
        return files

    def has(self, name: str) -> bool:
        return name in self._files or self._stacked_experts(name) is not None

    def load(self, name: str) -> Any:
        import torch

        if name not in self._files and (experts := self._stacked_experts(name)) is not None:
            # [experts, rows, K]: each expert's parts joined along the rows (gate rows, then up rows)
            return torch.stack([torch.cat([self._read(part) for part in parts]) for parts in experts])
        return self._read(name)

    def _read(self, name: str) -> Any:
        import torch
        from safetensors import safe_open

        with safe_open(str(self._files[name]), "pt") as f:
            tensor = f.get_tensor(name)
        return tensor.to(torch.float32) if tensor.is_floating_point() else tensor

    def _stacked_experts(self, name: str) -> list[list[str]] | None:
        """For a stacked expert tensor the checkpoint holds expert by expert: each expert's part names."""
        match = _STACKED_EXPERTS.fullmatch(name)
        if match is None:
            return None
        prefix, stacked = match.groups()
        projections = ("gate_proj", "up_proj") if stacked == "gate_up_proj" else ("down_proj",)
        experts: list[list[str]] = []
        while all(f"{prefix}.{len(experts)}.{p}.weight" in self._files for p in projections):
            experts.append([f"{prefix}.{len(experts)}.{p}.weight" for p in projections])
        return experts or None

    def describe(self) -> dict[str, str]:
        return {"kind": "safetensors", "folder": str(self.folder)}


_DEQUANTIZE_CHUNK = 16 << 20  # float32 bytes of rows dequantized at once


def _dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """`gguf.quants.dequantize`, a few rows at a time into the one float32 output.

    Whole, the gguf package's K-quant decoders hold several float32 temporaries of the tensor's size: dequantizing
    the 8B shape's 805 MB embedding peaked near three times that, the build's largest step (the PyTorch reference).
    """
    from gguf.quants import dequantize, quant_shape_from_byte_shape

    if data.ndim < 2 or data.dtype != np.uint8:  # F32/F16 views, and 1-D norms: nothing to chunk
        return dequantize(data, qtype)
    shape = quant_shape_from_byte_shape(data.shape, qtype)
    rows = data.reshape(-1, data.shape[-1])
    out = np.empty((rows.shape[0], shape[-1]), np.float32)
    step = max(1, _DEQUANTIZE_CHUNK // (4 * shape[-1]))
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = dequantize(rows[start : start + step], qtype)
    return out.reshape(shape)


@dataclass(frozen=True)
class GgufRows:
    """A weight's rows as rows of one GGUF tensor: `rows[i]` is the GGUF row of the weight's row i."""

    tensor: str
    rows: np.ndarray


class GgufWeights:
    """`file`'s tensors under the Hugging Face names of the model whose config.json is in `config_dir`."""

    def __init__(self, file: Path, config_dir: Path) -> None:
        self.file = file
        self.config_dir = config_dir

    @cached_property
    def _mapped(self) -> tuple[np.memmap, dict[str, Any]]:
        return mapped_tensors(self.file)  # not GGUFReader: it parses the vocabulary (gguf_metadata.py)

    @cached_property
    def _tensors(self) -> dict[str, Any]:
        return self._mapped[1]

    @cached_property
    def _architecture(self) -> str:
        return read_metadata(self.file).architecture

    @cached_property
    def _processor(self) -> Any:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        architecture = self._architecture
        config = json.loads((self.config_dir / "config.json").read_text())
        ours = dense_processor(architecture, config)  # architectures transformers reads no GGUF of (gguf_dense.py)
        return ours if ours is not None else TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)

    @cached_property
    def _gguf_names(self) -> dict[str, str]:
        """Hugging Face name -> GGUF tensor name, as transformers maps them (on a weightless model)."""
        mapping, _ = self._weightless_mapping
        return {hf: gguf for gguf, hf in mapping.items() if gguf in self._tensors}

    @cached_property
    def _weightless_mapping(self) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
        """transformers' GGUF -> Hugging Face name map, and the model's parameters' shapes by name (on a weightless
        model)."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

        config = AutoConfig.from_pretrained(self.config_dir)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        architecture = self._architecture
        named_as = architecture if architecture in DENSE_GGUF else None  # gguf-py's name where it is not the model's
        shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        return get_gguf_hf_weights_map(model, self._processor, model_type=named_as), shapes

    @cached_property
    def _experts(self) -> dict[str, ExpertTensor]:
        """The Hugging Face tensors that are rows of GGUF expert tensors (gguf_experts.py)."""
        architecture = self._architecture
        return expert_tensors(architecture, self._weightless_mapping[1], set(self._tensors))

    def experts(self, name: str) -> ExpertTensor | None:
        """How `name` is made of GGUF expert rows, when it is (gpt-oss's experts, their biases, the sinks)."""
        return self._experts.get(name)

    def has(self, name: str) -> bool:
        return name in self._gguf_names or name in self._experts

    def gguf_name(self, name: str) -> str:
        return self._gguf_names[name]

    def tensor(self, gguf_name: str) -> Any:
        """The reader's tensor (its `data` maps the file)."""
        return self._tensors[gguf_name]

    def load(self, name: str) -> Any:
        import torch

        composite = self._experts.get(name)
        if composite is not None:
            parts = [_dequantize(self._tensors[part].data, self._tensors[part].tensor_type) for part in composite.parts]
            self.release()
            return torch.from_numpy(self._owned(composite.assemble(parts)))
        gguf_name = self._gguf_names[name]
        tensor = self._tensors[gguf_name]
        values = _dequantize(tensor.data, tensor.tensor_type)
        self.release()
        values = np.asarray(self._processor.process(weights=values, name=gguf_name).weights)
        shape = self._weightless_mapping[1].get(name)
        if shape is not None and values.shape != shape and values.size == int(np.prod(shape)):
            # transformers' Qwen2-MoE processor turns the shared-expert gate ([1, hidden] as the converter writes
            # it) into [1, 1, hidden], expecting the [hidden] of a squeezed file
            values = values.reshape(shape)
        return torch.from_numpy(self._owned(values))

    def _owned(self, values: np.ndarray) -> np.ndarray:
        """`values` as a writable float32 array that is not the mapped file (an F32 tensor dequantizes to a view of
        it), copied only then: a copy of each dequantized tensor doubled the largest one's memory (the 8B shape's
        805 MB output matrix)."""
        if values.dtype != np.float32 or not values.flags.writeable or np.may_share_memory(values, self._mapped[0]):
            return np.array(values, dtype=np.float32)
        return values

    def release(self) -> None:
        """Give back the mapped file's pages read so far (packager/mapped.py)."""
        release(self._mapped[0])

    def rows(self, name: str) -> GgufRows | None:
        """Which GGUF rows `name`'s rows are, when the converter only reordered them (else None).

        Found by passing row numbers through the same processing as the values: what comes out is a
        permutation of them exactly when the processing moved rows and computed nothing.
        """
        gguf_name = self._gguf_names.get(name)
        if gguf_name is None:
            return None
        tensor = self._tensors[gguf_name]
        count = int(np.prod(tensor.data.shape[:-1])) if len(tensor.data.shape) > 1 else 1
        numbers = np.arange(count, dtype=np.float64).reshape(count, 1)
        processed = np.asarray(self._processor.process(weights=numbers, name=gguf_name).weights)
        if processed.shape != numbers.shape or not np.array_equal(np.sort(processed[:, 0]), numbers[:, 0]):
            return None
        return GgufRows(gguf_name, processed[:, 0].astype(np.int64))

    def describe(self) -> dict[str, str]:
        return {"kind": "gguf", "file": str(self.file), "config_dir": str(self.config_dir)}
