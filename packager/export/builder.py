"""Export a decoder LLM with onnxruntime-genai's model builder, one precision per call, cached.

The builder emits the fused graph we serve (GroupQueryAttention with rotary embedding inside,
SkipSimplifiedLayerNormalization, one fused QKV MatMulNBits for int8/int4), so our code chooses and
checks its options instead of building graphs. It runs in a subprocess: it imports torch, holds
the whole fp32 model in memory, and prints a lot; its log is kept beside the export.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from packager.cache import cached_dir, digest_of, read_json, write_json
from packager.errors import UserError
from packager.export.architectures import SUPPORTED_DECODERS, check_config
from runtime.bundle import file_digest

EXPORT_VERSION = 2  # bump when the options below change meaning, to invalidate cached exports
LOG_NAME = "builder.log"
DIGESTS_NAME = "digests.json"


@dataclass(frozen=True)
class ExportOptions:
    precision: str  # fp32 | int8 | int4
    block_size: int = 32
    accuracy_level: int = 4
    # `is_symmetric=false` produced a model that does not load here (FIELD-NOTES), so it is not offered.

    def builder_args(self) -> list[str]:
        # Sliding-window layers get a full-length KV cache like every other layer (GroupQueryAttention's
        # `local_window_size` still windows their attention): the runtime binds one
        # `[slots, kv_heads, max_context, head_dim]` buffer per layer, and its prefix cache and
        # snapshots index that buffer by position, which a window-sized ring cannot offer.
        extra = ["windowed_kv_cache=false"]
        if self.precision in ("int8", "int4"):
            extra += [f"block_size={self.block_size}", f"accuracy_level={self.accuracy_level}"]
        return ["-p", self.precision, "-e", "cpu", "--extra_options", *extra]


@dataclass(frozen=True)
class ExportResult:
    directory: Path  # model.onnx, model.onnx.data, genai_config.json, tokenizer files
    options: ExportOptions
    key: str
    reused: bool
    digests: dict[str, dict[str, int | str]]  # file name -> {sha256, size}


def check_architecture(hf_dir: Path) -> str:
    config = json.loads((hf_dir / "config.json").read_text())
    architecture = (config.get("architectures") or ["<none>"])[0]
    if architecture not in SUPPORTED_DECODERS:
        raise UserError(
            f"{hf_dir}/config.json declares architecture {architecture!r}, which onnxfn cannot export yet; "
            f"supported: {', '.join(sorted(SUPPORTED_DECODERS))}",
            exit_code=2,
        )
    check_config(config, f"{hf_dir}/config.json")
    return SUPPORTED_DECODERS[architecture]


def export_decoder(hf_dir: Path, source_key: str, options: ExportOptions) -> ExportResult:
    builder_version = metadata.version("onnxruntime-genai")
    key = digest_of("export", EXPORT_VERSION, source_key, asdict(options), builder_version)

    def produce(out: Path) -> None:
        _run_builder(hf_dir, out, options)
        digests = {p.name: file_digest(p).__dict__ for p in sorted(out.iterdir()) if p.name != LOG_NAME}
        write_json(out / DIGESTS_NAME, digests)

    directory, reused = cached_dir("export", key, produce)
    return ExportResult(directory, options, key, reused, read_json(directory / DIGESTS_NAME))


def _run_builder(hf_dir: Path, out: Path, options: ExportOptions) -> None:
    cache = out / ".builder-cache"
    # Our entry point for the builder: its command line, with the config adapted (genai_builder.py).
    command = [sys.executable, "-m", "packager.export.genai_builder", "-i", str(hf_dir), "-o", str(out)]
    command += ["-c", str(cache), *options.builder_args()]
    log_path = out.parent / f"{out.name}.{LOG_NAME}"
    with log_path.open("w") as log:
        # HF_HUB_OFFLINE: the builder must read only the local folder, never reach for a hub.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    log_text = log_path.read_text(errors="replace")
    log_path.unlink()
    (out / LOG_NAME).write_text(log_text)
    shutil.rmtree(cache, ignore_errors=True)
    if result.returncode != 0 or not (out / "model.onnx").is_file():
        tail = "\n".join(log_text.splitlines()[-15:])
        raise UserError(
            f"the ONNX export ({options.precision}) failed (exit {result.returncode}); builder log tail:\n{tail}"
        )
