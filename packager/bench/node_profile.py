"""Where one decode step's time goes, by kind of node: ONNX Runtime's own profiler on the graph the engine decodes.

    python -m packager.bench.node_profile BUNDLE [--threads 2] [--prompt 32] [--steps 8]   # prints one JSON object

A GGUF type with a block minimum (Q4_1, Q4_K, ...) is carried as MatMulNBits plus a residual term per matmul (the
activations' block sums times the residual, packager/export/gguf/operators.py): nodes whose work does not grow with
the weights' bytes as the matmuls' does. At 1-8 B parameters a decode step reads far more weight bytes per node than
the demo's 135 M, so those nodes should weigh less there; this measures how much they weigh. One prompt runs first
(not counted), then `steps` single-token decode steps, each a run whose nodes' kernel times the profiler records; the
first decode step is a warm-up. The profiler's own bookkeeping adds a little to every node, the small ones most.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

# Kinds of node, first match wins: (kind, how a node is recognised by its op type or its name).
RESIDUAL = "GGUF residual (block sums, residual MatMul + Add)"
KINDS = (
    (RESIDUAL, lambda op, name: "/residual/" in name or "/block_sums/" in name),
    ("MatMulNBits (quantized weights)", lambda op, name: op == "MatMulNBits"),
    ("embedding (GatherBlockQuantized / Gather)", lambda op, name: op in ("GatherBlockQuantized", "Gather")),
    ("attention (GroupQueryAttention)", lambda op, name: op == "GroupQueryAttention"),
    ("norms", lambda op, name: "LayerNormalization" in op),
    ("other", lambda op, name: True),
)


def kind_of(op: str, name: str) -> str:
    return next(kind for kind, matches in KINDS if matches(op, name))


def split_by_kind(events: list[dict[str, Any]], skip_runs: int) -> dict[str, Any]:
    """Per decode step (the runs after the first `skip_runs`): its wall time and its nodes' kernel time by kind, the
    medians over the steps; from a profile's trace events (`model_run` per run, `NAME_kernel_time` per node)."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[skip_runs:]  # fmt: skip
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    steps = []
    for run in runs:
        start, end = run["ts"], run["ts"] + run["dur"]
        by_kind: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for node in nodes:
            if start <= node["ts"] <= end:
                kind = kind_of(node.get("args", {}).get("op_name", ""), node["name"].removesuffix("_kernel_time"))
                by_kind[kind] += node["dur"]
                counts[kind] += 1
        steps.append({"run_us": run["dur"], "kinds_us": dict(by_kind), "nodes": dict(counts)})
    if not steps:
        raise ValueError("the profile holds no decode run")
    kinds = sorted({kind for step in steps for kind in step["kinds_us"]}, key=[k for k, _ in KINDS].index)
    run_us = float(np.median([s["run_us"] for s in steps]))
    kinds_us = {kind: float(np.median([s["kinds_us"].get(kind, 0.0) for s in steps])) for kind in kinds}
    return {
        "steps": len(steps),
        "step_ms": run_us / 1000,
        "kinds_ms": {kind: us / 1000 for kind, us in kinds_us.items()},
        "kinds_share": {kind: us / run_us for kind, us in kinds_us.items()},
        "outside_nodes_ms": (run_us - sum(kinds_us.values())) / 1000,
        "nodes_per_step": steps[-1]["nodes"],
    }


def residual_bytes(graph: Path) -> dict[str, int]:
    """Bytes of the graph's weights, and of those only the residual term reads."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    total = residual = 0
    for tensor in model.graph.initializer:
        external = {entry.key: entry.value for entry in tensor.external_data}
        size = int(external["length"]) if "length" in external else tensor.ByteSize()
        total += size
        if tensor.name.endswith(".residual_t"):
            residual += size
    return {"weights_bytes": total, "residual_bytes": residual}


def profile_decode(bundle_path: Path, threads: int, prompt: int, steps: int) -> dict[str, Any]:
    import onnxruntime as ort

    from runtime.bundle import open_bundle
    from runtime.engine.config import EngineConfig
    from runtime.engine.graphs import decode_graph_path
    from runtime.engine.tables import inference_session

    bundle = open_bundle(bundle_path, verify=False)
    facts = bundle.manifest.decoder
    graph = decode_graph_path(bundle, EngineConfig(threads=threads))
    with tempfile.TemporaryDirectory(prefix="node-profile-") as scratch:
        options = ort.SessionOptions()  # the engine's options (session_build.create_session), plus the profiler
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(scratch) / "decode")
        session = inference_session(graph, options, ["CPUExecutionProvider"], bundle)
        context = prompt + steps
        io = facts.io
        binding = session.io_binding()
        cache = [np.zeros((1, facts.num_kv_heads, context, facts.head_dim), facts.kv_dtype)
                 for _ in io.cache_names(facts.num_layers)]  # fmt: skip
        for (past, present), buffer in zip(io.cache_names(facts.num_layers), cache, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(past, value)  # past and present share one buffer, as the engine binds them
            binding.bind_ortvalue_output(present, value)
        ones = np.ones((1, context), dtype=np.int64)
        tokens = np.random.default_rng(0).integers(0, facts.vocab_size, size=(1, prompt), dtype=np.int64)
        binding.bind_cpu_input(io.input_ids, tokens)
        binding.bind_cpu_input(io.attention_mask, ones[:, :prompt])
        binding.bind_output(io.logits, "cpu")
        session.run_with_iobinding(binding)
        for length in range(prompt + 1, prompt + steps + 1):
            binding.bind_cpu_input(io.input_ids, tokens[:, -1:])
            binding.bind_cpu_input(io.attention_mask, ones[:, :length])
            binding.bind_output(io.logits, "cpu")
            session.run_with_iobinding(binding)
        trace = json.loads(Path(session.end_profiling()).read_text())
    figures = split_by_kind(trace, skip_runs=2)  # the prompt's run and the first decode step
    return {"graph": graph.name, "threads": threads, "prompt": prompt, **figures, **residual_bytes(graph)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    json.dump(profile_decode(args.bundle, args.threads, args.prompt, args.steps), sys.stdout)
    print()


if __name__ == "__main__":
    main()
