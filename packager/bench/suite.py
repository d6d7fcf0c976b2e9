"""onnxfn's benchmark: onnxfn against onnxruntime-genai, llama.cpp and transformers, side by side.

    .venv/bin/python scripts/bench.py                  # the demo (smollm2): every section, every system
    .venv/bin/python scripts/bench.py --model gemma3   # Gemma-3-270M, written to bench/gemma3/
    .venv/bin/python scripts/bench.py --quick          # a smoke run: fewer rounds, fewer tokens
    # every figure the targets table reads, quickly (~1 min for smollm2, ~5 min for gemma3 on 2 busy cores):
    .venv/bin/python scripts/bench.py --quick --sections decode,concurrency,quality,memory \
        --systems onnxfn,onnxfn-http,genai-int8,genai-int4,llamacpp,llamacpp-server [--model gemma3]
    .venv/bin/python scripts/bench.py --sections decode --systems onnxfn,genai,ort-loop --rounds 30 --out bench/batch1
    # the Ray Serve target against the local gateway (packager/bench/ray_target.py), in bench/ray/:
    .venv/bin/python scripts/bench.py --sections ray --out bench/ray
    # the LoRA adapter rows alone (packager/bench/adapters.py), merged into the committed results.md / .json:
    .venv/bin/python scripts/bench.py --sections adapters --rounds 10
    .venv/bin/python scripts/bench.py --sections concurrency --systems onnxfn,onnxfn-http,genai,ort-loop \
        --rounds 20 --out bench/concurrency
    # at the sizes users deploy (packager/bench/at_size.py): synthetic GGUFs of Llama-3.2-1B's / Llama-3.1-8B's shape,
    # built by `pkg build` (figures kept; --rebuild measures a build again), against llama.cpp; bench/synthetic-*/:
    .venv/bin/python scripts/bench.py --model synthetic-1b [--mix q4_1] [--rebuild] [--sections decode,build]

--model picks the function (smollm2: functions/smollm2-chat, gemma3: functions/gemma3-completion); its
bundle is built by `pkg build` if missing, and its GGUF (llama.cpp), fp32 HF folder (transformers) and the
builder's int8 / int4 exports (genai-int8, genai-int4) come from the packager's resolution of its source.
Writes results.md and results.json to --out (default bench/ for smollm2, bench/MODEL/ otherwise). The method
is /work/shared/BENCHMARKS.md: same prompt tokens, same new-token count (EOS ignored), same threads,
warm-up excluded, interleaved rounds, medians. Install the peers first: scripts/setup_bench.sh.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if importlib.util.find_spec("aiohttp") is None:  # the client of every server figure; setup.sh does not install it
    sys.exit("bench: aiohttp is not installed: install the bench's peers first with scripts/setup_bench.sh")

from packager.bench import (
    adapters,
    at_size,
    coldstart,
    embeddings,
    footprint,
    gateway,
    machine,
    models,
    quality,
    ray_target,
    report,
    sections,
)
from packager.bench import synthetic_models as at_size_models
from packager.bench.models import GENAI_EXPORTS, BenchModel, ModelUnavailable
from packager.bench.pool import Worker, WorkerError
from packager.bench.prompts import PromptFactory, PromptsUsedUp
from packager.bench.systems import PROCESS_SNAPSHOT, REGISTRY
from packager.bench.systems.base import SystemConfig
from packager.errors import UserError
from packager.processes import precompile_runtime
from packager.synthetic import TYPE_MIXES
from runtime.bundle import open_bundle
from runtime.engine.config import EngineConfig
from runtime.engine.graphs import QUANTIZED_PREFILL_FILE, decodes_with_prefill_graph, prefill_graph_file

REPO = Path(__file__).resolve().parents[2]  # the checkout: functions/, build/ and bench/ are read and written there
DEFAULT_MODEL = "smollm2"  # the demo: its results are bench/results.md
SECTIONS = (
    "decode", "prefill", "concurrency", "cold", "quality", "memory", "embeddings", "gateway", "adapters", "ray",
)  # fmt: skip
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
    parser.add_argument(
        "--model", choices=(*models.MODELS, *at_size_models.MODELS), default=DEFAULT_MODEL, help="the model to bench"
    )
    parser.add_argument("--bundle", type=Path, help="bundle to serve (default: the function's, built if missing)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: fewer rounds, fewer tokens")
    parser.add_argument(
        "--sections", help=f"comma-separated subset of {SECTIONS} (synthetic-*: of {at_size.SECTIONS}); default all"
    )
    parser.add_argument(
        "--mix", choices=tuple(TYPE_MIXES), default="q4_k_m", help="synthetic-*: the GGUF's type mix (default q4_k_m)"
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="synthetic-*: build the bundle again (fresh cache): new build figures"
    )
    parser.add_argument("--systems", default=",".join(REGISTRY), help=f"comma-separated subset of {tuple(REGISTRY)}")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every system")
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds per figure (default 5, --quick 2); more narrow the intervals"
    )
    parser.add_argument("--out", type=Path, help="where results.md and results.json go (default: bench/[MODEL/])")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = REPO / "bench" if args.model == DEFAULT_MODEL else REPO / "bench" / args.model
    allowed = at_size.SECTIONS if args.model in at_size_models.MODELS else SECTIONS
    args.sections = _subset(parser, args.sections or ",".join(allowed), allowed, "--sections")
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


def available(systems: list[str], notes: list[str]) -> list[str]:
    """Systems whose libraries import here; the others are reported as missing, not silently dropped."""
    needs = {
        "onnxfn": "runtime.engine.engine",
        "onnxfn-http": "runtime.__main__",
        "onnxfn-http-throughput": "runtime.__main__",
        "genai": "onnxruntime_genai",
        "genai-int8": "onnxruntime_genai",
        "genai-int4": "onnxruntime_genai",
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
    if args.model in at_size_models.MODELS:  # a synthetic model of a published shape: its own sections and peers
        return at_size.main(args, REPO)
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = dataclasses.replace(plan, repetitions=args.rounds)
    started = time.monotonic()
    contention = machine.ContentionMeter()
    # As `pkg deploy` and `pkg bench cold` do before starting a server: measure the product's start, not
    # the compilation of the runtime's sources (Python never caches it under PYTHONDONTWRITEBYTECODE).
    precompile_runtime()
    notes: list[str] = []
    model = models.resolve(REPO, args.model, args.bundle)
    bundle = model.bundle
    systems = available(args.systems, notes)
    opened = open_bundle(bundle, verify=False)
    if (prompt_graph := prefill_graph_file(opened, EngineConfig())) is not None:
        matmuls = "the model's own quantized matmuls" if prompt_graph == QUANTIZED_PREFILL_FILE else "fp32 matmuls"
        decodes = prompt_graph if decodes_with_prefill_graph(opened, EngineConfig()) else "model.onnx"
        notes.append(
            f"onnxfn prefills prompts through the bundle's {prompt_graph} ({matmuls} on the same weights, logits of "
            f"each prompt's last position only: the prefill graph it picks on this CPU) and decodes through "
            f"{decodes}; onnxruntime-genai and ort-loop run model.onnx (the graph without that gather) for both, so "
            "their tokens may differ"
        )
    configs = [system_config(model, system, args.threads, max(plan.concurrency_levels)) for system in systems]
    others = []
    if "llamacpp-server" in systems:  # it takes text, tokenized by llama.cpp: windows must round-trip there too
        from packager.bench.systems.llamacpp import gguf_tokenizer

        others.append(gguf_tokenizer(str(model.gguf)))
    prompts = PromptFactory(bundle / "tokenizer.json", others)
    listing = f"systems {', '.join(systems)}, sections {', '.join(args.sections)}"
    print(f"bench: {model.name}, bundle {bundle}, {listing}", flush=True)

    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "monotonic_start": started,
            "load_average_start": os.getloadavg()[0],
            "others_cpu_share": 0.0,
            "quick": args.quick,
            "threads": args.threads,
            "plan": plan.__dict__,
            "model": model.name,
            "function": str(model.spec.directory),
            "bundle": str(bundle),
            "hf_dir": str(model.hf_dir),
            "gguf": str(model.gguf),
            "exports": {system: str(model.system_bundle(system)) for system in GENAI_EXPORTS},
            "prompt_source": str(prompts.source),
            "systems": systems,
            "machine": machine.machine_facts(),
            "notes": notes,
        }
    }
    if args.sections == ["adapters"]:  # alone: its rows join the committed results instead of replacing them
        return measure_adapters_alone(results, model, prompts, plan, args, contention)
    bandwidth = machine.read_bandwidth(repetitions=5 if not args.quick else 3, threads=args.threads)
    interpreter_s = machine.interpreter_start(sys.executable, repetitions=5)
    exports = {system: model.exports[precision] for system, precision in GENAI_EXPORTS.items()}
    found = footprint.artifacts(bundle, model.gguf, model.hf_dir, exports)
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
            "floor_s": footprint.cold_floor(found["onnxfn"], max(bandwidth.values()), interpreter_s),
        }
    if "memory" in args.sections:
        progress(started, "memory")
        results["memory"] = measure_memory(configs, prompts, plan)
    if "gateway" in args.sections:
        progress(started, "gateway")
        results["gateway"] = gateway.measure(model, prompts, plan)
        write_results(results, args.out, contention)
    if "ray" in args.sections:  # the `ray` target against the local gateway (packager/bench/ray_target.py)
        progress(started, "ray")
        results["ray"] = ray_target.measure(model, prompts, plan)
        write_results(results, args.out, contention)
    if "adapters" in args.sections:
        progress(started, "adapters")
        results["adapters"] = adapters.measure(model.spec.directory, model.hf_dir, bundle, prompts, plan, args.threads)
        write_results(results, args.out, contention)
    if "quality" in args.sections:
        progress(started, "quality")
        results["quality"] = quality.measure(model)

    write_results(results, args.out, contention)
    print(f"bench: wrote {args.out / 'results.md'} in {results['meta']['duration_s']:.0f} s", flush=True)
    return 0


def system_config(model: BenchModel, system: str, threads: int, max_batch: int) -> SystemConfig:
    folder = model.system_bundle(system)
    return SystemConfig(system, str(folder), str(model.gguf), str(model.hf_dir), threads, max_batch, sys.executable)


def progress(started: float, step: str) -> None:
    print(f"bench: [{time.monotonic() - started:5.0f} s] {step}", flush=True)


def write_results(results: dict[str, Any], out: Path, contention: machine.ContentionMeter) -> None:
    """Written after every section too, so a long run that dies still leaves what it measured."""
    results["meta"]["duration_s"] = time.monotonic() - results["meta"]["monotonic_start"]
    results["meta"]["others_cpu_share"] = contention.others_share()
    report.save(results, out)


def measure_adapters_alone(
    results: dict[str, Any],
    model: BenchModel,
    prompts: PromptFactory,
    plan: sections.Plan,
    args: argparse.Namespace,
    contention: machine.ContentionMeter,
) -> int:
    """`--sections adapters`: the section's figures (with their own run's facts) into the committed results."""
    progress(results["meta"]["monotonic_start"], "adapters")
    figures = adapters.measure(model.spec.directory, model.hf_dir, model.bundle, prompts, plan, args.threads)
    merged = adapters.merge(args.out, figures)
    if merged is None:  # nothing committed there yet: a results file of this run alone
        results["adapters"] = figures
        write_results(results, args.out, contention)
    else:
        report.save(merged, args.out)
    print(f"bench: wrote the adapters rows into {args.out / 'results.md'}", flush=True)
    return 0


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


def run() -> int:
    """`scripts/bench.py`'s entry: `main`, with the bench's own refusals as one line instead of a traceback."""
    try:
        return main()
    except (PromptsUsedUp, ModelUnavailable, at_size_models.SyntheticModelError, UserError) as exc:
        sys.exit(f"bench: {exc}")
