"""An encoder bundle: the chosen graph, the tokenizer, quality.json and a manifest with `EncoderFacts`.

Written the way `packager.bundle` writes a decoder bundle: assembled in a temporary sibling folder,
fsynced, then swapped onto the target by the same `_replace_dir`, so `bundle/` is always whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from packager.bundle import QUALITY_FILE, _replace_dir
from packager.export.encoder import INPUT_NAMES, MODEL_FILE, OUTPUT_NAME
from packager.sources.sentence_transformers import SentenceEncoderConfig
from packager.spec import FunctionSpec
from runtime.bundle import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    EncoderFacts,
    FileEntry,
    Manifest,
    file_digest,
    manifest_bytes,
)

TOKENIZER_FILE = "tokenizer.json"


def encoder_facts(hf_dir: Path, config: SentenceEncoderConfig, precision: str) -> EncoderFacts:
    hf_config = json.loads((hf_dir / "config.json").read_text())
    return EncoderFacts(
        architecture=hf_config.get("model_type", "bert"),
        precision=precision,
        dimensions=config.dimensions,
        vocab_size=int(hf_config["vocab_size"]),
        max_tokens=config.max_seq_length,
        pooling=config.pooling,
        normalize=config.normalize,
        input_names=INPUT_NAMES,
        output_name=OUTPUT_NAME,
        pad_token_id=int(hf_config.get("pad_token_id") or 0),
    )


def write_encoder_bundle(
    spec: FunctionSpec, model: Path, tokenizer: Path, facts: EncoderFacts, quality_json: bytes, build_key: str,
    target: Path,
) -> Manifest:  # fmt: skip
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bundle-tmp-", dir=target.parent))
    try:
        shutil.copyfile(model, tmp / MODEL_FILE)
        shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        (tmp / QUALITY_FILE).write_bytes(quality_json)
        files: dict[str, FileEntry] = {
            name: file_digest(tmp / name) for name in (MODEL_FILE, TOKENIZER_FILE, QUALITY_FILE)
        }
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            function=spec.name,
            spec_digest=spec.digest,
            model_file=MODEL_FILE,
            tokenizer_file=TOKENIZER_FILE,
            model=None,
            files=files,
            created_by={name: metadata.version(name) for name in ("onnxfn", "onnxruntime")},
            build_key=build_key,
            task=spec.model.task,
            encoder=facts,
        )
        (tmp / MANIFEST_NAME).write_bytes(manifest_bytes(manifest.to_json()))
        for path in tmp.iterdir():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
