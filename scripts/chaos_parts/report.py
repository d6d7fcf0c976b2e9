"""The chaos run's figures, as JSON and as the markdown of bench/chaos.md."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from scripts.chaos_parts.faults import KINDS, Fault
from scripts.chaos_parts.traffic import Call
from scripts.chaos_parts.world import IDLE_TIMEOUT


@dataclass
class Sample:
    """One look at a process: its resident memory and open file descriptors."""

    at: float  # seconds since the traffic started
    who: str  # gateway, chat, embed, lora, worker, driver
    pid: int
    rss_bytes: int
    fds: int


@dataclass
class Figures:
    seconds: float
    calls: list[Call]
    faults: list[Fault]
    samples: list[Sample]
    queue: dict[str, int]
    orphans: list[str]
    leftovers: list[str]  # cgroups, mounts left after the teardown
    restarts: dict[str, int]
    gateway_events: dict[str, int] = field(default_factory=dict)  # from its log: wakes, idle stops, restarts…
    notes: list[str] = field(default_factory=list)

    def by_kind(self) -> dict[str, dict[str, Any]]:
        table: dict[str, dict[str, Any]] = {}
        for kind in sorted({call.kind for call in self.calls}):
            calls = [call for call in self.calls if call.kind == kind]
            outcomes = Counter(call.outcome for call in calls)
            table[kind] = {
                "sent": len(calls),
                "answered": outcomes["ok"],
                "answered_after_retries": sum(1 for c in calls if c.outcome == "ok" and c.retries),
                "failed": outcomes["failed"],
                "hung": outcomes["hung"],
                "truncated_as_success": outcomes["truncated"],
                "causes": dict(Counter(c.cause for c in calls if c.outcome != "ok").most_common()),
                "p50_s": _quantile([c.seconds for c in calls if c.outcome == "ok"], 0.5),
                "p99_s": _quantile([c.seconds for c in calls if c.outcome == "ok"], 0.99),
            }
        return table

    def recovery(self) -> dict[str, dict[str, Any]]:
        table = {}
        for kind in KINDS:
            faults = [fault for fault in self.faults if fault.kind == kind]
            times = [fault.recovery_s for fault in faults if fault.recovery_s is not None]
            table[kind] = {
                "count": len(faults),
                "never_recovered": sum(1 for fault in faults if fault.recovery_s is None),
                "p50_s": _quantile(times, 0.5),
                "p99_s": _quantile(times, 0.99),
                "max_s": max(times) if times else None,
            }
        return table

    def drift(self) -> dict[str, dict[str, Any]]:
        """Per process kind: its longest-lived incarnation's first look after warm-up against its last (a
        restarted process is another pid), and the most any incarnation held."""
        per: dict[tuple[str, int], list[Sample]] = defaultdict(list)
        for sample in self.samples:
            per[(sample.who, sample.pid)].append(sample)
        table = {}
        for who in sorted({who for who, _ in per}):
            lives = [samples for (kind, _), samples in per.items() if kind == who]
            longest = max(lives, key=lambda samples: samples[-1].at - samples[0].at)
            first, last = longest[min(1, len(longest) - 1)], longest[-1]  # [0] may still be warming up
            everything = [sample for samples in lives for sample in samples]
            table[who] = {
                "incarnations": len(lives),
                "longest_s": round(last.at - first.at),
                "rss_mib": [round(first.rss_bytes / 2**20, 1), round(last.rss_bytes / 2**20, 1)],
                "rss_max_mib": round(max(s.rss_bytes for s in everything) / 2**20, 1),
                "fds": [first.fds, last.fds],
                "fds_max": max(s.fds for s in everything),
            }
        return table

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds),
            "requests": self.by_kind(),
            "recovery": self.recovery(),
            "faults": [fault.__dict__ for fault in self.faults],
            "queue": self.queue,
            "drift": self.drift(),
            "orphans": self.orphans,
            "leftovers": self.leftovers,
            "restarts_by_supervisor": self.restarts,
            "gateway_events": self.gateway_events,
            "notes": self.notes,
        }


def markdown(figures: Figures, command: str, machine: str) -> str:
    kinds, recovery, drift = figures.by_kind(), figures.recovery(), figures.drift()
    lines = [
        "# Chaos run: the local gateway and its functions under faults",
        "",
        f"`{command}` ({machine}). {figures.seconds / 60:.1f} minutes of mixed traffic through the gateway to",
        "three functions (the demo chat, an embedding function, the demo with a LoRA adapter) and an SQS queue",
        f"served by the worker, each function idling after {IDLE_TIMEOUT} s (so pauses in the traffic make idle ->",
        "wake cycles), while faults were injected at random every 8-20 s. Generated by scripts/chaos.py.",
        "",
        "## Requests",
        "",
        "| kind | sent | answered | (after retries) | failed | hung | truncated as success | p50 / p99 s "
        "| failures by cause |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in kinds.items():
        causes = ", ".join(f"{cause} x{count}" for cause, count in row["causes"].items()) or "-"
        lines.append(
            f"| {kind} | {row['sent']} | {row['answered']} | {row['answered_after_retries']} | {row['failed']} | "
            f"{row['hung']} | {row['truncated_as_success']} | {_s(row['p50_s'])} / {_s(row['p99_s'])} | {causes} |"
        )
    total = Counter(call.outcome for call in figures.calls)
    lines += [
        "",
        f"Clients that hung: **{total['hung']}** (goal 0). Truncated streams reported as success: "
        f"**{total['truncated']}** (goal 0). Failed requests are errors the client was told about (an HTTP "
        "error or a stream's error event); clients send again what reached nothing (the gateway down) or was "
        "told when to retry (429/503 with Retry-After), for up to 60 s.",
        "",
        "## Queue",
        "",
        f"Messages sent {figures.queue.get('sent', 0)}, results stored {figures.queue.get('answered', 0)}, "
        f"dead-lettered {figures.queue.get('dead_lettered', 0)}, still queued {figures.queue.get('queued', 0)}, "
        f"**lost {figures.queue.get('lost', 0)}** (goal 0), results written more than once "
        f"{figures.queue.get('duplicates', 0)}. Real SQS worker (`python -m runtime worker`, the embedding "
        "bundle) against moto's SQS and S3, SIGKILLed by the `kill_worker` fault and started again.",
        "",
        "## Recovery after each fault",
        "",
        "| fault | count | never recovered | p50 s | p99 s | max s |",
        "|---|---|---|---|---|---|",
    ]
    for kind, row in recovery.items():
        lines.append(
            f"| {kind} | {row['count']} | {row['never_recovered']} | {_s(row['p50_s'])} | {_s(row['p99_s'])} | "
            f"{_s(row['max_s'])} |"
        )
    lines += [
        "",
        _cut_streams(figures.faults),
        "",
        "Recovery: from the fault (a full disk: from the moment it had space again) until a probe to the",
        "function concerned succeeded (probing every 0.1 s); for `redeploy`, how long `pkg deploy` took (its",
        "traffic's failures are in the table above); for `kill_worker`, until a probe message's result landed.",
        "",
        "## Drift",
        "",
        "Sampled every 5 s. Per process: how many incarnations it had (a kill, an idle stop, a redeploy each end",
        "one), its longest-lived one from its second look to its last, and the most any of them held.",
        "",
        "| process | incarnations | longest s | RSS MiB (longest) | max RSS MiB | fds (longest) | max fds |",
        "|---|---|---|---|---|---|---|",
    ]
    for who, row in drift.items():
        lines.append(
            f"| {who} | {row['incarnations']} | {row['longest_s']} | {row['rss_mib'][0]} -> {row['rss_mib'][1]} | "
            f"{row['rss_max_mib']} | {row['fds'][0]} -> {row['fds'][1]} | {row['fds_max']} |"
        )
    lines += [
        "",
        "## What the gateway did",
        "",
        ", ".join(f"{event}: {count}" for event, count in figures.gateway_events.items()) or "-",
    ]
    lines += [
        "",
        "## After the run",
        "",
        f"Orphan processes: **{len(figures.orphans)}** (goal 0){_listed(figures.orphans)}.",
        f"Leftover cgroups or mounts: {len(figures.leftovers)}{_listed(figures.leftovers)}.",
        f"Restarts by the run's supervisor (as an init system would): gateway {figures.restarts.get('gateway', 0)}, "
        f"worker {figures.restarts.get('worker', 0)}.",
        "",
        "## Faults, in order",
        "",
        "| t s | fault | target | recovery s | note |",
        "|---|---|---|---|---|",
    ]
    start = min((fault.at for fault in figures.faults), default=0.0)
    for fault in figures.faults:
        note = fault.note.replace("|", "/").replace("\n", " ")[:160]
        lines.append(f"| {fault.at - start:.0f} | {fault.kind} | {fault.target} | {_s(fault.recovery_s)} | {note} |")
    if figures.notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in figures.notes)]
    return "\n".join(lines) + "\n"


def _cut_streams(faults: list[Fault]) -> str:
    """What the streams in flight when `kill_server` struck saw."""
    seen = Counter(fault.note.removeprefix("the stream in flight: ") for fault in faults if fault.kind == "kill_server")
    said = ", ".join(f"{outcome}: {count}" for outcome, count in seen.most_common()) or "none"
    return f"Each `kill_server` struck while a stream from that server was under way; how those ended: {said}."


def _listed(items: list[str]) -> str:
    return ": " + "; ".join(items) if items else ""


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[round(q * 100) - 1]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
