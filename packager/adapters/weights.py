"""A LoRA adapter's weights as read from any source (a PEFT folder, a GGUF LoRA file), before conversion.

Module names are the Hugging Face projection names the PEFT ecosystem targets (`q_proj`, `down_proj`, …);
each source maps its own naming onto them (peft.py, gguf_lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

# The projections an adapter may target: attention and MLP linears of the decoders onnxfn exports.
ADAPTABLE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraMatrices:
    """One adapted projection: `y = x @ W + scale * (x @ a) @ b`."""

    a: NDArray[np.floating]  # [in_features, rank]
    b: NDArray[np.floating]  # [rank, out_features]


@dataclass(frozen=True)
class LoraWeights:
    """Every adapted projection of one adapter, keyed by `(layer, module)`; `scale` multiplies each delta."""

    rank: int
    scale: float  # alpha / rank, or alpha / sqrt(rank) for rsLoRA
    matrices: dict[tuple[int, str], LoraMatrices]
    source: str  # what it was read from, for messages

    @property
    def modules(self) -> tuple[str, ...]:
        """The targeted module names, in `ADAPTABLE_MODULES` order."""
        targeted = {module for _, module in self.matrices}
        return tuple(m for m in ADAPTABLE_MODULES if m in targeted)
