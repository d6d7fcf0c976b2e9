"""Spec → `python -m runtime serve` flags: the packager↔runtime contract every target and image uses."""

from __future__ import annotations

from pathlib import Path

from packager.spec import FunctionSpec

ADAPTER_DIR_FLAG = "--adapter-dir"


def server_flags(spec: FunctionSpec) -> list[str]:
    """The `python -m runtime serve` flags that carry the spec's runtime and endpoint settings.

    The runtime never reads function.toml (it never imports the packager): every target passes these.
    """
    rt, endpoint = spec.runtime, spec.endpoint
    flags = [
        "--model-name", spec.name,
        "--max-batch", str(rt.max_batch),
        "--max-queue", str(rt.max_queue),
        "--kv-memory-mb", str(rt.kv_memory_mb),
        "--prefix-cache-mb", str(rt.prefix_cache_mb),
        "--prefill-chunk", str(rt.prefill_chunk),
        "--threads", str(rt.threads),
        "--spin" if rt.spin else "--no-spin",
        "--decode", rt.decode,
        "--prefill-matmuls", rt.prefill_matmuls,
        "--providers", ",".join(rt.providers),
        "--temperature", str(rt.sampling.temperature),
        "--top-p", str(rt.sampling.top_p),
        "--max-tokens", str(rt.sampling.max_tokens),
        "--max-tokens-limit", str(endpoint.max_tokens),
    ]  # fmt: skip
    if endpoint.max_prompt_tokens is not None:
        flags += ["--max-prompt-tokens", str(endpoint.max_prompt_tokens)]
    if rt.system_prompt:
        flags += ["--system-prompt", rt.system_prompt]
    if spec.adapters or spec.export.adapter_modules:  # only then: other functions' commands (and snapshots) stay
        flags += ["--max-adapters", str(rt.max_adapters)]
    return flags


def adapter_flags(adapter_dir: Path) -> list[str]:
    """For a bundle whose graph takes LoRA adapters: where adapters added at run time are kept (they survive a
    restart there)."""
    return [ADAPTER_DIR_FLAG, str(adapter_dir)]


def adapter_dir_of(command: tuple[str, ...] | list[str]) -> Path | None:
    """The `--adapter-dir` a server was started with, None when it has none."""
    if ADAPTER_DIR_FLAG in command[:-1]:
        return Path(command[list(command).index(ADAPTER_DIR_FLAG) + 1])
    return None
