"""Whether `model.source` is the kind of model `model.task` serves, checked before anything is built (cheap).

An embedding or classification task needs a Hugging Face encoder folder; a GGUF file is a generative model.
Without this check a GGUF under `task = "embedding"` is dequantized first and then refused by a path in the
build cache, which names neither key. The encoder's own config also gives its longest input, which is what
`pkg validate` reports for it (not `export.max_context`, which encoders do not read).
"""

from __future__ import annotations

from pathlib import Path

from packager.errors import UserError
from packager.sources.gguf_files import GgufFiles
from packager.spec import ENCODER_TASKS

_NEEDS = {
    "embedding": "a sentence-transformers model folder (hf:DIR with modules.json, sentence_bert_config.json, "
    "config.json, *.safetensors and tokenizer.json)",
    "classification": "a Hugging Face *ForSequenceClassification folder (hf:DIR with config.json naming its "
    "id2label, *.safetensors and tokenizer.json)",
}


def check_source_fits_task(source: str, located: Path | GgufFiles, task: str) -> int | None:
    """Refuse a source that `task` cannot serve, naming both keys; for an encoder task, return its longest input
    in tokens (from the model's own config), else None."""
    if task not in ENCODER_TASKS:
        return None
    if isinstance(located, GgufFiles):
        raise UserError(
            f"model.source = {source!r} is a GGUF file, a generative (text) model, but model.task = {task!r} needs "
            f'{_NEEDS[task]}. To serve this model set model.task = "chat" (or "completion"); for {task}s point '
            "model.source at such a folder",
            exit_code=2,
        )
    try:
        if task == "embedding":
            from packager.sources.sentence_transformers import read_sentence_encoder_config

            return read_sentence_encoder_config(located).max_seq_length
        from packager.encoder.classifier import read_classifier_config

        return read_classifier_config(located).max_tokens
    except UserError as exc:
        raise UserError(f"model.source = {source!r} cannot serve model.task = {task!r}: {exc}", exit_code=2) from None
