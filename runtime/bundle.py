"""Open a bundle written by `pkg build`, verify it, and expose its manifest as typed objects.

A bundle is a directory holding `manifest.json` and the files it lists. The manifest records every
file's sha256 and size; `open_bundle` refuses a bundle whose files are missing, extra, or altered,
so the runtime never serves weights it cannot vouch for.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
GENERATION_TASKS = ("chat", "completion")  # bundles served by the decoder engine (`Manifest.model`)
EMBEDDING_TASK = "embedding"  # bundles served by the encoder (`Manifest.encoder`)
CLASSIFICATION_TASK = "classification"  # an encoder with a sequence-classification head (`EncoderFacts.labels`)
ENCODER_TASKS = (EMBEDDING_TASK, CLASSIFICATION_TASK)
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

    def cache_names(self, num_layers: int) -> list[tuple[str, str]]:
        """(past, present) of each KV cache tensor, in graph order: every layer's key, then every layer's value."""
        layers = range(num_layers)
        keys = [(self.past_key % i, self.present_key % i) for i in layers]
        return keys + [(self.past_value % i, self.present_value % i) for i in layers]


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
class EncoderFacts:
    """What the runtime needs to serve an encoder: an embedding model, as its sentence-transformers config says,
    or a sequence classifier, as its config's `id2label` says."""

    architecture: str
    precision: str
    dimensions: int  # length of one embedding; a classifier's: the number of labels (its logits)
    vocab_size: int
    max_tokens: int  # longest input, special tokens included (sentence-transformers' `max_seq_length`)
    pooling: str  # "mean", "cls", "max" or "mean_sqrt_len"; "none" for a classifier, whose graph pools itself
    normalize: bool  # L2-normalise the pooled vector
    input_names: tuple[str, ...]  # graph inputs, a subset of input_ids, attention_mask, token_type_ids
    output_name: str  # the token embeddings `[batch, tokens, dimensions]`; a classifier's logits `[batch, labels]`
    pad_token_id: int
    labels: tuple[str, ...] = ()  # a classifier's label of each logit, in order; empty for an embedding model


@dataclass(frozen=True)
class Manifest:
    format_version: int
    function: str
    spec_digest: str
    model_file: str
    tokenizer_file: str
    model: ModelFacts | None  # the decoder's facts; None in an embedding bundle
    files: dict[str, FileEntry]
    created_by: dict[str, str]
    build_key: str = ""  # digest of every build input: an unchanged rebuild reuses the bundle as is
    # The cold-start snapshot's description (`runtime.snapshot.SnapshotInfo` reads it); None: no snapshot.
    snapshot: dict[str, Any] | None = None
    # What the bundle serves: chat/completion (decoder, `model`) or embedding/classification (encoder, `encoder`).
    # Absent from bundles written before encoders existed, which are all decoders: "chat".
    task: str = "chat"
    encoder: EncoderFacts | None = None
    # A decoder graph that takes LoRA adapters: {"layout": AdapterLayout JSON, "bundled": {name: file}}
    # (runtime/adapters/); None: the graph takes none.
    adapters: dict[str, Any] | None = None
    # The scale tables its graphs name, expanded where it runs (runtime/engine/tables.py): bytes of disk and of
    # weights to pack that the files do not show.
    table_bytes: int = 0

    @property
    def decoder(self) -> ModelFacts:
        """The decoder's facts; `BundleError` naming the task for an embedding or classification bundle."""
        if self.model is None:
            raise BundleError(f"the bundle of {self.function} serves {self.task}: it has no decoder (text generation)")
        return self.model

    @property
    def precision(self) -> str:
        """How the bundle's weights are stored (`gguf`, `int4`, `int8`, `fp32`), decoder or encoder alike."""
        facts = self.model or self.encoder
        assert facts is not None, "a manifest describes a decoder or an encoder"  # read_manifest checks it
        return facts.precision

    @property
    def digest(self) -> str:
        """A digest of the whole bundle: the manifest pins every file's hash."""
        return "sha256:" + hashlib.sha256(manifest_bytes(self.to_json())).hexdigest()

    def to_json(self) -> dict[str, Any]:
        # Optional keys are written only when set, so a decoder bundle's manifest (and digest) is unchanged.
        optional: dict[str, Any] = {"snapshot": self.snapshot} if self.snapshot is not None else {}
        if self.task != "chat":
            optional["task"] = self.task
        if self.model is not None:
            optional["model"] = _facts_to_json(self.model)
        if self.encoder is not None:
            optional["encoder"] = _encoder_to_json(self.encoder)
        if self.adapters is not None:
            optional["adapters"] = self.adapters
        if self.table_bytes:
            optional["table_bytes"] = self.table_bytes
        return {
            "format_version": self.format_version,
            "function": self.function,
            "spec_digest": self.spec_digest,
            "model_file": self.model_file,
            "tokenizer_file": self.tokenizer_file,
            "files": {k: {"sha256": v.sha256, "size": v.size} for k, v in sorted(self.files.items())},
            "created_by": dict(self.created_by),
            "build_key": self.build_key,
            **optional,
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
            task = data.get("task", "chat")
            if task not in (*GENERATION_TASKS, *ENCODER_TASKS):
                raise BundleError(f"manifest task {task!r} is not served by this runtime; rebuild the bundle")
            model = _model_from_json(data["model"]) if task in GENERATION_TASKS or "model" in data else None
            encoder = _encoder_from_json(data["encoder"]) if task in ENCODER_TASKS else None
            files = {k: FileEntry(**v) for k, v in data["files"].items()}
            _check_names(files, data["model_file"], data["tokenizer_file"])
            return cls(
                format_version=version,
                function=data["function"],
                spec_digest=data["spec_digest"],
                model_file=data["model_file"],
                tokenizer_file=data["tokenizer_file"],
                model=model,
                files=files,
                created_by=dict(data.get("created_by", {})),
                build_key=data.get("build_key", ""),
                snapshot=data.get("snapshot"),
                task=task,
                encoder=encoder,
                adapters=data.get("adapters"),
                table_bytes=int(data.get("table_bytes", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise BundleError(f"manifest.json is malformed: {exc!r}; rebuild the bundle") from exc


def _check_names(files: dict[str, FileEntry], model_file: str, tokenizer_file: str) -> None:
    """Every name the manifest lists must stay inside the bundle: relative, no `..`, plain POSIX text."""
    for name in files:
        if not isinstance(name, str) or not _is_inside(name):
            raise BundleError(
                f"manifest lists the file {name!r}, which points outside the bundle: names must be relative "
                "paths without '..' (the manifest was tampered with); rebuild the bundle with `pkg build`"
            )
    for key, name in (("model_file", model_file), ("tokenizer_file", tokenizer_file)):
        if name not in files:
            raise BundleError(f"manifest {key} {name!r} is not one of the bundle's listed files; rebuild the bundle")


def _is_inside(name: str) -> bool:
    path = PurePosixPath(name)
    return (
        bool(name)
        and not path.is_absolute()
        and ".." not in path.parts
        and "\\" not in name
        and "\0" not in name
        and path.as_posix() == name  # no `.` parts, doubled or trailing slashes
        and name != MANIFEST_NAME
    )


def _model_from_json(data: dict[str, Any]) -> ModelFacts:
    model = dict(data)
    model["io"] = DecoderIO(**model["io"])
    model["eos_token_ids"] = tuple(model["eos_token_ids"])
    return ModelFacts(**model)


def _encoder_from_json(data: dict[str, Any]) -> EncoderFacts:
    return EncoderFacts(**{**data, "input_names": tuple(data["input_names"]), "labels": tuple(data.get("labels", ()))})


def _encoder_to_json(facts: EncoderFacts) -> dict[str, Any]:
    out: dict[str, Any] = {**facts.__dict__, "input_names": list(facts.input_names), "labels": list(facts.labels)}
    if not facts.labels:  # an embedding bundle's manifest (and digest) stays as it was before classifiers
        del out["labels"]
    return out


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
    # Anything but a real directory counts: files, symlinks (even to directories), fifos, device nodes.
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_symlink() or not p.is_dir()}
    present.discard(MANIFEST_NAME)
    extra = sorted(present - manifest.files.keys())
    if extra:
        raise BundleError(f"bundle {root} holds files its manifest does not list: {', '.join(extra)}")
    real_root = root.resolve()
    for name, expected in sorted(manifest.files.items()):
        file_path = root / name
        if file_path.is_symlink() or not file_path.is_file():
            raise BundleError(f"bundle {root} is missing {name} (or it is not a regular file)")
        if not file_path.resolve().is_relative_to(real_root):
            raise BundleError(
                f"bundle file {name} resolves to {file_path.resolve()}, outside the bundle (a folder on its path "
                "is a symlink); a bundle must hold its own files: rebuild it with `pkg build`"
            )
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
