"""The engine's settings, in a module of their own so a frontend can build them without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # slots
    max_queue: int = 64
    kv_memory_bytes: int = 512 << 20
    prefix_cache_bytes: int = 128 << 20
    prefill_chunk: int = 64  # prompt tokens per chunk; how many chunks a step takes: `scheduler.prefill_budget`
    max_context: int | None = None  # None = manifest context_length, clamped by the KV budget
    threads: int = 2
    providers: tuple[str, ...] = ("cpu",)
    # ORT's intra-op threads spin between the ops of one run (never after it returns: force_spinning_stop).
    # Measured on 2 idle cores: +6 % decode at batch 1 and at 8 streams; with another busy process on the
    # same cores, -40 %: set `spin = false` (`--no-spin`) where the function shares its CPUs.
    allow_spinning: bool = True
    prefix_block_size: int = 32
    # Run prompts through one of the bundle's prefill graphs (logits of each prompt's last position only)
    # when it has them and the first provider is the CPU: ~25 % of prefill compute is lm_head's otherwise.
    prefill_graph: bool = True
    # Which of the bundle's prefill graphs prompts run through (engine/graphs.py). `auto`: the quantized one
    # (the model's int8 matmuls) on a CPU with int8 dot products, where it prefills 1.2-1.3x faster than fp32
    # matmuls and needs no fp32 copy of the weights; the fp32 one elsewhere (2.6x faster than int8 on AVX2).
    prefill_matmuls: Literal["auto", "fp32", "quantized"] = "auto"
    # What decoding runs through. `latency`: the int8 graph, the fastest single stream (memory-bound). On
    # an AVX2 CPU without VNNI its int8 matmuls gain little from more rows (step 16 ms at batch 1, 88 at 8).
    # `throughput`: the prefill graph (fp32 matmuls on the same weights) runs prompts and decoding alike
    # (26 ms at batch 1, 57 at 8): for functions that serve several streams at once. Either way one graph
    # decodes every batch size, so a greedy request gets the same tokens alone and in a batch.
    decode: Literal["latency", "throughput"] = "latency"
    # Ready as soon as the decode graph is loaded; the prefill graph loads after, once the engine has been
    # quiet for `background.QUIET_S` (a first request runs without the build beside it), and until it is in use
    # prompts run through the decode graph (same weights, int8 activations) and are not prefix-cached.
    # Servers start this way (a cold start waits for one session instead of two); in-process users get a
    # fully loaded engine by default.
    defer_prefill_graph: bool = False
    # Once the sessions are built, a background thread moves the graphs' weights onto 2 MiB pages
    # (engine/huge_pages.py): +12 % batch-1 decode and -20 % time to first token measured, no more memory.
    # Linux 6.1+ only.
    huge_pages: bool = True
    # A directory of this bundle's graphs with their weights packed for this CPU (engine/prepacked.py): the
    # packed weights are memory-mapped from there instead of packed onto the heap at every start.
    prepacked: Path | None = None
    # Where graphs derived from the bundle are written and read (engine/derived.py: a quantized bundle's fp32
    # prefill graph weights); None: `$ONNXFN_STATE_DIR/derived/DIGEST`.
    derived: Path | None = None
    # Prompt-lookup speculative decoding for greedy requests (engine/speculative.py): up to
    # `speculative_tokens` drafted tokens verified per decode forward.
    speculative: bool = False
    speculative_tokens: int = 3
    # Constrained decoding's budget (engine/grammar_cache.py): compiled grammars are kept up to
    # `grammar_cache_bytes` (measured per grammar, least recently used evicted first); one grammar measuring
    # more than `grammar_max_bytes` is refused with a 400, as is one a request waits on longer than
    # `grammar_compile_s` to compile.
    grammar_cache_bytes: int = 128 << 20
    grammar_max_bytes: int = 32 << 20
    grammar_compile_s: float = 5.0
    # LoRA adapters (a bundle whose graph takes them): how many are resident at once (each request holds its
    # adapter's slot while it runs; idle ones are evicted least recently used first), and the directory adapters
    # added while the server runs are kept in (None: none can be added).
    max_adapters: int = 4
    adapter_dir: Path | None = None
