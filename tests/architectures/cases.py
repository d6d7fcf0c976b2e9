"""Tiny models of the architectures users bring, each made from its real published config.

Every structural key of the published config.json is kept (rope type and scaling, sliding windows, soft-capping,
partial rotary, q/k norms, tied or untied heads, biases, head_dim); only the sizes shrink (`TINY`), and context
lengths shrink with them so that a test prompt runs past a rope-scaled model's original context. The tokenizer and
ChatML template are the tiny Llama's (tests/fixtures/tiny_llama.py): 384 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 384,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
ORIGINAL_CONTEXT = 64  # the tiny stand-in for a rope-scaled model's original_max_position_embeddings
LONG_PROMPT = 200  # tokens: past ORIGINAL_CONTEXT, within max_position_embeddings


@dataclass(frozen=True)
class Case:
    name: str  # the test id
    hf_class: str  # config.json's architectures[0]
    model_type: str
    published: dict[str, Any]  # the structural keys of the published config named in `source`
    source: str  # which published config they come from
    shrink: dict[str, Any] = field(default_factory=dict)  # sizes of this case on top of TINY
    long_prompt: bool = False  # also checked on a LONG_PROMPT-token prompt (rope scaling past ORIGINAL_CONTEXT)

    def config(self) -> dict[str, Any]:
        return {**self.published, **TINY, **self.shrink, "architectures": [self.hf_class]}


def __getattr__(name: str) -> tuple[Case, ...]:
    """`CASES`: every case the architecture tests build, dense decoders, rope-scaled ones and Mixture-of-Experts
    (a module each, which imports `Case` from here: so they are imported on first use, whichever comes first)."""
    if name != "CASES":
        raise AttributeError(name)
    from tests.architectures.cases_dense import DENSE_CASES
    from tests.architectures.cases_moe import MOE_CASES
    from tests.architectures.cases_rope import ROPE_CASES

    return DENSE_CASES + ROPE_CASES + MOE_CASES
