"""Open a bundle written by `pkg build`, verify it, and expose its manifest as typed objects.

A bundle is a directory holding `manifest.json` and the files it lists. The manifest records every
file's sha256 and size; `open_bundle` refuses a bundle whose files are missing, extra, or altered,
so the runtime never serves weights it cannot vouch for.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 1 << 20


class BundleError(Exception):
    """A bundle that cannot be served: the message says which file or field is wrong."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class DecoderIO:
    """Names of the decoder graph's inputs and outputs; `%d` stands for the layer index."""

    input_ids: str
    attention_mask: str
    past_key: str
    past_value: str
    logits: str
    present_key: str
    present_value: str


@dataclass(frozen=True)
class ModelFacts:
    """What the runtime needs to know about the model without opening the graph."""

    task: str
    architecture: str
    precision: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    kv_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None
    io: DecoderIO

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        itemsize = {"float32": 4, "float16": 2}[self.kv_dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class Manifest:
    format_version: int
    function: str
    spec_digest: str
    model_file: str
    tokenizer_file: str
    model: ModelFacts
    files: dict[str, FileEntry]
    created_by: dict[str, str]
    build_key: str = ""  # digest of every build input: an unchanged rebuild reuses the bundle as is
    # The cold-start snapshot's description (`runtime.snapshot.SnapshotInfo` reads it); None: no snapshot.
    snapshot: dict[str, Any] | None = None

    @property
    def digest(self) -> str:
        """A digest of the whole bundle: the manifest pins every file's hash."""
        return "sha256:" + hashlib.sha256(manifest_bytes(self.to_json())).hexdigest()

    def to_json(self) -> dict[str, Any]:
        snapshot = {"snapshot": self.snapshot} if self.snapshot is not None else {}
        return {
            "format_version": self.format_version,
            "function": self.function,
            "spec_digest": self.spec_digest,
            "model_file": self.model_file,
            "tokenizer_file": self.tokenizer_file,
            "model": {**_facts_to_json(self.model)},
            "files": {k: {"sha256": v.sha256, "size": v.size} for k, v in sorted(self.files.items())},
            "created_by": dict(self.created_by),
            "build_key": self.build_key,
            **snapshot,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        try:
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise BundleError(
                    f"manifest format_version {version!r} is not supported by this runtime "
                    f"(it reads version {FORMAT_VERSION}); rebuild the bundle with `pkg build`"
                )
            model = dict(data["model"])
            model["io"] = DecoderIO(**model["io"])
            model["eos_token_ids"] = tuple(model["eos_token_ids"])
            return cls(
                format_version=version,
                function=data["function"],
                spec_digest=data["spec_digest"],
                model_file=data["model_file"],
                tokenizer_file=data["tokenizer_file"],
                model=ModelFacts(**model),
                files={k: FileEntry(**v) for k, v in data["files"].items()},
                created_by=dict(data.get("created_by", {})),
                build_key=data.get("build_key", ""),
                snapshot=data.get("snapshot"),
            )
        except (KeyError, TypeError) as exc:
            raise BundleError(f"manifest.json is malformed: {exc!r}; rebuild the bundle") from exc


def _facts_to_json(facts: ModelFacts) -> dict[str, Any]:
    out = {k: getattr(facts, k) for k in facts.__dataclass_fields__}
    out["io"] = dict(facts.io.__dict__)
    out["eos_token_ids"] = list(facts.eos_token_ids)
    return out


def manifest_bytes(data: dict[str, Any]) -> bytes:
    """The canonical serialisation: sorted keys, so the same manifest always hashes the same."""
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def file_digest(path: Path) -> FileEntry:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileEntry(sha256=h.hexdigest(), size=size)


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: Manifest

    @property
    def model_path(self) -> Path:
        return self.path / self.manifest.model_file

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest.tokenizer_file

    def file(self, name: str) -> Path:
        if name not in self.manifest.files:
            raise BundleError(f"{name!r} is not part of the bundle at {self.path}")
        return self.path / name


def read_manifest(path: Path) -> Manifest:
    manifest_path = Path(path) / MANIFEST_NAME
    if not manifest_path.is_file():
        raise BundleError(f"{path} is not a bundle: {MANIFEST_NAME} is missing (run `pkg build` first)")
    try:
        data = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{manifest_path} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{manifest_path} must hold a JSON object")
    return Manifest.from_json(data)


def open_bundle(path: str | Path, *, verify: bool = True) -> Bundle:
    """Open the bundle at `path`; with `verify`, check every file against the manifest first.

    Refuses, naming the file: a missing file, a file whose size or sha256 differs, and a file
    present in the directory but absent from the manifest (something was added after the build).
    """
    root = Path(path)
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    return Bundle(path=root, manifest=manifest)


def verify_files(root: Path, manifest: Manifest) -> None:
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}
    present.discard(MANIFEST_NAME)
    extra = sorted(present - manifest.files.keys())
    if extra:
        raise BundleError(f"bundle {root} holds files its manifest does not list: {', '.join(extra)}")
    for name, expected in sorted(manifest.files.items()):
        file_path = root / name
        if file_path.is_symlink() or not file_path.is_file():
            raise BundleError(f"bundle {root} is missing {name} (or it is not a regular file)")
        actual_size = file_path.stat().st_size
        if actual_size != expected.size:
            raise BundleError(
                f"bundle file {name} is {actual_size} bytes, the manifest says {expected.size}: "
                "the bundle was altered or truncated; rebuild it with `pkg build`"
            )
        actual = file_digest(file_path)
        if actual.sha256 != expected.sha256:
            raise BundleError(
                f"bundle file {name} has sha256 {actual.sha256}, the manifest says {expected.sha256}: "
                "the bundle was tampered with or corrupted; rebuild it with `pkg build`"
            )
