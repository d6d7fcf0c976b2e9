"""Ratios of two systems paired round by round: each round runs every system once, so a pair shares the
host's state of that minute, and the median of the paired ratios is the estimate a drift of the host over
the run moves least."""

from __future__ import annotations

from typing import Any

from packager.bench.stats import median_interval
from packager.bench.systems import SERVERS


def baseline_of(system: str) -> str:
    """What a system's row is compared with: onnxfn over HTTP for a server, the in-process engine otherwise."""
    return "onnxfn-http" if system in SERVERS else "onnxfn"


def paired_ratios(
    systems: dict[str, dict[str, Any]],
    system: str,
    key: str,
    higher_is_better: bool = True,
    baseline: str | None = None,
) -> list[float]:
    """`baseline` (default `baseline_of(system)`) against `system` round by round (sorted), from the samples
    both kept. Empty without samples. Oriented as the report's `onnxfn x`: above 1.00 the baseline is better,
    for a rate and for a time alike."""
    entry, base = systems.get(system, {}), systems.get(baseline or baseline_of(system), {})
    if "samples" not in entry or "samples" not in base:
        return []
    pairs = [(mine[key], peer[key]) for mine, peer in zip(base["samples"], entry["samples"], strict=False)]
    return sorted(mine / peer if higher_is_better else peer / mine for mine, peer in pairs if mine and peer)


def paired_interval(
    systems: dict[str, dict[str, Any]],
    system: str,
    key: str,
    higher_is_better: bool = True,
    baseline: str | None = None,
) -> tuple[list[float], float, float] | None:
    """`paired_ratios` with the bootstrap 95 % interval of their median; None without samples."""
    ratios = paired_ratios(systems, system, key, higher_is_better, baseline)
    return (ratios, *median_interval(ratios)) if ratios else None
