"""The adapters section's arithmetic and rendering, on synthetic figures (no timing: benchmarks are never tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packager.bench import adapters, report


def rows(base: list[float], key: str = "tok_s", **others: list[float]) -> dict:
    """`interleave`'s output: each row's per-round samples."""
    out = {"base": {"samples": [{key: v} for v in base]}}
    out.update({name.replace("_", " "): {"samples": [{key: v} for v in values]} for name, values in others.items()})
    return out


def figures(four: list[float]) -> dict:
    base = [100.0, 104.0, 96.0, 100.0, 102.0]
    streams = rows(base, **{"0_adapters": [98.0] * 5, "1_adapter": [95.0] * 5, "4_adapters": four})
    return {
        "bundle": "/cache/bench-adapters/build/bench-adapters/bundle",
        "base_bundle": "/repo/build/smollm2-chat/bundle",
        "adapters": list(adapters.ADAPTERS),
        "rank": 8,
        "modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "file_bytes": {name: 3_600_000 for name in adapters.ADAPTERS},
        "batch1": {
            "new_tokens": 256,
            "prompt_tokens": 32,
            "rows": adapters.summarise(
                rows([40.0] * 5, **{"0_adapters": [38.0] * 5, "1_adapter": [36.0] * 5}), "tok_s"
            ),
        },
        "streams": {
            "streams": 8,
            "new_tokens": 64,
            "prompt_tokens": 32,
            "rows": adapters.summarise(streams, "tok_s"),
            "end_to_end": adapters.summarise(rows([80.0] * 5, "end_to_end_tok_s", x=[60.0] * 5), "end_to_end_tok_s"),
        },
        "loads": {
            "loads": [{"seconds": s, "nbytes": 3_500_000} for s in (0.004, 0.002, 0.003, 0.005)],
            "slot_bytes": 4_000_000,
        },
        "run": {"started": "now", "duration_s": 120.0, "rounds": 5, "others_cpu_share": 0.01, "load_average_start": 1},
    }


def test_each_row_is_its_median_against_the_bases_and_paired_round_by_round() -> None:
    summary = adapters.summarise(rows([100.0, 104.0, 96.0], x=[90.0, 91.0, 94.0]), "tok_s")
    assert summary["base"]["tok_s"] == 100.0 and "ratio" not in summary["base"]
    assert summary["x"]["tok_s"] == 91.0
    assert summary["x"]["ratio"] == pytest.approx(0.91)
    # Round by round: 90/100, 91/104, 94/96 -> median 0.9.
    assert summary["x"]["paired"]["median"] == pytest.approx(0.9)
    low, high = summary["x"]["paired"]["interval"]
    assert low <= 0.9 <= high


def test_a_failed_row_stays_in_the_summary() -> None:
    summary = adapters.summarise({**rows([100.0]), "4 adapters": {"error": "worker exited"}}, "tok_s")
    assert summary["4 adapters"] == {"error": "worker exited"}


@pytest.mark.parametrize(
    ("four", "verdict"),
    [
        ([90.0, 92.0, 88.0, 91.0, 90.0], "met"),
        ([70.0, 72.0, 68.0, 71.0, 70.0], "**missed**"),
        ([80.0, 90.0, 86.0, 84.0, 88.0], "holds 0.85"),
    ],
)
def test_the_target_is_met_missed_or_undecided_by_the_round_by_round_interval(four: list[float], verdict: str) -> None:
    _, said = adapters.verdict(figures(four))
    assert verdict in said
    text = adapters.render({"adapters": figures(four)})
    assert "Target: 8 streams over 4 adapters >= 0.85x the base" in text


def test_the_table_has_every_row_the_issue_asks_for() -> None:
    text = adapters.render({"adapters": figures([90.0] * 5)})
    lines = text.splitlines()
    batch1 = [line for line in lines if line.startswith("| decode, batch 1")]
    streams = [line for line in lines if line.startswith("| decode, 8 streams")]
    assert [line.split(" | ")[1] for line in batch1] == list(adapters.ROWS)
    assert [line.split(" | ")[1] for line in streams] == list(adapters.ROWS)
    assert "one row holds one adapter" in batch1[-1]  # no 4-adapter figure at batch 1
    base = next(line for line in streams if line.split(" | ")[1] == "base")
    assert "| 1.00 | baseline |" in base
    four = next(line for line in streams if line.split(" | ")[1] == "4 adapters")
    assert "| 0.90 |" in four  # 90 against the base's median 100
    assert "**3.5 ms** median of 4" in text  # the 4 cold loads: 2, 3, 4, 5 ms
    assert "3.60 MB converted file" in text and "4.00 MB per slot" in text
    assert "prefill included, as the concurrency section), tok/s (/ base): base 80.0, x 60.0 (0.75)." in text
    assert "llama.cpp" in text and "onnxruntime-genai" in text  # why no peer has these rows


def test_an_unbuilt_section_says_why() -> None:
    text = adapters.render({"adapters": {"error": "the adapter bundle could not be built: no peft", "run": {}}})
    assert "not measured: the adapter bundle could not be built: no peft" in text


def test_an_adapters_only_run_keeps_the_committed_sections(tmp_path: Path) -> None:
    committed = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results.json").read_text())
    committed.pop("adapters", None)
    report.save(committed, tmp_path)
    before = (tmp_path / "results.md").read_text()
    merged = adapters.merge(tmp_path, figures([90.0] * 5))
    assert merged is not None
    report.save(merged, tmp_path)
    after = (tmp_path / "results.md").read_text()
    assert after.startswith(before.rstrip("\n"))  # every other section as it was, the adapters after them
    assert "## LoRA adapters per request" in after
    assert json.loads((tmp_path / "results.json").read_text())["decode"] == committed["decode"]
    assert adapters.merge(tmp_path / "empty", figures([90.0] * 5)) is None
