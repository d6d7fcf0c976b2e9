"""The PyTorch model's predictions on the quality sequences, with one weight in memory at a time.

The transformers model is built from config.json on the meta device and run under accelerate's CPU offload
(`cpu_offload`): before each module runs, its weights are read from the source by name (a GGUF tensor
dequantized, a safetensors tensor mapped), and dropped after. All prompts run as one right-padded batch (causal
attention never looks at the padding after a sequence), so every weight is read once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from packager.sources.weights import WeightSource, load_any
from packager.verify.quality import Scores
from packager.verify.texts import Sequences

Adapt = Callable[[str, Any], Any]  # (parameter name, its tensor) -> the tensor the model computes with


class _SourceWeights(Mapping[str, Any]):
    """The model's state dict, read from the source one tensor at a time (accelerate's `weights_map`)."""

    def __init__(self, source: WeightSource, names: dict[str, list[str]], adapt: Adapt | None) -> None:
        self._source = source
        self._names = names  # parameter -> the names it may have in the source (a tied weight's others)
        self._adapt = adapt

    def __getitem__(self, name: str) -> Any:
        tensor = load_any(self._source, self._names[name])
        return self._adapt(name, tensor) if self._adapt is not None else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def torch_scores(
    config_dir: Path,
    source: WeightSource,
    sequences: Sequences,
    max_positions: int,
    *,
    threads: int = 2,
    adapt: Adapt | None = None,
) -> Scores:
    """PyTorch's log-probabilities over each prompt's answer (the held-out text is not needed for parity), as a
    bundle of `max_positions` positions computes them (rotary.bundle_config: a longrope model past its original
    context rotates every sequence with the long factors)."""
    import torch
    from accelerate import cpu_offload, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from packager.export.rotary import bundle_config

    config = bundle_config(AutoConfig.from_pretrained(config_dir), max_positions)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    model.eval()
    names: dict[str, list[str]] = {}
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(tensor), []).append(name)
    for group in by_tensor.values():
        for name in group:
            names[name] = [name, *(other for other in group if other != name)]
    cpu_offload(model, execution_device=torch.device("cpu"), state_dict=_SourceWeights(source, names, adapt))

    prompts = sequences.prompts
    longest = max(map(len, prompts))
    ids = np.zeros((len(prompts), longest), np.int64)
    mask = np.zeros((len(prompts), longest), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
        mask[row, : len(prompt)] = 1
    first = min(sequences.scored(i).start for i in range(len(prompts)))
    scores = Scores(sequences)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            output = model(
                input_ids=torch.from_numpy(ids),
                attention_mask=torch.from_numpy(mask),
                logits_to_keep=torch.arange(first, longest),
                use_cache=False,
            )
        logits = output.logits.float().numpy()
    finally:
        torch.set_num_threads(previous)
    for row in range(len(prompts)):
        window = sequences.scored(row)
        full = np.zeros((longest, logits.shape[-1]), np.float32)
        full[first:longest] = logits[row]
        scores.keep(row, full[: window.stop])
    return scores
