"""The bench's models at the sizes users deploy: synthetic GGUFs of published shapes, each built by `pkg build`.

`synthetic-1b` is Llama-3.2-1B's shape, `synthetic-8b` Llama-3.1-8B's (packager/synthetic: real shapes and
llama.cpp type mixes, seeded random weights, the demo's tokenizer). The bench writes a function for the file
(`build/NAME/function/function.toml`: precision `gguf`, the quality gate set for random weights), and builds it
with `pkg build --json` in a fresh cache while it samples the resident memory of the build's whole process tree,
so every step of the build is measured (none reused). The build's figures are kept beside the bundle
(`build/NAME/build.json`) and reported again while that bundle is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packager.bench.machine import ContentionMeter
from packager.memory import run_sampled
from packager.sources.gguf_metadata import read_metadata
from packager.spec import FunctionSpec, load_spec
from packager.synthetic import synthetic_gguf
from runtime.bundle import read_manifest

# The build's memory bound (issue 48): a fixed allowance plus twice the largest tensor in float32.
BASE_BOUND_BYTES = 2.5e9
# Random weights give near-uniform logits, where any rounding flips near-ties between tokens: the default gate
# (top-1 0.95) measures nothing about a random model, so the gate is explicit (tests/packager/test_build_at_size.py
# uses the same). Quality is judged on the real small models; these figures are speed, memory and bytes.
QUALITY_GATE = {"min_top1_agreement": 0.5, "max_mean_kl": 0.5, "max_perplexity_increase_pct": 50.0}
MAX_CONTEXT = 1024  # every at-size figure fits it (512-token prefill, 32 + 128 decode); the KV pool is sized by it
MAX_BATCH = 8
RECORD = "build.json"


class SyntheticModelError(RuntimeError):
    """A synthetic model could not be built for the bench; the message says why and where the log is."""


@dataclass(frozen=True)
class SyntheticModel:
    name: str  # the bench's --model
    config: str  # packager.synthetic's published config
    time_target_s: float | None  # the build's time target on this machine (issue 48: 8B <= 15 min), None: none


MODELS = {
    "synthetic-1b": SyntheticModel("synthetic-1b", "llama-3.2-1b", None),
    "synthetic-8b": SyntheticModel("synthetic-8b", "llama-3.1-8b", 15 * 60.0),
}


@dataclass(frozen=True)
class Prepared:
    model: SyntheticModel
    mix: str
    gguf: Path
    spec: FunctionSpec
    bundle: Path
    build: dict[str, Any] | None  # the record of the build that wrote `bundle`; None where none was kept


def function_toml(model: SyntheticModel, gguf: Path, threads: int) -> str:
    gate = "".join(f"{key} = {value}\n" for key, value in QUALITY_GATE.items())
    return (
        f"# Written by scripts/bench.py --model {model.name}: {model.config}'s shape, random weights.\n"
        f'name = "{model.name}"\n\n[model]\nsource = "gguf:{gguf}"\ntask = "completion"\n\n'
        f'[export]\nprecision = "gguf"\nmax_context = {MAX_CONTEXT}\n\n'
        "# Random weights: near-flat logits, so the default gate (top-1 0.95) says nothing here.\n"
        f"[export.quality]\n{gate}\n"
        f"[runtime]\nmax_batch = {MAX_BATCH}\nthreads = {threads}\n"
    )


def write_function(repo: Path, model: SyntheticModel, gguf: Path, threads: int) -> Path:
    """`build/NAME/function/` holding the function.toml for `gguf` (rewritten only when it changes)."""
    folder = repo / "build" / model.name / "function"
    folder.mkdir(parents=True, exist_ok=True)
    text = function_toml(model, gguf, threads)
    path = folder / "function.toml"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return folder


def largest_tensor_fp32_bytes(gguf: Path) -> int:
    """Bytes of the file's largest tensor in float32 (the embedding, at these shapes)."""
    return 4 * max(tensor.elements for tensor in read_metadata(gguf).tensors.values())


def memory_bound(gguf: Path) -> float:
    return BASE_BOUND_BYTES + 2 * largest_tensor_fp32_bytes(gguf)


def run_build(repo: Path, function_dir: Path, log_path: Path, interval: float = 0.05) -> dict[str, Any]:
    """`pkg build --json function_dir` in a fresh cache (every step measured, nothing reused) while the resident
    memory of its process tree is sampled; the build's report with the bench's own figures beside it."""
    scratch = Path(tempfile.mkdtemp(prefix="cache-", dir=function_dir.parent))
    env = {**os.environ, "ONNXFN_CACHE_DIR": str(scratch)}
    command = [sys.executable, "-m", "packager.cli", "build", "--json", str(function_dir)]
    contention = ContentionMeter()
    load_start = os.getloadavg()[0]
    try:
        with log_path.open("w") as log, tempfile.TemporaryFile("w+") as out:
            # The builder and the verifier run in children of the build: the whole tree is sampled.
            run = run_sampled(command, cwd=repo, env=env, stdout=out, stderr=log, interval=interval)
            out.seek(0)
            stdout = out.read()
    finally:
        # The bundle's files are hard links into the cache's export: removing the cache leaves them whole.
        shutil.rmtree(scratch, ignore_errors=True)
    if run.returncode != 0:
        tail = log_path.read_text(errors="replace")[-1500:]
        raise SyntheticModelError(f"`pkg build {function_dir}` failed (exit {run.returncode}); {log_path}:\n{tail}")
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),  # when it finished
        "command": " ".join(["ONNXFN_CACHE_DIR=<fresh>", "pkg", "build", "--json", str(function_dir)]),
        "wall_s": run.seconds,
        "peak_tree_rss_bytes": run.peak_rss,  # sampled every `interval` s, the build's own process included
        "load_average_start": load_start,
        "load_average_end": os.getloadavg()[0],
        "others_cpu_share": contention.others_share(),
        "report": json.loads(stdout),
    }


def prepare(repo: Path, name: str, mix: str, threads: int, bundle: Path | None, rebuild: bool) -> Prepared:
    """The synthetic GGUF (generated once, cached), its function, and its bundle: `bundle` as given, else the one
    the bench built before (if its record matches this GGUF), else built now by `pkg build`."""
    model = MODELS[name]
    print(f"bench: synthetic GGUF {model.config} ({mix})", flush=True)
    gguf = synthetic_gguf(model.config, mix)
    function_dir = write_function(repo, model, gguf, threads)
    spec = load_spec(function_dir)
    if bundle is not None:
        if not (bundle / "manifest.json").is_file():
            raise SyntheticModelError(f"--bundle {bundle} is not a bundle: it has no manifest.json")
        return Prepared(model, mix, gguf, spec, bundle, None)
    built = repo / "build" / model.name / "bundle"
    record_path = repo / "build" / model.name / RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else None
    if rebuild or not reusable(built, record, gguf):
        print(f"bench: pkg build {function_dir} (fresh cache; log build/{model.name}/build.log)", flush=True)
        record = run_build(repo, function_dir, repo / "build" / model.name / "build.log")
        record["gguf"] = str(gguf)
        record["bound_bytes"] = memory_bound(gguf)
        record["time_target_s"] = model.time_target_s
        record_path.write_text(json.dumps(record, indent=2) + "\n")
    return Prepared(model, mix, gguf, spec, built, record)


def reusable(bundle: Path, record: dict[str, Any] | None, gguf: Path) -> bool:
    """The bundle the recorded build wrote, from this GGUF, still there unchanged."""
    if record is None or record.get("gguf") != str(gguf) or not (bundle / "manifest.json").is_file():
        return False
    return bool(read_manifest(bundle).digest == record["report"]["digest"])
