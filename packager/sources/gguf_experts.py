"""A GGUF file's Mixture-of-Experts tensors under the Hugging Face names of the model's parameters.

llama.cpp's converter writes a layer's experts as one 3-D tensor per projection, `[experts, rows, K]` (numpy
order; ggml's `ne` reversed) with output features as rows like every GGUF matrix (`blk.N.ffn_gate_exps.weight`,
`ffn_up_exps`, `ffn_down_exps`, their `.bias`), where transformers' model holds other shapes; and transformers'
GGUF loader does not map them for gpt-oss (its processor's patterns match no name llama.cpp writes). So each
such Hugging Face tensor is described here as GGUF rows, the converter's steps undone:
- gpt-oss (convert_hf_to_gguf.py's GptOssModel): `mlp.experts.gate_up_proj` `[E, hidden, 2 * inter]` is
  input-major with gate and up interleaved along its last axis (column `2j` of expert e is row j of
  `ffn_gate_exps`, column `2j + 1` row j of `ffn_up_exps`); `down_proj` `[E, inter, hidden]` holds
  `ffn_down_exps`' rows as its columns; `gate_up_proj_bias` and `down_proj_bias` are those tensors' `.bias`
  (gate and up interleaved); `self_attn.sinks` is `attn_sinks.weight`. A file written with the converter's
  `fuse_gate_up_exps` (one `ffn_gate_up_exps`) is not read yet: its experts are missing and the build says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

_LAYER = r"model\.layers\.(\d+)\."


@dataclass(frozen=True)
class ExpertTensor:
    """A Hugging Face tensor made of the rows of GGUF tensors `parts`, each `[experts, rows, ...]`."""

    parts: tuple[str, ...]
    interleaved: bool  # the parts' rows alternate (gate 0, up 0, gate 1, ...); else they follow each other
    columns: bool  # the Hugging Face tensor holds those rows along its last axis (input-major)

    def assemble(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The Hugging Face tensor from its parts' values (each as the GGUF holds it)."""
        if len(arrays) == 1:
            joined = arrays[0]
        elif self.interleaved:
            joined = np.stack(arrays, axis=2).reshape(arrays[0].shape[0], -1, *arrays[0].shape[2:])
        else:
            joined = np.concatenate(arrays, axis=1)
        return np.swapaxes(joined, -1, -2) if self.columns else joined

    def rows(self, counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """For each joined row (per expert, before `columns` turns them): which part, and which row of it.

        `counts`: the rows per expert of each part. Returns `(part [rows], row [rows])`, the same for every expert.
        """
        part = np.concatenate([np.full(count, index) for index, count in enumerate(counts)])
        row = np.concatenate([np.arange(count) for count in counts])
        if self.interleaved:
            order = np.arange(sum(counts)).reshape(len(counts), -1).T.reshape(-1)
            part, row = part[order], row[order]
        return part, row


def expert_tensors(architecture: str, hf_names: Iterable[str], gguf_names: set[str]) -> dict[str, ExpertTensor]:
    """The Hugging Face tensors of `architecture` (GGUF `general.architecture`) that are GGUF expert rows."""
    layout = _LAYOUTS.get(architecture)
    if layout is None:
        return {}
    found: dict[str, ExpertTensor] = {}
    for name in hf_names:
        match = re.fullmatch(_LAYER + r"(.+)", name)
        if match is None:
            continue
        block, rest = f"blk.{match.group(1)}.", match.group(2)
        candidates = layout(block, rest)
        for tensor in candidates:
            if all(part in gguf_names for part in tensor.parts):
                found[name] = tensor
                break
    return found


def _gpt_oss(block: str, rest: str) -> list[ExpertTensor]:
    def split(kind: str, columns: bool) -> list[ExpertTensor]:
        return [ExpertTensor((f"{block}ffn_gate_exps.{kind}", f"{block}ffn_up_exps.{kind}"), True, columns)]

    if rest == "mlp.experts.gate_up_proj":
        return split("weight", columns=True)
    if rest == "mlp.experts.gate_up_proj_bias":
        return split("bias", columns=False)
    if rest == "mlp.experts.down_proj":
        return [ExpertTensor((f"{block}ffn_down_exps.weight",), False, True)]
    if rest == "mlp.experts.down_proj_bias":
        return [ExpertTensor((f"{block}ffn_down_exps.bias",), False, False)]
    if rest == "self_attn.sinks":
        return [ExpertTensor((f"{block}attn_sinks.weight",), False, False)]
    return []


def _qwen_moe(block: str, rest: str) -> list[ExpertTensor]:
    if rest == "mlp.experts.gate_up_proj":
        return [ExpertTensor((f"{block}ffn_gate_exps.weight", f"{block}ffn_up_exps.weight"), False, False)]
    if rest == "mlp.experts.down_proj":
        return [ExpertTensor((f"{block}ffn_down_exps.weight",), False, False)]
    return []


_LAYOUTS = {"gpt-oss": _gpt_oss, "qwen2moe": _qwen_moe, "qwen3moe": _qwen_moe}
