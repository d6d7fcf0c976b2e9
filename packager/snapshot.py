"""The cold-start snapshot `pkg build` puts in a bundle: what the runtime would otherwise compute at start.

Kept, because measured to help (`pkg bench cold`): the KV cache of the spec's system prompt, computed by
the runtime's own engine on the bundle being written, so the first request using that prompt prefills
only what follows it. Measured and left out: an ORT graph pre-optimized for the CPU and loaded with
optimizations off (session creation no faster, decode slower), prepacked weights saved as external data
(+170 MB on disk for ~0.1 s of session creation), ORT-format models (no faster for builder graphs). The
weights already sit in external data that ONNX Runtime maps, and the tokenizer loads while the session
builds, so neither gains from a snapshot.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime

from packager.decoder_facts import decoder_facts
from packager.spec import FunctionSpec
from runtime.bundle import Bundle, FileEntry, Manifest, file_digest
from runtime.engine.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.snapshot import SNAPSHOT_DIR, SNAPSHOT_FORMAT, PrefixSnapshot, SnapshotInfo, system_prompt_prefixes

SNAPSHOT_VERSION = 3  # bump when what the snapshot holds changes, to rebuild bundles
SNAPSHOT_PROVIDER = "cpu"  # the KV is computed here, on the CPU: a GPU-first function gets no snapshot


def configured_prefixes(spec: FunctionSpec) -> list[tuple[str, str]]:
    """(name, system prompt text) of every prefix the spec asks the runtime to pre-warm."""
    prompt = spec.runtime.system_prompt
    return [("system_prompt", prompt)] if prompt else []


def add_snapshot(bundle_dir: Path, manifest: Manifest, spec: FunctionSpec) -> Manifest:
    """Write the snapshot files into `bundle_dir` (a bundle being assembled) and return the manifest listing them.

    Returns `manifest` unchanged when there is nothing to snapshot: no configured prefix, no chat
    template, or a function whose first execution provider is not the CPU.
    """
    prefixes = configured_prefixes(spec)
    if not prefixes or spec.runtime.providers[:1] != [SNAPSHOT_PROVIDER]:
        return manifest
    facts = decoder_facts(manifest)
    if facts.chat_template is None:
        return manifest
    config = EngineConfig(
        max_batch=1,
        max_context=facts.context_length,
        kv_memory_bytes=facts.context_length * facts.kv_bytes_per_token(),
        prefix_cache_bytes=0,
        threads=spec.runtime.threads,
        providers=(SNAPSHOT_PROVIDER,),
    )
    engine = Engine(Bundle(bundle_dir, manifest), config)
    (bundle_dir / SNAPSHOT_DIR).mkdir()
    files = dict(manifest.files)
    entries: list[PrefixSnapshot] = []
    for name, text in prefixes:
        nested = system_prompt_prefixes(engine.tokenizer, text)  # the system block, then with the user turn's opening
        kv = engine.compute_prefix(nested[-1])
        for entry_name, token_ids in zip((name, f"{name}_user_turn"), nested, strict=False):
            relative = f"{SNAPSHOT_DIR}/{entry_name}.npy"
            np.save(bundle_dir / relative, np.ascontiguousarray(kv[:, :, : len(token_ids)]), allow_pickle=False)
            files[relative] = file_digest(bundle_dir / relative)
            entries.append(PrefixSnapshot(entry_name, relative, token_ids))
    engine.shutdown()
    model: FileEntry = manifest.files[manifest.model_file]
    info = SnapshotInfo(
        format=SNAPSHOT_FORMAT,
        onnxruntime=onnxruntime.__version__,
        providers=(SNAPSHOT_PROVIDER,),
        prompt_graph=engine.prompt_graph_file,
        model_sha256=model.sha256,
        kv_dtype=facts.kv_dtype,
        prefixes=tuple(entries),
    )
    return replace(manifest, files=files, snapshot=info.to_json())
