"""A local Hugging Face model folder: check it has what the exporter needs, and key it by content."""

from __future__ import annotations

import hashlib
from pathlib import Path

from packager.errors import UserError

_HASH_CHUNK = 1 << 20


def check_hf_folder(path: Path) -> None:
    if not path.is_dir():
        raise UserError(f"model folder {path} does not exist", exit_code=2)
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise UserError(
            f"model folder {path} lacks {', '.join(missing)}; a Hugging Face folder saved with "
            "save_pretrained (safetensors) plus its tokenizer.json is expected",
            exit_code=2,
        )


def hf_folder_key(path: Path) -> str:
    """sha256 over every file's name and bytes, in name order."""
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()
