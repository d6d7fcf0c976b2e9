"""The bench at the sizes users deploy: `scripts/bench.py --model synthetic-1b|synthetic-8b`.

onnxfn against llama.cpp (llama-cpp-python in-process, and its OpenAI server) on the same synthetic GGUF of a
published shape (synthetic_models.py), every pair in the same run, interleaved round by round (BENCHMARKS.md):

- decode at batch 1 and each system's share of the read-bandwidth limit; prefill of a 512-token prompt (in-process:
  onnxfn's engine and llama-cpp-python, one pair of workers);
- 8 concurrent HTTP streams (onnxfn's server and llama_cpp.server, a second pair, started once the first is gone:
  an 8B model's four processes would not fit this machine's memory together), with each server's resident memory
  beside the bytes it must hold (GGUF + KV pool);
- a fresh start, exec to first token (page cache warm): onnxfn's server and engine against llama-cpp-python; and
  onnxfn's server woken from the `local` target's process snapshot (CRIU): the dump's size, wake to first token;
- where one decode step's time goes by kind of node (node_profile.py), beside the demo bundle's;
- the build: `pkg build`'s steps, time and peak RSS of the process tree against the bound;
- shipping (shipping.py): `pkg image build --push`, `pkg image push` and `pkg push` of the bundle, each one's time
  and peak RSS against the same bound.

The transformers baseline and the onnxruntime-genai int4/int8 exports are not run at these sizes: each needs the
model whole in float32 (an 8B folder is 32 GB, more than this machine's memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from packager.bench import coldstart, footprint, machine, sections, shipping
from packager.bench import synthetic_models as models
from packager.bench.at_size_report import render
from packager.bench.pool import Worker, WorkerError
from packager.bench.prompts import PromptFactory
from packager.bench.systems import PROCESS_SNAPSHOT
from packager.bench.systems.base import SystemConfig
from packager.decoder_facts import decoder_facts
from packager.paths import bundle_dir
from packager.processes import precompile_runtime
from runtime.bundle import read_manifest

IN_PROCESS = ("onnxfn", "llamacpp")
SERVERS = ("onnxfn-http", "llamacpp-server")
COLD = ("onnxfn-http", "onnxfn", "llamacpp")  # onnxfn's server as deployed, its engine, and llama-cpp-python
# New tokens per decode run and per stream of the 8: ~10-40 s a run at these sizes on 2 cores (llama_cpp.server
# serves the 8 streams one after another).
DECODE_TOKENS = {"synthetic-1b": 128, "synthetic-8b": 64}
STREAM_TOKENS = {"synthetic-1b": 32, "synthetic-8b": 16}
SECTIONS = ("decode", "prefill", "concurrency", "cold", "profile", "build", "ship")
PREFILL_LENGTH = 512
STREAMS = 8
PROFILE_ROUNDS = 3
DEMO = "smollm2-chat"  # the demo function, whose bundle the profile compares with


def plan_for(name: str, quick: bool, rounds: int | None) -> sections.Plan:
    plan = sections.Plan(
        repetitions=rounds or (2 if quick else 5),
        decode_prompt=32,
        decode_tokens=16 if quick else DECODE_TOKENS[name],
        prefill_lengths=(PREFILL_LENGTH,),
        concurrency_levels=(STREAMS,),
        concurrency_prompt=32,
        concurrency_tokens=8 if quick else STREAM_TOKENS[name],
    )
    return plan


def system_config(prepared: models.Prepared, system: str, threads: int) -> SystemConfig:
    # transformers never runs here: no HF folder is made (an 8B fp32 folder is 32 GB)
    return SystemConfig(
        system, str(prepared.bundle), str(prepared.gguf), "", threads, models.MAX_BATCH, sys.executable,
        max_context=models.MAX_CONTEXT,
    )  # fmt: skip


def artifacts(bundle: Path, gguf: Path) -> dict[str, footprint.Artifact]:
    """What each system reads: onnxfn's bundle (its graph's weights, its KV dtype), llama.cpp the GGUF (f16 KV)."""
    mine = footprint.bundle_artifact(bundle)
    facts = decoder_facts(read_manifest(bundle))
    kv_f16 = 2 * facts.num_layers * facts.num_kv_heads * facts.head_dim * 2
    size = gguf.stat().st_size
    peer = footprint.Artifact(f"GGUF {gguf.name}", size, size, kv_f16)
    return {"onnxfn": mine, "onnxfn-http": mine, "llamacpp": peer, "llamacpp-server": peer}


def measure_pair(
    configs: list[SystemConfig], prompts: PromptFactory, plan: sections.Plan, which: tuple[str, ...]
) -> dict[str, Any]:
    """One pair of long-lived workers, interleaved through `which` sections; RSS as loaded and after them all."""
    out: dict[str, Any] = {"load_s": {}, "start_errors": {}, "rss": {}}
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as log_dir:
        workers: list[Worker] = []
        for config in configs:
            try:
                workers.append(Worker(config, Path(log_dir)))
            except (WorkerError, OSError) as exc:  # a system that cannot start: a row with its reason
                out["start_errors"][config.system] = f"failed to start: {exc}"
        try:
            out["load_s"] = {w.name: w.load_s for w in workers}
            loaded = {w.name: w.memory() for w in workers}
            for section in which:
                print(f"bench: {section} ({', '.join(w.name for w in workers)})", flush=True)
                out[section] = getattr(sections, f"measure_{section}")(workers, prompts, plan)
            out["rss"] = {w.name: rss_of(loaded[w.name], w.memory()) for w in workers}
        finally:
            for worker in workers:
                worker.close()
    return out


def rss_of(loaded: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    return {"loaded_rss_mib": loaded["rss_mib"], "rss_mib": after["rss_mib"], "peak_rss_mib": after["peak_rss_mib"]}


def kv_pool_bytes(config: SystemConfig) -> int:
    """onnxfn's KV pool as the bench sizes it: every slot holds the whole context (systems/server.py)."""
    from packager.bench.systems.server import kv_budget_mib

    return kv_budget_mib(config) << 20


def measure_profile(bundle: Path, threads: int, rounds: int, repo: Path) -> dict[str, Any]:
    """node_profile.py on this model's bundle and the demo's, alternating, `rounds` times each."""
    demo = repo / bundle_dir_of(repo, DEMO)
    bundles = {"this model": bundle, "demo (SmolLM2-135M, Q4_1)": demo} if demo.is_dir() else {"this model": bundle}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in bundles}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for label, path in bundles.items():
            if label in errors:
                continue
            machine.wait_until_quiet()
            command = [sys.executable, "-m", "packager.bench.node_profile", str(path), "--threads", str(threads)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                errors[label] = done.stderr.strip()[-600:]
            else:
                runs[label].append(json.loads(done.stdout))
    out: dict[str, Any] = {label: {"error": message} for label, message in errors.items()}
    for label, samples in runs.items():
        if samples and label not in errors:
            out[label] = {"bundle": str(bundles[label]), "runs": samples}
    return out


def bundle_dir_of(repo: Path, function: str) -> Path:
    from packager.spec import load_spec

    return bundle_dir(load_spec(repo / "functions" / function))


def main(args: argparse.Namespace, repo: Path) -> int:
    started = time.monotonic()
    contention = machine.ContentionMeter()
    precompile_runtime()
    chosen = [s for s in args.sections if s in SECTIONS]
    prepared = models.prepare(repo, args.model, args.mix, args.threads, args.bundle, args.rebuild)
    plan = plan_for(args.model, args.quick, args.rounds)
    configs = {system: system_config(prepared, system, args.threads) for system in (*IN_PROCESS, *SERVERS)}
    from packager.bench.systems.llamacpp import gguf_tokenizer  # its server tokenizes text: windows round-trip there

    prompts = PromptFactory(prepared.bundle / "tokenizer.json", [gguf_tokenizer(str(prepared.gguf))])
    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "monotonic_start": started,
            "load_average_start": os.getloadavg()[0],
            "load_averages": [],
            "others_cpu_share": 0.0,
            "quick": args.quick,
            "threads": args.threads,
            "plan": plan.__dict__,
            "model": args.model,
            "published_config": prepared.model.config,
            "mix": prepared.mix,
            "function": str(prepared.spec.directory),
            "bundle": str(prepared.bundle),
            "gguf": str(prepared.gguf),
            "prompt_source": str(prompts.source),
            "machine": machine.machine_facts(),
            "max_context": models.MAX_CONTEXT,
            "quality_gate": models.QUALITY_GATE,
        },
        "build": prepared.build,
    }
    print(f"bench: {args.model}, bundle {prepared.bundle}, sections {', '.join(chosen)}", flush=True)
    save = lambda: write(results, args.out, contention)  # noqa: E731 - after every section: a dead run keeps its figures

    bandwidth = machine.read_bandwidth(repetitions=3 if args.quick else 5, threads=args.threads)
    found = artifacts(prepared.bundle, prepared.gguf)
    results["machine"] = {
        "read_bandwidth_bytes_s": bandwidth,
        "interpreter_start_s": machine.interpreter_start(sys.executable, repetitions=5),
    }
    results["artifacts"] = {name: a.__dict__ for name, a in found.items()}
    results["kv_pool_bytes"] = kv_pool_bytes(configs["onnxfn-http"])
    in_process = [s for s in ("decode", "prefill") if s in chosen]
    if in_process:
        pair = measure_pair([configs[s] for s in IN_PROCESS], prompts, plan, tuple(in_process))
        results.update({key: pair[key] for key in in_process if key in pair})
        results["in_process"] = {key: pair[key] for key in ("load_s", "start_errors", "rss")}
        note_load(results)
        save()
    if "decode" in results:
        context = plan.decode_prompt + plan.decode_tokens / 2
        results["limit"] = {
            "bandwidth_bytes_s": max(bandwidth.values()),
            "mean_decode_context": context,
            "systems": footprint.bandwidth_limits(
                found, max(bandwidth.values()), context, results["decode"]["systems"]
            ),
        }
    if "concurrency" in chosen:
        pair = measure_pair([configs[s] for s in SERVERS], prompts, plan, ("concurrency",))
        results["concurrency"] = pair.get("concurrency", {"levels": [], "systems_by_level": {}})
        results["servers"] = {key: pair[key] for key in ("load_s", "start_errors", "rss")}
        note_load(results)
        save()
    if "cold" in chosen:
        print("bench: cold start (page cache warm)", flush=True)
        text = prompts.take(plan.decode_prompt).text
        warm = coldstart.measure_cold([configs[s] for s in COLD], text, plan.repetitions, drop_cache=False)
        print("bench: wake from a process snapshot (CRIU: dump once, restore to first token)", flush=True)
        snapshot = coldstart.measure_process_snapshot(configs["onnxfn-http"], text, plan.repetitions)
        warm["systems"][PROCESS_SNAPSHOT] = snapshot
        floor = footprint.cold_floor(found["onnxfn"], max(bandwidth.values()),
                                     results["machine"]["interpreter_start_s"])  # fmt: skip
        reason = "not measured at size: every start would re-read the whole model from disk on a machine others share"
        results["cold"] = {"warm_cache": warm, "dropped_cache": {"skipped": reason}, "floor_s": floor}
        note_load(results)
        save()
    if "profile" in chosen:
        print("bench: decode step by kind of node (ONNX Runtime's profiler)", flush=True)
        results["profile"] = measure_profile(prepared.bundle, args.threads, 2 if args.quick else PROFILE_ROUNDS, repo)
        note_load(results)
    if "ship" in chosen:
        print("bench: shipping the bundle (pkg image build --push, pkg image push, pkg push)", flush=True)
        bound = models.memory_bound(prepared.gguf)
        results["shipping"] = shipping.measure_shipping(repo, prepared.spec, prepared.bundle, bound, args.threads)
        note_load(results)
    save()
    print(f"bench: wrote {args.out / 'results.md'} in {results['meta']['duration_s']:.0f} s", flush=True)
    return 0


def note_load(results: dict[str, Any]) -> None:
    """The 1-minute load average after each section: how busy the shared machine was while it ran."""
    results["meta"]["load_averages"].append(round(os.getloadavg()[0], 2))


def write(results: dict[str, Any], out: Path, contention: machine.ContentionMeter) -> None:
    results["meta"]["duration_s"] = time.monotonic() - results["meta"]["monotonic_start"]
    results["meta"]["others_cpu_share"] = contention.others_share()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(render(results))
