"""The issues' targets, each read off one run.

A speed target (`Target`) is onnxfn's figure over a peer's that must reach a goal, by the medians and
round by round (the paired median and its 95 % interval decide whether the run shows it met). A footprint
target (`Ceiling`) is one figure of onnxfn's over a peer's, each measured once (bytes, peak RSS, mean KL
against fp32), that must stay at or below its goal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packager.bench.pairing import paired_interval
from packager.bench.stats import median


@dataclass(frozen=True)
class Target:
    label: str
    section: str  # `decode` or `concurrency`
    streams: int  # the concurrency level (1 for decode)
    system: str  # onnxfn's row
    peer: str
    goal: float  # onnxfn / peer must reach this

    def systems(self, results: dict[str, Any]) -> dict[str, dict[str, Any]]:
        if self.section == "decode":
            return results.get("decode", {}).get("systems", {})
        return results.get("concurrency", {}).get("systems_by_level", {}).get(str(self.streams), {})

    @property
    def key(self) -> str:
        return "tok_s" if self.section == "decode" else "aggregate_tok_s"


@dataclass(frozen=True)
class Ceiling:
    label: str
    section: str  # `artifacts`, `memory` or `quality`
    key: str  # the figure in each system's entry
    system: str  # onnxfn's row
    peer: str
    goal: float  # onnxfn / peer must stay at or below this

    def systems(self, results: dict[str, Any]) -> dict[str, dict[str, Any]]:
        if self.section == "quality":  # quality.json's layout: a list of rows, the bench's own name the system
            rows = (results.get("quality") or {}).get("candidates", [])
            return {row["system"]: row for row in rows if "system" in row}
        return results.get(self.section, {})


TARGETS = (
    Target("decode, batch 1: onnxfn / genai on the same bundle", "decode", 1, "onnxfn", "genai", 1.0),
    Target("decode, batch 1: onnxfn / genai on the builder's int8 export", "decode", 1, "onnxfn", "genai-int8", 1.2),
    Target("decode, batch 1: onnxfn / llama.cpp in-process on the same GGUF", "decode", 1, "onnxfn", "llamacpp", 1.3),
    Target("8 streams: onnxfn over HTTP / genai's static batch in-process", "concurrency", 8, "onnxfn-http", "genai",
           1.0),
    Target("8 streams: onnxfn over HTTP / genai int8's static batch in-process", "concurrency", 8, "onnxfn-http",
           "genai-int8", 1.2),
    Target("8 streams: onnxfn over HTTP / llama.cpp's server", "concurrency", 8, "onnxfn-http", "llamacpp-server", 2.0),
)  # fmt: skip
CEILINGS = (
    Ceiling("quality: mean KL vs fp32, onnxfn's bundle / genai's int8 export", "quality", "mean_kl", "onnxfn",
            "genai-int8", 1.0),
    Ceiling("size: onnxfn's bundle / the GGUF", "artifacts", "total_bytes", "onnxfn", "llamacpp", 1.5),
    # The served process's resident memory (VmRSS) after a batch-1 decode; the memory table shows the peaks
    # too (onnxfn's comes from start-up, while ONNX Runtime packs the weights).
    Ceiling("RSS serving: onnxfn's server / llama.cpp's server", "memory", "rss_mib", "onnxfn-http",
            "llamacpp-server", 1.3),
)  # fmt: skip
HEADER = ["target", "goal", "by medians", "round by round: median (95 % interval)", "this run"]


def verdict(goal: float, low: float, high: float) -> str:
    if low >= goal:
        return "met"
    return "tie: not shown either way" if high >= goal else "**missed**"


def rows(results: dict[str, Any]) -> list[list[str]]:
    """One row under `HEADER` per target whose two systems both have a figure in `results`."""
    found = []
    for target in TARGETS:
        systems = target.systems(results)
        mine, peer = systems.get(target.system, {}).get(target.key), systems.get(target.peer, {}).get(target.key)
        if not mine or not peer:
            continue
        cells = [target.label, f">= {target.goal:.1f}", f"{mine / peer:.2f}"]
        if paired := paired_interval(systems, target.peer, target.key, baseline=target.system):
            ratios, low, high = paired
            cells += [f"{median(ratios):.2f} ({low:.2f}-{high:.2f})", verdict(target.goal, low, high)]
        else:
            cells += ["-", "met" if mine / peer >= target.goal else "**missed**"]
        found.append(cells)
    for ceiling in CEILINGS:
        systems = ceiling.systems(results)
        mine, peer = systems.get(ceiling.system, {}).get(ceiling.key), systems.get(ceiling.peer, {}).get(ceiling.key)
        if mine is None or not peer:
            continue
        verdict_cell = "met" if mine / peer <= ceiling.goal else "**missed**"
        found.append([ceiling.label, f"<= {ceiling.goal:.1f}", f"{mine / peer:.2f}", "-", verdict_cell])
    return found
