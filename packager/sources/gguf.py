"""GGUF → fp32 Hugging Face folder, through transformers' GGUF loader, cached by the file's sha256.

The builder cannot read quantized GGUF (only fp16/fp32), so quantized weights are dequantized first.
Found on transformers 5: `save_pretrained` refuses a GGUF-loaded model ("quantized with gguf and is
not serializable") until the quantizer is detached; the weights are plain fp32 tensors by then.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from packager.cache import cached_dir
from packager.progress import StepProgress

_HASH_CHUNK = 1 << 20
DEQUANTIZE_VERSION = 1  # bump when the conversion below changes, to invalidate cached folders


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def dequantize_gguf(gguf_path: Path, progress: StepProgress) -> tuple[Path, str, bool]:
    """Return `(hf_dir, content_key, reused)`."""
    with progress.step("dequantize", f"dequantize {gguf_path.name} to fp32") as step:
        key = file_sha256(gguf_path)

        def produce(out: Path) -> None:
            _convert(gguf_path, out)

        hf_dir, reused = cached_dir("hf", f"{key}-v{DEQUANTIZE_VERSION}", produce)
        if reused:
            step.cached(str(hf_dir))
    return hf_dir, key, reused


def _convert(gguf_path: Path, out: Path) -> None:
    # transformers' GGUF reader draws its own tqdm bar; ours already shows this step.
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
