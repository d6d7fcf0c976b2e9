"""results.json -> results.md: absolute numbers, each beside its ratio to onnxfn and a plain verdict.

`onnxfn x` is how many times better onnxfn is on that figure (throughput: onnxfn / system; latency
and memory: system / onnxfn). Below 1.00 onnxfn loses, and the verdict column says so, unless the
section kept each round's figures and the 95 % interval of the round-by-round ratio holds 1.00: then
the host's noise could have decided it either way, and the verdict is a tie. Server rows are compared
with onnxfn over HTTP, in-process rows with the in-process engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from packager.bench import adapters, embeddings, gateway, ray_target, targets
from packager.bench.pairing import baseline_of, paired_interval
from packager.bench.stats import median
from packager.bench.systems import PROCESS_SNAPSHOT, VARIANTS

BUSY_SHARE = 0.05  # other processes' share of CPU time above which the report warns
# The footprint table's rows: one system per distinct artifact (the others share one of these).
FOOTPRINT_SYSTEMS = ("onnxfn", "genai-int8", "genai-int4", "llamacpp", "transformers")


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def ms(value: float | None) -> str:
    return fmt(None if value is None else value * 1000, 0 if value is not None and value >= 0.1 else 1)


def failure(entry: dict[str, Any]) -> str | None:
    for key in ("error", "unsupported"):
        if key in entry:
            text = " ".join(str(entry[key]).split())
            return f"{key}: {text[:160]}".replace("|", "/")
    return None


def ratio(system: str, table: dict[str, dict[str, Any]], key: str, higher_is_better: bool) -> tuple[str, str]:
    """(`onnxfn x` cell, verdict cell) for one row."""
    base_name = baseline_of(system)
    if system == base_name:
        return "1.00", "baseline"
    if system in VARIANTS:
        return "-", VARIANTS[system]
    mine, base = table.get(system, {}).get(key), table.get(base_name, {}).get(key)
    if mine is None or base is None or not mine or not base:
        return "-", f"no {base_name} figure"
    times = base / mine if higher_is_better else mine / base
    if paired := paired_interval(table, system, key, higher_is_better):
        _, low, high = paired
        if low <= 1.0 <= high:
            return f"{times:.2f}", f"tie ({low:.2f}-{high:.2f})"
        wins = low > 1.0
    else:
        wins = times >= 1.0
    return f"{times:.2f}", ("onnxfn wins" if wins else f"**onnxfn loses** ({base_name})")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_decode(results: dict[str, Any]) -> str:
    decode = results["decode"]
    systems = decode["systems"]
    limits = results.get("limit", {}).get("systems", {})
    reference = systems.get("onnxfn", {}).get("token_ids") or systems.get("genai", {}).get("token_ids")
    rows = []
    for name, entry in systems.items():
        if problem := failure(entry):
            rows.append([name, problem, "", "", "", "", "", ""])
            continue
        times, verdict = ratio(name, systems, "tok_s", higher_is_better=True)
        limit = limits.get(name, {})
        same = "-"
        if entry.get("token_ids") and reference:
            same = "yes" if entry["token_ids"] == reference else "no"
        rows.append([
            name, fmt(entry["tok_s"]), times, verdict, ms(entry["ttft_s"]), fmt(limit.get("limit_tok_s")),
            fmt(100 * limit["fraction"], 0) + " %" if "fraction" in limit else "-", same,
        ])  # fmt: skip
    title = (
        f"## Decode, batch 1 ({decode['prompt_tokens']}-token prompt, {decode['new_tokens']} new tokens, greedy)\n\n"
    )
    header = ["system", "decode tok/s", "onnxfn x", "verdict", "TTFT ms", "limit tok/s", "of limit"]
    spread = round_ratios(systems, "tok_s")
    return title + table([*header, "first 16 tokens = onnxfn's"], rows) + render_rounds([spread] if spread else [])


def render_prefill(results: dict[str, Any]) -> str:
    prefill = results["prefill"]
    out = "## Prefill and time to first token (batch 1, one new token)\n\n"
    rows = []
    for length in prefill["lengths"]:
        systems = prefill["systems_by_length"][str(length)]
        for name, entry in systems.items():
            if problem := failure(entry):
                rows.append([str(length), name, problem, "", "", ""])
                continue
            times, verdict = ratio(name, systems, "tok_s", higher_is_better=True)
            rows.append([str(length), name, fmt(entry["tok_s"], 0), ms(entry["ttft_s"]), times, verdict])
    return out + table(["prompt tokens", "system", "prefill tok/s", "TTFT ms", "onnxfn x", "verdict"], rows)


def render_concurrency(results: dict[str, Any]) -> str:
    conc = results["concurrency"]
    out = (
        f"## Concurrent streams ({conc['prompt_tokens']}-token prompts, {conc['new_tokens']} new tokens each, "
        "all submitted at once; servers over HTTP, others as one in-process batch)\n\n"
    )
    rows = []
    for level in conc["levels"]:
        systems = conc["systems_by_level"][str(level)]
        for name, entry in systems.items():
            if problem := failure(entry):
                rows.append([str(level), name, problem, "", "", "", "", "", ""])
                continue
            times, verdict = ratio(name, systems, "aggregate_tok_s", higher_is_better=True)
            rows.append([
                str(level), name, fmt(entry["aggregate_tok_s"]), times, verdict, ms(entry["ttft_p50_s"]),
                ms(entry["ttft_p99_s"]), ms(entry["tpot_p50_s"]), ms(entry["tpot_p99_s"]),
            ])  # fmt: skip
    header = ["streams", "system", "aggregate tok/s", "onnxfn x", "verdict", "TTFT p50 ms", "TTFT p99 ms"]
    spreads = [
        f"- {level} stream{'s' if level > 1 else ''}: {spread}"
        for level in conc["levels"]
        if (spread := round_ratios(conc["systems_by_level"][str(level)], "aggregate_tok_s"))
    ]
    return (
        out
        + table([*header, "TPOT p50 ms", "TPOT p99 ms"], rows)
        + render_rounds(spreads)
        + render_variant_ratios(conc)
    )


def render_rounds(lines: list[str]) -> str:
    """The `round_ratios` lines of a section under their explanation; nothing when no samples were kept."""
    if not lines:
        return ""
    note = (
        "`onnxfn x` round by round (each round runs every system once, so a pair shares the host's state of "
        "that minute), lowest to highest, their median, and a bootstrap 95 % interval of that median "
        "(an interval holding 1.00 is a tie this run cannot break; `--rounds` narrows it):"
    )
    return f"\n{note}\n\n" + "\n".join(lines) + "\n"


def round_ratios(systems: dict[str, dict[str, Any]], key: str) -> str:
    """Each peer's `onnxfn x` per round (the table's ratio is of the medians): how far the host's noise moves
    a ratio within one run. The median of these paired ratios is the estimate a drift of the host over the
    run moves least; its bootstrap interval says how sure it is, and decides a tie in the verdict column."""
    spans = []
    for name in systems:
        if name == baseline_of(name) or name in VARIANTS:
            continue
        if paired := paired_interval(systems, name, key):
            ratios, low, high = paired
            middle = f"median {median(ratios):.2f}, 95 % interval {low:.2f}-{high:.2f}"
            spans.append(f"{name} {ratios[0]:.2f} to {ratios[-1]:.2f} ({middle})")
    return ", ".join(spans)


def render_variant_ratios(conc: dict[str, Any]) -> str:
    """The `onnxfn x` column compares with onnxfn's default; these compare its throughput mode with each peer."""
    lines = []
    for level in conc["levels"]:
        systems = conc["systems_by_level"][str(level)]
        for variant in VARIANTS:
            mine = systems.get(variant, {}).get("aggregate_tok_s")
            peers = [
                f"{name} {mine / entry['aggregate_tok_s']:.2f}x"
                for name, entry in systems.items()
                if mine and name not in (variant, "onnxfn-http", "onnxfn") and entry.get("aggregate_tok_s")
            ]
            if peers:
                lines.append(f"- {level} stream{'s' if level > 1 else ''}, {variant} against " + ", ".join(peers))
    if not lines:
        return ""
    return "\nonnxfn with `decode = throughput` (over HTTP) / each peer, aggregate tok/s:\n\n" + "\n".join(lines) + "\n"


def render_cold(results: dict[str, Any]) -> str:
    cold = results["cold"]
    out = "## Cold start (fresh process: exec → first streamed token)\n\n"
    for label, key in (("page cache warm", "warm_cache"), ("page cache dropped", "dropped_cache")):
        figure = cold[key]
        if "skipped" in figure:
            out += f"**{label}**: not measured: {figure['skipped']}.\n\n"
            continue
        rows = []
        for name, entry in figure["systems"].items():
            if problem := failure(entry):
                rows.append([name, problem, "", "", "", ""])
                continue
            times, verdict = ratio(name, figure["systems"], "total_s", higher_is_better=False)
            phases = ", ".join(f"{k} {ms(v)}" for k, v in entry["phases_s"].items())
            rows.append([name, ms(entry["total_s"]), times, verdict, phases, fmt(entry["peak_rss_mib"], 0)])
        out += f"**{label}**\n\n" + table(["system", "total ms", "onnxfn x", "verdict", "phases (ms)", "RSS MiB"], rows)
        out += "\n" + _snapshot_ratios(figure["systems"])
    return out + f"Floor: bundle bytes / read bandwidth + bare `python -c pass` = {ms(cold['floor_s'])} ms.\n"


def _snapshot_ratios(systems: dict[str, Any]) -> str:
    """How the process-snapshot start compares with every other row (the `onnxfn x` column cannot say)."""
    mine = systems.get(PROCESS_SNAPSHOT, {}).get("total_s")
    others = [
        f"{name} {entry['total_s'] / mine:.2f}x"
        for name, entry in systems.items()
        if mine and name != PROCESS_SNAPSHOT and entry.get("total_s")
    ]
    head = f"{PROCESS_SNAPSHOT} against each (their time / its time; above 1.00 it starts sooner): "
    return head + ", ".join(others) + "\n\n" if others else ""


def render_memory(results: dict[str, Any]) -> str:
    memory, artifacts = results.get("memory", {}), results.get("artifacts", {})
    whole = results.get("peak_rss_whole_run", {})
    names = list(dict.fromkeys([*memory, *whole]))
    rows = []
    for name in names:
        entry = memory.get(name, {})
        artifact = artifacts.get(name, {})
        size = fmt(artifact["total_bytes"] / 1e6, 1) if artifact else "-"
        cells = [fmt(entry.get("loaded_rss_mib"), 0), fmt(entry.get("peak_rss_mib"), 0)]
        if problem := failure(entry):
            cells = [problem, ""]
        times, verdict = ratio(name, memory, "peak_rss_mib", higher_is_better=False)
        rows.append([name, *cells, times, verdict, fmt(whole.get(name, {}).get("peak_rss_mib"), 0)])
        rows[-1] += [artifact.get("label", "-"), size]
    header = ["system", "RSS loaded MiB", "peak RSS decode MiB", "onnxfn x", "verdict", "peak RSS whole bench MiB"]
    note = "Servers: the server process only. Whole bench: the long-lived worker after every throughput figure.\n\n"
    return "## Memory and size\n\n" + note + table([*header, "artifact", "size MB"], rows)


def render_limit(results: dict[str, Any]) -> str:
    limit, machine = results["limit"], results["machine"]
    bw = ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.1f} GB/s" for k, v in machine["read_bandwidth_bytes_s"].items())
    out = (
        "## The bandwidth limit (decode, batch 1)\n\n"
        f"Read bandwidth over a 512 MiB array: {bw}; the limit uses the best. Bytes per token = weights file + KV at "
        f"the mean decode context ({limit['mean_decode_context']:.0f} tokens). The file size over-counts tables that "
        "are gathered rather than streamed (an int8 bundle's fp32 embedding), so a fraction above 100 % is "
        "possible.\n\n"
    )
    rows = [
        [name, fmt(e["bytes_per_token"] / 1e6, 1), fmt(e["limit_tok_s"]), fmt(100 * e["fraction"], 0) + " %"]
        for name, e in limit["systems"].items()
        if "fraction" in e
    ]
    return out + table(["system", "MB read per token", "limit tok/s", "measured / limit"], rows)


def render_quality(results: dict[str, Any]) -> str:
    quality = results["quality"]
    if quality is None:
        return "## Quality\n\nThe bundle has no quality.json (it was not built by `pkg build`).\n"
    candidates = quality.get("candidates")
    if not isinstance(candidates, list):  # a layout this report does not know: show it as it is
        return "## Quality\n\n```json\n" + json.dumps(quality, indent=2) + "\n```\n"
    # The bench's own rows name the system each runs in; an older run's are a copy of the bundle's quality.json.
    measured = any("system" in c for c in candidates)
    if measured:
        out = "## Quality against fp32 (`pkg build`'s method and budget)\n\n"
    else:
        out = "## Quality (the bundle's quality.json, written by `pkg build`)\n\n"
    method = quality.get("method", {})
    out += (
        f"Reference {quality.get('reference', '?')}; {method.get('prompts', '?')} prompts, "
        f"{method.get('continuation_tokens', '?')} continuation tokens; KL: {method.get('kl', '?')}; "
        f"perplexity: {method.get('perplexity', '?')}. {'Bundle precision' if measured else 'Chosen'}: "
        f"**{quality.get('chosen', '?')}**.\n\n"
    )
    rows = [
        [
            str(c.get("precision")),
            fmt(c.get("top1_agreement"), 3),
            fmt(c.get("mean_kl"), 4),
            fmt(c.get("max_kl"), 3),
            fmt(c.get("perplexity"), 2),
            fmt(c.get("perplexity_increase_pct"), 1) + " %",
            f"{c.get('greedy_match_prompts', '?')}/{c.get('greedy_prompts', '?')}",
            "yes" if c.get("passes") else "no: " + "; ".join(c.get("failures", [])),
        ]
        + ([c.get("system", "-"), c.get("origin", "-")] if measured else [])
        for c in candidates
    ]
    header = ["precision", "top-1 agreement", "mean KL", "max KL", "perplexity", "vs fp32", "greedy match"]
    out += table([*header, "within budget", *(["run by", "figures from"] if measured else [])], rows)
    if parity := quality.get("torch_parity"):
        out += (
            f"\nfp32 ONNX vs PyTorch: identical greedy output on {parity.get('identical_greedy')}"
            f"/{parity.get('prompts')} prompts.\n"
        )
    return out


def render_footprint(results: dict[str, Any]) -> str:
    """Each distinct artifact once, in bytes and against the GGUF every export here comes from."""
    artifacts = results["artifacts"]
    gguf = artifacts.get("llamacpp", {}).get("total_bytes")
    rows = [
        [
            artifacts[name]["label"],
            name,
            fmt(artifacts[name]["total_bytes"] / 1e6, 1),
            f"{artifacts[name]['total_bytes'] / gguf:.2f}" if gguf else "-",
        ]
        for name in FOOTPRINT_SYSTEMS
        if name in artifacts
    ]
    note = "Every file each system loads (a bundle: every file in it), in MB of 10^6 bytes.\n\n"
    return "## Footprint\n\n" + note + table(["artifact", "run by", "MB", "/ GGUF"], rows)


def render_header(results: dict[str, Any]) -> str:
    meta = results["meta"]
    facts = meta["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in facts["packages"].items())
    model = f"Model **{meta['model']}** (`{meta['function']}`). " if "model" in meta else ""
    exports = "".join(f"{name} runs the builder's export `{path}`. " for name, path in meta.get("exports", {}).items())
    lines = [
        "# onnxfn benchmark",
        "",
        f"Run {meta['started']}, {meta['duration_s'] / 60:.1f} min{' (--quick)' if meta['quick'] else ''}. "
        f"CPU: {facts['cpu_model']} ({facts['logical_cpus']} logical, {', '.join(facts['cpu_flags'])}), "
        f"{facts['memory_gib']} GiB, Linux {facts['kernel']}, Python {facts['python']}. "
        f"{meta['threads']} intra-op threads everywhere.",
        "",
        f"{model}Bundle `{meta['bundle']}`; GGUF `{meta['gguf']}`; HF folder `{meta['hf_dir']}`. {exports}"
        f"Prompts: token windows of `{meta['prompt_source']}` (fresh text every round, identical across systems). "
        f"Medians of {meta['plan']['repetitions']} interleaved rounds after one warm-up round.",
        "",
        f"Versions: {versions}.",
        "",
    ]
    if build := facts.get("llamacpp_build"):
        lines += [render_llamacpp_build(build), ""]
    share = meta["others_cpu_share"]
    # Measured over the whole run; the load average at the start also counts processes that had just ended.
    if share > BUSY_SHARE:
        lines.append(
            f"- **Warning: the machine was busy**: other processes used {100 * share:.0f} % of all CPU time during "
            f"the run (1-min load average {meta['load_average_start']:.1f} at the start, on "
            f"{facts['logical_cpus']} CPUs). Thread pools that spin-wait (llama.cpp's most, then ONNX Runtime's) "
            "lose far more than their share on a contended machine, so these ratios are not representative; "
            "rerun on an idle machine."
        )
    else:
        lines.append(
            f"- Other processes used {100 * share:.0f} % of all CPU time during the run (1-min load average "
            f"{meta['load_average_start']:.1f} at the start, on {facts['logical_cpus']} CPUs)."
        )
    lines += [f"- Note: {note}" for note in meta["notes"]]
    for name, error in results.get("start_errors", {}).items():
        lines.append(f"- {name} did not start: {' '.join(error.split())[-400:]}")
    return "\n".join(lines) + "\n\n"


def render_llamacpp_build(build: dict[str, Any]) -> str:
    """The llama.cpp peer's build (scripts/setup_bench.sh): the ISA flags it was compiled with, picked by what ran."""
    flags = [
        arg.removeprefix("-DGGML_").removesuffix("=ON") for arg in build["cmake_args"].split() if arg.endswith("=ON")
    ]
    refused = [
        f"{name} {outcome.removeprefix('no ')}" for name, outcome in build["probes"].items() if outcome != "runs"
    ]
    return (
        f"llama.cpp build: GGML_NATIVE=OFF with {', '.join(flags)} (the extensions whose probe ran here; "
        f"did not run: {', '.join(refused) or 'none'})."
    )


RENDERERS = (
    ("decode", render_decode),
    ("limit", render_limit),
    ("prefill", render_prefill),
    ("concurrency", render_concurrency),
    ("cold", render_cold),
    ("memory", render_memory),
    ("artifacts", render_footprint),
    ("quality", render_quality),
    ("embeddings", embeddings.render),
    ("gateway", gateway.render),
    ("adapters", adapters.render),
    ("ray", ray_target.render),
)


def render(results: dict[str, Any]) -> str:
    parts = [render_header(results)]
    if goals := targets.rows(results):  # from the decode and concurrency sections, whichever ran
        parts.append("## Targets\n\n" + table(targets.HEADER, goals))
    parts += [renderer(results) for key, renderer in RENDERERS if key in results]
    return "\n".join(parts)


def save(results: dict[str, Any], out: Path) -> None:
    """`out`/results.json and its rendering, `out`/results.md."""
    out.mkdir(parents=True, exist_ok=True)
    # Unsorted: the systems keep the run's order, so render(results.json) reproduces results.md.
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(render(results))
