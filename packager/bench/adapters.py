"""The LoRA adapter figures (issue 41): what serving adapters per row costs against the base alone.

    .venv/bin/python scripts/bench.py --sections adapters [--quick]

Run alone, the section's figures join the committed results.json / results.md beside the other sections'
instead of replacing them (`merge`).

Inputs, made once and cached under the packager's cache (`cache_root()/bench-adapters/`): 4 random PEFT
adapters on the bench model's HF folder (r=8 on q/k/v/o, seeds 0-3, `lora_B` scaled by 0.01 so each stays
inside the quality budget `pkg build` checks), and the bench function built again with those 4 `[[adapters]]`
by `build_function` (itself cached by content: exports, quality figures and the bundle).

Four engines, each in its own worker process, with the same prompts in interleaved rounds (one warm-up round,
then medians; each job on quiet cores):

- `base`: the bench's own bundle (its graph takes no adapter inputs): 1.00x.
- `0 adapters`: the adapter bundle, every row on the base (slot 0: the adapter path adds zeros).
- `1 adapter`: every row on adapter a0.
- `4 adapters`: the rows spread over a0-a3 (row i on a(i mod 4)), all 4 in every decode step.

Decode tok/s after each stream's first token (as the decode section), at batch 1 and summed over 8 concurrent
streams (beside their end-to-end aggregate, prefill included, as the concurrency section), each against `base`;
the issue's target is 8 streams over 4 adapters >= 0.85x.
Then each adapter's cold load into its slot (`engine.adapters.slots.loads`, the 4-adapter engine's first load
of each, in its warm-up round), the converted file's bytes in the bundle, its weights in memory, and one slot's
bytes (the graph's stacked inputs at its rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from packager.bench.machine import ContentionMeter
from packager.bench.pool import Worker, WorkerError, worker_env
from packager.bench.sections import Plan, decode_rate, interleave
from packager.bench.stats import median, median_interval

ADAPTERS = ("a0", "a1", "a2", "a3")
RANK = 8
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
B_SCALE = 0.01  # random adapters this small stay inside the function's quality budget
RECIPE = 1  # bump when the adapters' recipe changes, to make them again
FUNCTION = "bench-adapters"
STREAMS = 8
TARGET = 0.85  # issue 41: 8 streams over 4 adapters against the base alone
# row label -> (bundle: "base" or "adapters", the adapters its rows cycle through)
ROWS: dict[str, tuple[str, tuple[str, ...]]] = {
    "base": ("base", ()),
    "0 adapters": ("adapters", ()),
    "1 adapter": ("adapters", ADAPTERS[:1]),
    "4 adapters": ("adapters", ADAPTERS),
}
NOTE = (
    "onnxfn only: no other system here serves per-row adapters in one batch. onnxruntime-genai loads adapters "
    "but activates one per generator (a batch shares it); llama.cpp's server applies LoRA adapters per request "
    "but batches only requests with the same adapters together."
)


# --- inputs -----------------------------------------------------------------------------------------------------


def inputs_dir(hf_dir: Path) -> Path:
    from packager.cache import digest_of
    from packager.paths import cache_root

    return cache_root() / "bench-adapters" / digest_of("bench-adapters", RECIPE, hf_dir.name)[:24]


def make_adapters(hf_dir: Path, folder: Path) -> dict[str, Path]:
    """The 4 random PEFT adapters on `hf_dir`, made once (deterministic seeds) into `folder`/NAME."""
    made = {name: folder / name for name in ADAPTERS}
    missing = [name for name, path in made.items() if not (path / "adapter_model.safetensors").is_file()]
    if not missing:
        return made
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    for name in missing:
        torch.manual_seed(ADAPTERS.index(name))
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(MODULES), init_lora_weights=False)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for key, parameter in peft_model.named_parameters():
                if "lora_B" in key:
                    parameter.mul_(B_SCALE)
        partial = folder / f".{name}-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        peft_model.save_pretrained(str(partial))
        shutil.rmtree(made[name], ignore_errors=True)  # a folder an interrupted run left without its weights
        os.replace(partial, made[name])  # whole or not at all
    return made


def adapter_spec(source: str, adapters: dict[str, Path]) -> str:
    """The bench function's function.toml under another name, with the adapters declared."""
    text = re.sub(r"(?m)^name\s*=.*$", f'name = "{FUNCTION}"', source, count=1)
    declared = "".join(f'\n[[adapters]]\nname = "{name}"\nsource = "{path}"\n' for name, path in adapters.items())
    return text.rstrip("\n") + "\n" + declared


def adapter_bundle(spec_source: str, hf_dir: Path) -> Path:
    """The bench function with the 4 adapters, built by `build_function` (cached by content) beside the adapters."""
    from packager.build import build_function
    from packager.paths import bundle_dir
    from packager.progress import StepProgress
    from packager.spec import load_spec

    folder = inputs_dir(hf_dir)
    adapters = make_adapters(hf_dir, folder / "peft")
    function = folder / "functions" / FUNCTION
    function.mkdir(parents=True, exist_ok=True)
    text = adapter_spec(spec_source, adapters)
    if not (function / "function.toml").is_file() or (function / "function.toml").read_text() != text:
        (function / "function.toml").write_text(text)
    spec = load_spec(function)
    with contextlib.chdir(folder):  # the build writes build/NAME/bundle under the working directory
        build_function(spec, StepProgress())
    return folder / bundle_dir(spec)


# --- the engines, each in its own process -----------------------------------------------------------------------


class AdapterWorker(Worker):
    """An onnxfn engine in its own process (`python -m packager.bench.adapters CONFIG`) whose rows cycle through
    `adapters`; the same protocol as the bench's other workers, plus `loads`."""

    def __init__(self, name: str, bundle: Path, adapters: tuple[str, ...], threads: int, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"adapters-{name.replace(' ', '-')}.log"
        self._log = self.log_path.open("ab")
        config = {"bundle": str(bundle), "adapters": list(adapters), "threads": threads, "max_batch": STREAMS}
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=worker_env(threads),
        )
        hello = self._read()
        self.load_s = hello["load_s"]
        self.max_streams = hello["max_streams"]

    def loads(self) -> dict[str, Any]:
        return self._call({"op": "loads"})


def serve(config: dict[str, Any], protocol: TextIO) -> None:
    """The worker's side: one engine; `run` submits one request per prompt, row i on adapters[i % len]."""
    from packager.bench.systems.base import SystemConfig, now, timings_from_marks
    from packager.bench.systems.onnxfn import engine_config
    from packager.decoder_facts import decoder_facts
    from runtime.engine.engine import Engine
    from runtime.engine.request import GenerationRequest, SamplingParams
    from runtime.verified import open_verified

    def reply(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    started = now()
    bundle, _ = open_verified(config["bundle"])
    system = SystemConfig("onnxfn", config["bundle"], "", "", config["threads"], config["max_batch"], sys.executable)
    settings = engine_config(system, decoder_facts(bundle.manifest).kv_bytes_per_token())
    engine = Engine(bundle, dataclasses.replace(settings, max_adapters=len(ADAPTERS)))
    engine.start()
    adapters: list[str | None] = list(config["adapters"]) or [None]
    ids = itertools.count()
    reply({"ok": True, "load_s": now() - started, "max_streams": config["max_batch"]})

    async def stream(prompt: list[int], adapter: str | None, max_tokens: int) -> tuple[list[float], list[int]]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(f"bench-{next(ids)}", tuple(prompt), sampling, adapter=adapter)
        marks: list[float] = []
        tokens: list[int] = []
        async for output in engine.submit(request):
            for token in output.token_ids:
                marks.append(now())
                tokens.append(token)
        return marks, tokens

    async def run_all(prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        start = now()
        rows = [stream(p, adapters[i % len(adapters)], max_tokens) for i, p in enumerate(prompts)]
        done = await asyncio.gather(*rows)
        return [timings_from_marks(start, marks, tokens).to_json() for marks, tokens in done]

    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "run":
                engine.wait_until_warm()
                prompts = [p["ids"] for p in command["prompts"]]
                reply({"ok": True, "streams": asyncio.run(run_all(prompts, command["max_tokens"]))})
            elif command["op"] == "loads":
                reply({"ok": True, **load_figures(engine)})
            elif command["op"] == "quit":
                break
        except Exception as exc:  # reported to the parent, which records the failure in the results
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    engine.shutdown()
    reply({"ok": True, "closed": True})


def load_figures(engine: Any) -> dict[str, Any]:
    """Each adapter load this engine made (seconds, the adapter's bytes) and one slot's bytes in the bound inputs."""
    if engine.adapters is None:
        return {"loads": [], "slot_bytes": None}
    slots = engine.adapters.slots
    return {
        "loads": [{"seconds": load.seconds, "nbytes": load.nbytes} for load in slots.loads],
        # Whatever the stacks' shape, each holds `capacity` slots of the same size.
        "slot_bytes": slots.bytes_per_slot,
    }


# --- the figures -------------------------------------------------------------------------------------------------


def measure(bench_function: Path, hf_dir: Path, base_bundle: Path, prompts: Any, plan: Plan, threads: int) -> dict:
    """The section's figures (or {"error": ...}): `bench_function` is the folder of the bench's function.toml."""
    from runtime.bundle import open_bundle

    started, meter = time.monotonic(), ContentionMeter()
    run = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average_start": os.getloadavg()[0],
        "rounds": plan.repetitions,
    }
    try:
        bundle = adapter_bundle((bench_function / "function.toml").read_text(), hf_dir)
    except Exception as exc:  # the build's own refusal, or a missing peer (peft, torch): the section says which
        return {"error": f"the adapter bundle could not be built: {type(exc).__name__}: {exc}", "run": run}
    manifest = open_bundle(bundle, verify=False).manifest
    bundled = (manifest.adapters or {}).get("bundled", {})
    figures: dict[str, Any] = {
        "bundle": str(bundle),
        "base_bundle": str(base_bundle),
        "adapters": list(ADAPTERS),
        "rank": RANK,
        "modules": list(MODULES),
        "file_bytes": {name: manifest.files[file].size for name, file in bundled.items()},
    }
    folders = {"base": base_bundle, "adapters": bundle}
    with tempfile.TemporaryDirectory(prefix="bench-adapters-") as log_dir:
        workers: list[Worker] = []
        try:
            for label, (which, names) in ROWS.items():
                workers.append(AdapterWorker(label, folders[which], names, threads, Path(log_dir)))
            single = [w for w in workers if len(ROWS[w.name][1]) <= 1]  # at batch 1, one row holds one adapter
            figures["batch1"] = _decode(single, prompts, plan)
            figures["streams"] = _streams(workers, prompts, plan)
            figures["loads"] = next(w for w in workers if w.name == "4 adapters").loads()  # type: ignore[attr-defined]
        except (WorkerError, OSError) as exc:
            figures["error"] = str(exc)
        finally:
            for worker in workers:
                worker.close()
    run["duration_s"] = time.monotonic() - started
    run["others_cpu_share"] = meter.others_share()
    figures["run"] = run
    return figures


def _decode(workers: list[Worker], prompts: Any, plan: Plan) -> dict[str, Any]:
    rounds = [prompts.take(plan.decode_prompt) for _ in range(1 + plan.repetitions)]

    def job(worker: Worker, index: int) -> dict[str, Any]:
        (stream,) = worker.run([rounds[index]], plan.decode_tokens)
        return {"tok_s": decode_rate(stream)}

    rows = interleave(workers, plan.repetitions, job)
    return {"new_tokens": plan.decode_tokens, "prompt_tokens": plan.decode_prompt, "rows": summarise(rows, "tok_s")}


def _streams(workers: list[Worker], prompts: Any, plan: Plan) -> dict[str, Any]:
    rounds = [prompts.batch(STREAMS, plan.concurrency_prompt) for _ in range(1 + plan.repetitions)]

    def job(worker: Worker, index: int) -> dict[str, Any]:
        streams = worker.run(rounds[index], plan.concurrency_tokens)
        return {
            # The decode steps' throughput: each stream's rate after its first token, summed over the streams
            # (they decode side by side); and end to end, prefill included, as the concurrency section's figure.
            "tok_s": sum(decode_rate(s) for s in streams),
            "end_to_end_tok_s": sum(s["tokens"] for s in streams) / max(s["last"] for s in streams),
        }

    rows = interleave(workers, plan.repetitions, job)
    return {
        "streams": STREAMS,
        "new_tokens": plan.concurrency_tokens,
        "prompt_tokens": plan.concurrency_prompt,
        "rows": summarise(rows, "tok_s"),
        "end_to_end": summarise(rows, "end_to_end_tok_s"),
    }


def summarise(rows: dict[str, dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Each row's median, and its ratio to `base`: of the medians, and round by round (median, 95 % interval)."""
    out: dict[str, dict[str, Any]] = {}
    base = [s[key] for s in rows.get("base", {}).get("samples", [])]
    for name, row in rows.items():
        if "samples" not in row:
            out[name] = row
            continue
        samples = [s[key] for s in row["samples"]]
        entry: dict[str, Any] = {key: median(samples), "samples": samples}
        if base and name != "base":
            paired = sorted(mine / theirs for mine, theirs in zip(samples, base, strict=False))
            entry["ratio"] = median(samples) / median(base)
            entry["paired"] = {"median": median(paired), "interval": list(median_interval(paired))}
        out[name] = entry
    return out


# --- the report --------------------------------------------------------------------------------------------------


def merge(out: Path, figures: dict[str, Any]) -> dict[str, Any] | None:
    """The committed results in `out` with this section's figures in place of its old ones (None: no results
    there yet): an adapters-only run keeps every other section's numbers and the header of the run that made them."""
    path = out / "results.json"
    if not path.is_file():
        return None
    results: dict[str, Any] = json.loads(path.read_text())
    results["adapters"] = figures
    return results


def verdict(figures: dict[str, Any]) -> tuple[float | None, str]:
    """The target's ratio (8 streams over 4 adapters / base, by medians) and whether this run met it."""
    entry = figures.get("streams", {}).get("rows", {}).get("4 adapters", {})
    times = entry.get("ratio")
    if times is None:
        return None, "not measured"
    low, high = entry["paired"]["interval"]
    if times >= TARGET and low >= TARGET:
        return times, "met"
    if times < TARGET and high < TARGET:
        return times, "**missed**"
    return times, f"{'met' if times >= TARGET else '**missed**'} by medians; the round-by-round interval holds {TARGET}"


def render(results: dict[str, Any]) -> str:
    figures = results["adapters"]
    title = "## LoRA adapters per request (onnxfn only)\n\n"
    if "error" in figures and "streams" not in figures:
        return title + f"not measured: {' '.join(str(figures['error']).split())[:400]}\n"
    run = figures["run"]
    share = 100 * run["others_cpu_share"]
    busy = " **The machine was busy: these ratios are noisy.**" if run["others_cpu_share"] > 0.05 else ""
    modules = "/".join(m.removesuffix("_proj") for m in figures["modules"])
    out = title + (
        f"Measured {run['started']} ({run['duration_s'] / 60:.1f} min, medians of {run['rounds']} interleaved rounds "
        f"after one warm-up round; other processes used {share:.0f} % of all CPU time).{busy} The bench model's "
        f"function built again with {len(figures['adapters'])} random PEFT adapters (r={figures['rank']} on "
        f"{modules}): `{figures['bundle']}`. `base` is the bench's bundle, whose graph takes no adapter inputs; the "
        "other rows run the adapter bundle, each engine in its own process, its rows on the base (slot 0), all on "
        "one adapter, or spread over 4 (row i on adapter i mod 4: 4 distinct adapters in every decode step).\n\n"
        f"{NOTE}\n\n"
    )
    header = ["figure", "rows", "tok/s", "/ base", "round by round: median (95 % interval)"]
    rows = []
    for key, label in (("batch1", "decode, batch 1"), ("streams", f"decode, {STREAMS} streams")):
        section = figures.get(key)
        if section is None:
            continue
        tokens = f"{label} ({section['prompt_tokens']}-token prompts, {section['new_tokens']} new tokens)"
        for name in ROWS:
            entry = section["rows"].get(name)
            if entry is None:
                rows.append([tokens, name, "-", "-", "one row holds one adapter"])
            elif "tok_s" not in entry:
                rows.append([tokens, name, " ".join(str(entry.get("error", "failed")).split())[:160], "", ""])
            elif "ratio" not in entry:
                rows.append([tokens, name, f"{entry['tok_s']:,.1f}", "1.00", "baseline"])
            else:
                low, high = entry["paired"]["interval"]
                rows.append([tokens, name, f"{entry['tok_s']:,.1f}", f"{entry['ratio']:.2f}",
                             f"{entry['paired']['median']:.2f} ({low:.2f}-{high:.2f})"])  # fmt: skip
    out += _table(header, rows)
    if ends := figures.get("streams", {}).get("end_to_end"):
        cells = [f"{name} {entry['end_to_end_tok_s']:,.1f}" + (f" ({entry['ratio']:.2f})" if "ratio" in entry else "")
                 for name, entry in ends.items() if "end_to_end_tok_s" in entry]  # fmt: skip
        out += (
            f"\n{STREAMS} streams end to end (all tokens / the last one's time, prefill included, as the concurrency "
            f"section), tok/s (/ base): {', '.join(cells)}.\n"
        )
    times, met = verdict(figures)
    shown = "-" if times is None else f"{times:.2f}"
    out += f"\nTarget: {STREAMS} streams over 4 adapters >= {TARGET:.2f}x the base: **{shown}**, {met}.\n"
    out += _sizes(figures)
    if "error" in figures:
        out += f"\nThe run stopped early: {' '.join(str(figures['error']).split())[:400]}\n"
    return out


def _sizes(figures: dict[str, Any]) -> str:
    loads, files = figures.get("loads"), figures.get("file_bytes", {})
    lines = []
    if loads and loads["loads"]:
        cold = loads["loads"][: len(figures["adapters"])]  # each adapter's first load into its slot
        each = ", ".join(f"{1000 * load['seconds']:.1f}" for load in cold)
        lines.append(
            f"- Adapter load (its weights written into a free slot of the bound inputs, cold, "
            f"`engine.adapters.slots.loads`): **{1000 * median([load['seconds'] for load in cold]):.1f} ms** median "
            f"of {len(cold)} ({each} ms)."
        )
        lines.append(
            f"- Bytes per adapter: {median(list(files.values())) / 1e6:.2f} MB converted file in the bundle "
            f"(`adapters/NAME.safetensors`), {median([load['nbytes'] for load in cold]) / 1e6:.2f} MB of weights in "
            f"memory, {loads['slot_bytes'] / 1e6:.2f} MB per slot of the graph's stacked inputs."
        )
    elif files:
        lines.append(f"- Bytes per adapter: {median(list(files.values())) / 1e6:.2f} MB converted file in the bundle.")
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


if __name__ == "__main__":  # a worker: one engine, commands on stdin (libraries' prints go to stderr)
    _protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    serve(json.loads(sys.argv[1]), _protocol)
