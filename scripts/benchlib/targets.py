"""The runtime issue's speed targets, each read off one run: onnxfn's figure over a peer's, by the medians
and round by round (the paired median and its 95 % interval decide whether the run shows it met)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchlib.pairing import paired_interval
from benchlib.stats import median


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


TARGETS = (
    Target("decode, batch 1: onnxfn / genai on the same bundle", "decode", 1, "onnxfn", "genai", 1.0),
    Target(
        "8 streams: onnxfn over HTTP / genai's static batch in-process", "concurrency", 8, "onnxfn-http", "genai", 1.0
    ),
    Target("8 streams: onnxfn over HTTP / llama.cpp's server", "concurrency", 8, "onnxfn-http", "llamacpp-server", 2.0),
)
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
    return found
