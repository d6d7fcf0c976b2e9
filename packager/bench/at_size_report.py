"""results.json of a run at size (at_size.py) -> results.md: the targets of issue 48 first, then each section.

The throughput sections render as the demo's do (report.py); the targets table reads each figure beside its goal,
with the round-by-round ratio's 95 % interval deciding a speed target (targets.verdict), and a note saying where
the time or the memory goes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from packager.bench import report, shipping
from packager.bench.node_profile import KINDS, RESIDUAL
from packager.bench.pairing import paired_interval
from packager.bench.stats import median, median_interval
from packager.bench.systems import PROCESS_SNAPSHOT
from packager.bench.targets import verdict

MIB = 1 << 20
HEADER = ["target", "goal", "this run", "round by round: median (95 % interval)", "verdict", "where it goes"]
SKIPPED = (
    "Not run at this size: the transformers baseline and the onnxruntime-genai int4/int8 exports, which each "
    "need the model whole in float32 (an 8B model's fp32 folder is 32 GB, more than this machine's 24 GB), and "
    "quality, which is judged on the real small models (random weights make text meaningless)."
)


def _speed_row(label: str, goal: float, systems: dict[str, Any], mine: str, peer: str, key: str, note: str) -> list:
    a, b = systems.get(mine, {}).get(key), systems.get(peer, {}).get(key)
    if not a or not b:
        problem = report.failure(systems.get(mine, {})) or report.failure(systems.get(peer, {})) or "not measured"
        return [label, f">= {goal:.1f}", "-", "-", problem, note]
    row = [label, f">= {goal:.1f}", f"{a / b:.2f}"]
    if paired := paired_interval(systems, peer, key, baseline=mine):
        ratios, low, high = paired
        return [*row, f"{median(ratios):.2f} ({low:.2f}-{high:.2f})", verdict(goal, low, high), note]
    return [*row, "-", "met" if a / b >= goal else "**missed**", note]


def _ceiling_row(label: str, goal: float, value: float | None, note: str, shown: str | None = None) -> list:
    if value is None:
        return [label, f"<= {goal:.2f}", "-", "-", "not measured", note]
    return [label, f"<= {goal:.2f}", shown or f"{value:.2f}", "-", "met" if value <= goal else "**missed**", note]


def decode_note(results: dict[str, Any]) -> str:
    limits = results.get("limit", {}).get("systems", {})
    shares = [f"{name} {100 * limits[name]['fraction']:.0f} %" for name in ("onnxfn", "llamacpp")
              if "fraction" in limits.get(name, {})]  # fmt: skip
    residual = profile_share(results, RESIDUAL)
    text = f"of the bandwidth limit: {', '.join(shares)}" if shares else ""
    if residual is not None:
        text += f"; GGUF residual nodes {100 * residual:.1f} % of a decode step (profile)"
    return text


def ttft_note(systems: dict[str, Any]) -> str:
    times = [f"{name} {report.ms(entry['ttft_s'])} ms" for name, entry in systems.items() if "ttft_s" in entry]
    return f"time to first token: {', '.join(times)}" if times else ""


def streams_note(systems: dict[str, Any]) -> str:
    """Each server's median time to first token and per output token: queueing against batching."""
    parts = [
        f"{name}: TTFT p50 {report.ms(entry['ttft_p50_s'])} ms, TPOT p50 {report.ms(entry['tpot_p50_s'])} ms"
        for name, entry in systems.items()
        if "ttft_p50_s" in entry
    ]
    return "; ".join(parts)


def profile_share(results: dict[str, Any], kind: str, label: str = "this model") -> float | None:
    runs = results.get("profile", {}).get(label, {}).get("runs")
    return median([r["kinds_share"].get(kind, 0.0) for r in runs]) if runs else None


def cold_row(results: dict[str, Any]) -> list:
    label = "fresh start (page cache warm): onnxfn's server / llama-cpp-python load to first token"
    systems = results.get("cold", {}).get("warm_cache", {}).get("systems", {})
    mine, peer = systems.get("onnxfn-http", {}), systems.get("llamacpp", {})
    if "total_s" not in mine or "total_s" not in peer:
        return _ceiling_row(label, 1.2, None, "")
    pairs = [a / b for a, b in zip(mine["samples_s"], peer["samples_s"], strict=False)]
    low, high = median_interval(pairs)
    phases = ", ".join(f"{k} {report.ms(v)} ms" for k, v in mine["phases_s"].items())
    state = "met" if high <= 1.2 else ("**missed**" if low > 1.2 else "tie: not shown either way")
    note = f"onnxfn's server {report.ms(mine['total_s'])} ms ({phases}); llama-cpp-python "
    note += f"{report.ms(peer['total_s'])} ms"
    ratio = mine["total_s"] / peer["total_s"]
    return [label, "<= 1.2", f"{ratio:.2f}", f"{median(pairs):.2f} ({low:.2f}-{high:.2f})", state, note]


def snapshot_row(results: dict[str, Any]) -> list:
    """onnxfn's server woken from a process snapshot: wake to first token, the dump's size, beside the starts."""
    label = "wake from a process snapshot (CRIU restore) to first token; the dump's size"
    systems = results.get("cold", {}).get("warm_cache", {}).get("systems", {})
    entry = systems.get(PROCESS_SNAPSHOT)
    if not entry or "total_s" not in entry:
        problem = report.failure(entry or {}) or "not measured"
        return [label, "report", "-", "-", problem, ""]
    shown = f"{report.ms(entry['total_s'])} ms; dump {entry['dump_bytes'] / 1e6:,.0f} MB"
    others = [f"{name} fresh start {report.ms(systems[name]['total_s'])} ms" for name in ("onnxfn-http", "llamacpp")
              if "total_s" in systems.get(name, {})]  # fmt: skip
    restore = entry["phases_s"].get("criu_restore")
    note = f"criu restore {report.ms(restore)} ms, " if restore is not None else ""
    note += f"dump took {entry['dump_s']:.1f} s; " + ", ".join(others)
    return [label, "report", shown, "-", "-", note]


def serving_rss(results: dict[str, Any]) -> tuple[float | None, str]:
    """onnxfn's server RSS after the 8-stream traffic over the bytes it must hold (GGUF + its KV pool)."""
    rss = results.get("servers", {}).get("rss", {}).get("onnxfn-http")
    gguf = results.get("artifacts", {}).get("llamacpp", {}).get("total_bytes")
    if not rss or not gguf:
        return None, ""
    must_hold = gguf + results["kv_pool_bytes"]
    weights = results["artifacts"]["onnxfn"]["weights_bytes"]
    note = (
        f"RSS {rss['rss_mib']:,.0f} MiB (loaded {rss['loaded_rss_mib']:,.0f}, peak {rss['peak_rss_mib']:,.0f}) over "
        f"GGUF {gguf / MIB:,.0f} MiB + KV pool {results['kv_pool_bytes'] / MIB:,.0f} MiB; the bundle's weights are "
        f"{weights / MIB:,.0f} MiB"
    )
    return rss["rss_mib"] * MIB / must_hold, note


def build_rows(results: dict[str, Any]) -> list[list]:
    build = results.get("build")
    if not build:
        return [_ceiling_row("build peak RSS of the process tree / bound", 1.0, None, "no build record")]
    steps = [s for s in build["report"]["steps"] if not s["cached"]]
    largest = max(steps, key=lambda s: s["seconds"], default=None)
    where = f"largest step: {largest['name']} {100 * largest['seconds'] / build['wall_s']:.0f} %" if largest else ""
    peak, bound = build["peak_tree_rss_bytes"], build["bound_bytes"]
    heaviest = max(steps, key=lambda s: s.get("peak_rss_bytes", 0), default=None)
    memory_note = f"heaviest step: {heaviest['name']}" if heaviest else ""
    shown = f"{peak / 1e9:.2f} GB of {bound / 1e9:.2f} GB"
    rows = [_ceiling_row("build peak RSS of the process tree / bound", 1.0, peak / bound, memory_note, shown)]
    target = build.get("time_target_s")
    minutes = f"{build['wall_s'] / 60:.1f} min"
    if target:
        rows.append(_ceiling_row("build time / 15 min", 1.0, build["wall_s"] / target, where, minutes))
    else:
        rows.append(["build time", "report", minutes, "-", "-", where])
    return rows


def target_rows(results: dict[str, Any]) -> list[list]:
    rows = []
    if "decode" in results:
        label = "decode, batch 1: onnxfn / llama-cpp-python in-process, same GGUF"
        rows.append(_speed_row(label, 1.0, results["decode"]["systems"], "onnxfn", "llamacpp", "tok_s",
                               decode_note(results)))  # fmt: skip
    if "prefill" in results:
        length = results["prefill"]["lengths"][0]
        systems = results["prefill"]["systems_by_length"][str(length)]
        label = f"prefill, {length} tokens: onnxfn / llama-cpp-python"
        rows.append(_speed_row(label, 2.0, systems, "onnxfn", "llamacpp", "tok_s", ttft_note(systems)))
    if results.get("concurrency", {}).get("levels"):
        level = results["concurrency"]["levels"][0]
        systems = results["concurrency"]["systems_by_level"][str(level)]
        label = f"{level} streams over HTTP: onnxfn's server / llama_cpp.server"
        rows.append(_speed_row(label, 3.0, systems, "onnxfn-http", "llamacpp-server", "aggregate_tok_s",
                               streams_note(systems)))  # fmt: skip
    if "servers" in results:
        value, note = serving_rss(results)
        rows.append(_ceiling_row("server RSS / (GGUF + KV pool)", 1.15, value, note))
    if "cold" in results:
        rows.append(cold_row(results))
        rows.append(snapshot_row(results))
    artifacts = results.get("artifacts", {})
    if artifacts:
        size = artifacts["onnxfn"]["total_bytes"] / artifacts["llamacpp"]["total_bytes"]
        note = f"{artifacts['onnxfn']['total_bytes'] / 1e6:,.0f} MB"
        if expanded := artifacts["onnxfn"].get("expanded_bytes"):
            note += f"; where it runs, {expanded / 1e6:,.0f} MB of scale tables expanded from its factors"
        if runs := results.get("profile", {}).get("this model", {}).get("runs"):
            note += f" (residual terms: {runs[-1]['residual_bytes'] / 1e6:,.0f} MB as float32)"
        rows.append(_ceiling_row("bundle / GGUF", 1.25, size, note))
    rows += build_rows(results)
    if "shipping" in results:
        rows.append(shipping.target_row(results["shipping"]))
    return rows


def render_header(results: dict[str, Any]) -> str:
    meta = results["meta"]
    facts = meta["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in facts["packages"].items())
    loads = ", ".join(f"{value:.1f}" for value in meta["load_averages"])
    share = meta["others_cpu_share"]
    busy = (
        "**the machine was busy: the ratios are noisy** (spin-waiting thread pools, llama.cpp's most, lose more than "
        "their share under contention)"
        if share > report.BUSY_SHARE
        else "the machine was quiet"
    )
    lines = [
        f"# onnxfn at size: {meta['model']} ({meta['published_config']}'s shape, {meta['mix']})",
        "",
        f"Run {meta['started']}, {meta['duration_s'] / 60:.1f} min{' (--quick)' if meta['quick'] else ''}. CPU: "
        f"{facts['cpu_model']} ({facts['logical_cpus']} logical, {', '.join(facts['cpu_flags'])}), "
        f"{facts['memory_gib']} GiB, Linux {facts['kernel']}, Python {facts['python']}. {meta['threads']} threads "
        "for every system.",
        "",
        f"GGUF `{meta['gguf']}` (synthetic: the published shape and llama.cpp's {meta['mix']} type mix, seeded random "
        f"weights, SmolLM2's tokenizer). Function `{meta['function']}` (precision gguf; quality gate set for random "
        f"weights: {meta['quality_gate']}); bundle `{meta['bundle']}`. Context {meta['max_context']} tokens for "
        f"every system. Prompts: token windows of `{meta['prompt_source']}`, identical across systems. Medians of "
        f"{meta['plan']['repetitions']} interleaved rounds after one warm-up round.",
        "",
        f"Load: other processes used {100 * share:.0f} % of all CPU time during the run; 1-minute load average "
        f"{meta['load_average_start']:.1f} at the start, then {loads or '-'} after each section, on "
        f"{facts['logical_cpus']} CPUs: {busy}.",
        "",
        f"Versions: {versions}.",
        "",
        SKIPPED,
        "",
    ]
    if build := facts.get("llamacpp_build"):
        lines += [report.render_llamacpp_build(build), ""]
    for section in ("in_process", "servers"):
        for name, error in results.get(section, {}).get("start_errors", {}).items():
            lines.append(f"- {name} did not start: {' '.join(error.split())[-400:]}")
    return "\n".join(lines) + "\n"


def render_serving(results: dict[str, Any]) -> str:
    rows = []
    pool = results["kv_pool_bytes"]
    kv_peer = results["artifacts"]["llamacpp"]["kv_bytes_per_token"] * results["meta"]["max_context"]
    holds = {"onnxfn-http": pool, "llamacpp-server": kv_peer, "onnxfn": pool, "llamacpp": kv_peer}
    for section in ("servers", "in_process"):
        for name, rss in results.get(section, {}).get("rss", {}).items():
            must = results["artifacts"][name]["weights_bytes"] + holds[name]
            rows.append([
                name, report.fmt(rss["loaded_rss_mib"], 0), report.fmt(rss["rss_mib"], 0),
                report.fmt(rss["peak_rss_mib"], 0), report.fmt(must / MIB, 0), f"{rss['rss_mib'] * MIB / must:.2f}",
            ])  # fmt: skip
    header = ["system", "RSS loaded MiB", "RSS after traffic MiB", "peak MiB", "weights + KV MiB", "RSS / that"]
    note = (
        "Resident memory of each serving process (servers: the server process alone) as loaded and after its "
        "section's traffic, beside what it must hold: its weights file (onnxfn: the bundle's graph weights; "
        "llama.cpp: the GGUF) and its KV cache (onnxfn: the KV pool, every slot the whole context, fp32 KV; "
        "llama.cpp: one f16 context).\n\n"
    )
    return "## Serving memory\n\n" + note + report.table(header, rows)


def render_profile(results: dict[str, Any]) -> str:
    kinds = [kind for kind, _ in KINDS]
    rows = []
    for label, entry in results["profile"].items():
        if "error" in entry:
            rows.append([label, f"error: {' '.join(entry['error'].split())[:200]}"] + [""] * (len(kinds) + 3))
            continue
        runs = entry["runs"]
        step = median([r["step_ms"] for r in runs])
        shares = [median([r["kinds_share"].get(kind, 0.0) for r in runs]) for kind in kinds]
        outside = median([r["outside_nodes_ms"] / r["step_ms"] for r in runs])
        nodes = runs[-1]["nodes_per_step"].get(RESIDUAL, 0)
        weights = runs[-1]["weights_bytes"]
        rows.append([
            label, runs[-1]["graph"], report.fmt(step, 1), *(f"{100 * s:.1f}" for s in shares),
            f"{100 * outside:.1f}", str(nodes), f"{100 * runs[-1]['residual_bytes'] / weights:.1f}",
        ])  # fmt: skip
    short = [kind.split(" (")[0] + " %" for kind in kinds]
    header = ["bundle", "graph", "decode step ms", *short, "outside nodes %", "residual nodes", "residual bytes %"]
    note = (
        "ONNX Runtime's profiler on single-token decode steps after a 32-token prompt (the graph the engine decodes "
        "with, the engine's session options), medians over the steps of every run, runs alternating between the "
        "bundles. Shares are of the step's wall time; `outside nodes` is the run's time no node's kernel accounts "
        "for (ONNX Runtime's own work between kernels); `residual bytes` is the residual tensors' share of "
        "the graph's weight bytes. The profiler's bookkeeping adds a little to every node, the "
        "small ones most, so the residual share is an upper bound.\n\n"
    )
    return "## Where a decode step's time goes, by kind of node\n\n" + note + report.table(header, rows)


def render_build(results: dict[str, Any]) -> str:
    build = results["build"]
    if not build:
        return "## Build\n\nThe bundle was given with --bundle: no build figures.\n"
    rows = [
        [s["name"], report.fmt(s["seconds"]), f"{100 * s['seconds'] / build['wall_s']:.0f} %",
         report.fmt(s.get("peak_rss_bytes", 0) / 1e9, 2), "reused" if s["cached"] else "built"]
        for s in build["report"]["steps"]
    ]  # fmt: skip
    rows.append(["**whole build** (sampled by the bench)", report.fmt(build["wall_s"]), "100 %",
                 report.fmt(build["peak_tree_rss_bytes"] / 1e9, 2), ""])  # fmt: skip
    note = (
        f"`{build['command']}`, finished {build['when']}: a fresh cache, so every step ran. Peak RSS is of the build's "
        f"whole process tree (the builder and verifier run in children), per step as `pkg build` samples it and for "
        f"the whole build as the bench sampled it. Bound: 2.5 GB + 2x the largest tensor in float32 = "
        f"{build['bound_bytes'] / 1e9:.2f} GB. Load average {build['load_average_start']:.1f} at the start, "
        f"{build['load_average_end']:.1f} at the end; other processes used {100 * build['others_cpu_share']:.0f} % "
        "of all CPU time meanwhile.\n\n"
    )
    return "## Build (`pkg build`)\n\n" + note + report.table(["step", "seconds", "share", "peak RSS GB", ""], rows)


RENDERERS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("decode", report.render_decode),
    ("limit", report.render_limit),
    ("prefill", report.render_prefill),
    ("concurrency", report.render_concurrency),
    ("servers", render_serving),
    ("cold", report.render_cold),
    ("profile", render_profile),
    ("build", render_build),
    ("shipping", shipping.render),
)


def render(results: dict[str, Any]) -> str:
    parts = [render_header(results), "## Targets (issue 48)\n\n" + report.table(HEADER, target_rows(results))]
    parts += [renderer(results) for key, renderer in RENDERERS if results.get(key)]
    return "\n".join(parts)
