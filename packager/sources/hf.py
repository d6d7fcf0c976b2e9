"""A local Hugging Face model folder: check it has what the exporter needs, and key it by content."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from packager.errors import UserError

_HASH_CHUNK = 1 << 20
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # OWNER/NAME


def check_hf_folder(path: Path, *, source: str | None = None) -> None:
    """`path` is a model folder the exporter can read; `source` is the `hf:` source it came from, if any."""
    if not path.is_dir():
        where = f"model.source = {source!r}: " if source else ""
        hub_id = source.removeprefix("hf:") if source else ""
        # `OWNER/NAME` whose OWNER is no folder either: a Hugging Face Hub id, written expecting a download.
        if _HUB_ID.match(hub_id) and not path.parent.is_dir():
            local_dir = path.parent.parent / hub_id.split("/")[1]
            raise UserError(
                f"{where}no folder {path}. `hf:` takes a local folder: pkg never downloads from the Hugging Face "
                f"Hub. Download the model first: hf download {hub_id} --local-dir {_shown(local_dir)} "
                f"(`huggingface-cli download` before huggingface_hub 1.0), then point the source at that folder: "
                f"hf:{local_dir}",
                exit_code=2,
            )
        raise UserError(
            f"{where}model folder {path} does not exist; relative paths are relative to the function folder",
            exit_code=2,
        )
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


def _shown(path: Path) -> Path:
    """`path` relative to the current folder when it is below it (what the user would type), else absolute."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
