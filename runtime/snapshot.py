"""The bundle's cold-start snapshot: work `pkg build` did so a fresh process does not have to.

Today it holds the KV cache of the function's system prompt, twice: its block alone, and with the opening
of the user turn that follows it in every chat (`system_prompt_prefixes`). Computed by this runtime's engine
at build time and restored into the prefix cache at start, so the first request that uses the system prompt
prefills only the user's own words. KV values depend on the ONNX Runtime version, the execution provider
and the graph that computed them (the engine picks a prefill graph by CPU, engine/graphs.py), so the manifest
records all three along with the model's hash, and a snapshot made for anything else is ignored with a
warning, never used: a prefix cache hit must equal a miss.

Manifest section (`manifest.json` → `snapshot`):

    {"format": 2, "onnxruntime": "1.31.1", "providers": ["cpu"], "prompt_graph": "prefill.onnx",
     "model_sha256": "…", "kv_dtype": "float32",
     "prefixes": [{"name": "system_prompt", "file": "snapshot/system_prompt.npy", "token_ids": [1, …]},
                  {"name": "system_prompt_user_turn", "file": "snapshot/system_prompt_user_turn.npy", …}]}
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.bundle import Bundle, Manifest
from runtime.engine.kv_cache import common_prefix_length

if TYPE_CHECKING:
    from runtime.engine.engine import Engine
    from runtime.engine.tokenizer import Tokenizer

SNAPSHOT_FORMAT = 2
SNAPSHOT_DIR = "snapshot"
log = logging.getLogger("runtime.snapshot")


@dataclass(frozen=True)
class PrefixSnapshot:
    name: str
    file: str  # bundle-relative `.npy`: `[2 * layers, kv_heads, len(token_ids), head_dim]`
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SnapshotInfo:
    format: int
    onnxruntime: str
    providers: tuple[str, ...]  # short names (`cpu`): the snapshot is valid when the engine runs on the first
    prompt_graph: str  # the bundle file of the graph that computed the KV (`Engine.prompt_graph_file`)
    model_sha256: str
    kv_dtype: str
    prefixes: tuple[PrefixSnapshot, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "onnxruntime": self.onnxruntime,
            "providers": list(self.providers),
            "prompt_graph": self.prompt_graph,
            "model_sha256": self.model_sha256,
            "kv_dtype": self.kv_dtype,
            "prefixes": [{"name": p.name, "file": p.file, "token_ids": list(p.token_ids)} for p in self.prefixes],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SnapshotInfo:
        return cls(
            format=int(data["format"]),
            onnxruntime=str(data["onnxruntime"]),
            providers=tuple(data["providers"]),
            prompt_graph=str(data["prompt_graph"]),
            model_sha256=str(data["model_sha256"]),
            kv_dtype=str(data["kv_dtype"]),
            prefixes=tuple(
                PrefixSnapshot(str(p["name"]), str(p["file"]), tuple(int(t) for t in p["token_ids"]))
                for p in data["prefixes"]
            ),
        )


@dataclass(frozen=True)
class RestoreResult:
    restored: tuple[PrefixSnapshot, ...]  # pinned in the engine's prefix cache
    ignored: str | None = None  # why the snapshot was not used at all

    @property
    def restored_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.restored)


def incompatibility(
    info: SnapshotInfo, manifest: Manifest, onnxruntime_version: str, provider: str, prompt_graph: str
) -> str | None:
    """Why `info` must not be used by an engine on `provider` prefilling through the bundle file `prompt_graph`
    with this ONNX Runtime; None when it may be."""
    model = manifest.files.get(manifest.model_file)
    if info.format != SNAPSHOT_FORMAT:
        return f"snapshot format {info.format}, this runtime reads format {SNAPSHOT_FORMAT}"
    if info.onnxruntime != onnxruntime_version:
        return f"made with onnxruntime {info.onnxruntime}, running {onnxruntime_version}"
    if provider not in info.providers[:1]:
        return f"made on the {list(info.providers)} provider(s), running on {provider!r}"
    if prompt_graph != info.prompt_graph:
        return f"computed by {info.prompt_graph}, this engine prefills through {prompt_graph}"
    if model is None or model.sha256 != info.model_sha256:
        return "made for a different model file"
    if manifest.model is None:
        return "the bundle has no decoder"
    if info.kv_dtype != manifest.model.kv_dtype:
        return f"KV dtype {info.kv_dtype}, the model's is {manifest.model.kv_dtype}"
    return None


def system_prompt_prefixes(tokenizer: Tokenizer, system_prompt: str) -> list[tuple[int, ...]]:
    """What is worth pinning for a system prompt: its block alone, then also the opening of the user turn.

    The second is what every chat with this system prompt and a user turn shares (the tokens two unlike
    user turns have in common, e.g. `<|im_start|>user\n`): a first request then prefills only its own
    words. The first stays for chats that go on with another role; the prefix cache takes the longest
    pin that matches, and matching is by token ids, so a tokenization that differs only misses.
    """
    system = [{"role": "system", "content": system_prompt}]
    alone = tuple(tokenizer.encode(tokenizer.apply_chat_template(system, add_generation_prompt=False)))
    turns = [
        tokenizer.encode(tokenizer.apply_chat_template([*system, {"role": "user", "content": text}]))
        for text in ("Hi", "42 ?")
    ]
    with_turn = tuple(turns[0][: common_prefix_length(turns)])
    return [alone, with_turn] if len(with_turn) > len(alone) and with_turn[: len(alone)] == alone else [alone]


def read_snapshot_info(manifest: Manifest) -> SnapshotInfo | None:
    if manifest.snapshot is None:
        return None
    try:
        return SnapshotInfo.from_json(manifest.snapshot)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the manifest's snapshot section is malformed: {exc!r}") from exc


def restore_snapshot(engine: Engine, bundle: Bundle) -> RestoreResult:
    """Pin every compatible prefix of the bundle's snapshot in `engine`'s prefix cache.

    Anything wrong (another ORT version or provider, a malformed section, an array of the wrong
    shape) is logged as a warning and the snapshot is skipped: the engine computes instead.
    """
    import onnxruntime

    try:
        info = read_snapshot_info(bundle.manifest)
    except ValueError as exc:
        return _ignored(str(exc))
    if info is None:
        return RestoreResult((), ignored="the bundle has no snapshot")
    reason = incompatibility(info, bundle.manifest, onnxruntime.__version__, engine.provider, engine.prompt_graph_file)
    if reason is not None:
        return _ignored(reason)
    restored: list[PrefixSnapshot] = []
    for prefix in info.prefixes:
        try:
            # Mapped, not read: pinning copies nothing, and a request copies only the pages it loads.
            kv = np.load(bundle.file(prefix.file), mmap_mode="r", allow_pickle=False)
            engine.pin_prefix(prefix.token_ids, kv)
        except (OSError, ValueError) as exc:
            log.warning("ignoring snapshot prefix %r: %s; it will be computed instead", prefix.name, exc)
            continue
        restored.append(prefix)
    return RestoreResult(tuple(restored))


def _ignored(reason: str) -> RestoreResult:
    log.warning("ignoring the bundle's cold-start snapshot: %s; prefixes will be computed instead", reason)
    return RestoreResult((), ignored=reason)
