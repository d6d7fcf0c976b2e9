"""Read a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) without torch.

PEFT stores `lora_A.weight` as `[rank, in]` and `lora_B.weight` as `[out, rank]` (torch's Linear layout),
keyed `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`; the delta it adds is
`scale * x @ A.T @ B.T` with `scale = alpha / rank` (`alpha / sqrt(rank)` with rsLoRA). What PEFT can
save but a per-request adapter cannot serve (DoRA, trained biases, replaced heads or embeddings) is refused
with its reason rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from packager.adapters.weights import ADAPTABLE_MODULES, LoraMatrices, LoraWeights
from packager.errors import UserError
from runtime.adapters.files import safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:\w+\.)*?(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def is_peft_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_peft_adapter(folder: Path) -> LoraWeights:
    config = _read_config(folder)
    rank = int(config.get("r", 0))
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in _read_tensors(folder).items():
        match = _KEY.search(key)
        if match is None:
            raise UserError(
                f"{folder / WEIGHTS_FILE} holds {key!r}, which is not a LoRA matrix of a decoder layer; "
                "only LoRA on attention and MLP projections can be chosen per request"
            )
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in ADAPTABLE_MODULES:
            raise UserError(
                f"{folder.name} adapts {module!r} (tensor {key!r}); "
                f"onnxfn serves LoRA on {', '.join(ADAPTABLE_MODULES)}"
            )
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise UserError(f"{folder / WEIGHTS_FILE} holds no LoRA matrices (lora_A / lora_B weights)")
    matrices: dict[tuple[int, str], LoraMatrices] = {}
    for (layer, module), sides in sorted(pairs.items()):
        where = f"{folder.name}: layer {layer} {module}"
        if set(sides) != {"A", "B"}:
            raise UserError(f"{where} has lora_{''.join(sides)} without its partner; the adapter file is incomplete")
        a, b = sides["A"], sides["B"]  # [rank, in], [out, rank]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise UserError(
                f"{where} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; adapter_config.json says r = {rank}"
            )
        matrices[(layer, module)] = LoraMatrices(a=np.ascontiguousarray(a.T), b=np.ascontiguousarray(b.T))
    return LoraWeights(rank=rank, scale=scale, matrices=matrices, source=str(folder))


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}; a PEFT adapter folder holds a JSON adapter_config.json") from exc
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    refusals = {
        "peft_type": (peft_type != "LORA", f"it is a {peft_type} adapter; onnxfn serves LoRA adapters"),
        "use_dora": (bool(config.get("use_dora")), "DoRA rescales the merged weight per column, not a low-rank add"),
        "bias": (config.get("bias", "none") != "none", "trained biases change the base model's tensors"),
        "modules_to_save": (bool(config.get("modules_to_save")), "it replaces whole modules (e.g. the LM head)"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "GPT-2 style Conv1D layers are not exported"),
        "rank_pattern": (bool(config.get("rank_pattern")), "per-module ranks are not supported; use one r"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas are not supported; use one lora_alpha"),
    }
    for key, (refused, reason) in refusals.items():
        if refused:
            raise UserError(f"{path}: {key} = {config.get(key)!r} cannot be served per request: {reason}")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise UserError(f"{path}: r = {rank!r}; a LoRA rank is a positive integer")
    return config


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open  # the packager's dependency; the runtime reads adapters through runtime/

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise UserError(
            f"{folder} has no {WEIGHTS_FILE} (found: {', '.join(found) or 'nothing'}); "
            "save the adapter with `model.save_pretrained(folder)` (safe_serialization, the default)"
        )
    tensors: dict[str, np.ndarray] = {}
    # numpy has no bfloat16: such a file is read through torch (a packager dependency) and widened exactly.
    if "BF16" in _dtypes(path):
        import torch

        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = handle.get_tensor(key).to(torch.float32).numpy()
        return tensors
    with safe_open(str(path), framework="numpy") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensors[key] = _float_array(handle, key)
    return tensors


def _dtypes(path: Path) -> set[str]:
    """The dtypes a safetensors file declares."""
    try:
        header = safetensors_header(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is not a readable safetensors file ({exc}); save the adapter again") from exc
    return {entry["dtype"] for key, entry in header.items() if key != "__metadata__"}


def _float_array(handle: Any, key: str) -> np.ndarray:
    """The tensor as float32 or float16 (kept: the adapter stays in its own precision)."""
    array = np.asarray(handle.get_tensor(key))
    return array if array.dtype in (np.float32, np.float16) else array.astype(np.float32)
