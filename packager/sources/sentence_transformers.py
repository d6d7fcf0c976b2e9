"""A sentence-transformers model folder: how its embeddings are made, read from its own config files.

`modules.json` lists the pipeline (Transformer → Pooling → optional Normalize), `1_Pooling/config.json`
(the Pooling module's folder) says which pooling, and `sentence_bert_config.json` the longest input.
The shipped `tokenizer.json` may carry its own truncation and padding (all-MiniLM-L6-v2's truncates at
128, below the model's 256): those are the tokenizer file's, not the model's, and are not read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packager.errors import UserError

_MODULE = "sentence_transformers.models."
# Pooling config flag → the runtime's pooling name (`runtime.encoder.pooling`).
_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}


@dataclass(frozen=True)
class SentenceEncoderConfig:
    pooling: str
    normalize: bool
    max_seq_length: int
    dimensions: int


def read_sentence_encoder_config(model_dir: Path) -> SentenceEncoderConfig:
    """The pooling, normalisation and input limit of the sentence-transformers model in `model_dir`."""
    modules = _read(model_dir, "modules.json")
    kinds = [str(m.get("type", "")).removeprefix(_MODULE) for m in modules]
    if not kinds or kinds[0] != "Transformer" or kinds.count("Pooling") != 1:
        raise UserError(f"{model_dir}/modules.json lists {kinds}: expected Transformer, Pooling[, Normalize]")
    unsupported = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unsupported:
        raise UserError(f"{model_dir}/modules.json uses {', '.join(unsupported)}, which onnxfn cannot export yet")
    pooling_dir = next(m["path"] for m in modules if str(m.get("type", "")).endswith(".Pooling"))
    pooling_config = _read(model_dir, f"{pooling_dir}/config.json")
    modes = [name for flag, name in _POOLING_FLAGS.items() if pooling_config.get(flag)]
    if len(modes) != 1:
        raise UserError(
            f"{model_dir}/{pooling_dir}/config.json enables pooling {modes or 'none'}: exactly one of "
            f"{', '.join(_POOLING_FLAGS)} is supported"
        )
    bert_config = _read(model_dir, "sentence_bert_config.json")
    hf_config = _read(model_dir, "config.json")
    max_length = int(bert_config.get("max_seq_length") or hf_config["max_position_embeddings"])
    return SentenceEncoderConfig(
        pooling=modes[0],
        normalize="Normalize" in kinds,
        max_seq_length=min(max_length, int(hf_config["max_position_embeddings"])),
        dimensions=int(pooling_config.get("word_embedding_dimension") or hf_config["hidden_size"]),
    )


def _read(model_dir: Path, name: str) -> Any:
    path = model_dir / name
    if not path.is_file():
        raise UserError(
            f"{model_dir} lacks {name}: an embedding function needs a sentence-transformers model folder "
            "(modules.json, the Pooling module's config.json, sentence_bert_config.json)",
            exit_code=2,
        )
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from exc
