"""The bench's arithmetic and its report's verdicts (no timing here: benchmarks are never tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from packager.bench import machine, pairing, report, targets
from packager.bench.sections import decode_rate
from packager.bench.stats import median_interval, percentile


def test_percentile_interpolates_between_order_statistics() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_decode_rate_excludes_the_first_token() -> None:
    # 11 tokens: the first at 0.5 s, the last at 1.5 s -> 10 decode steps in 1 s.
    assert decode_rate({"tokens": 11, "first": 0.5, "last": 1.5}) == pytest.approx(10.0)


def decode_results(onnxfn_tok_s: float, genai_tok_s: float) -> dict:
    ids = [1, 2, 3]
    return {
        "decode": {
            "prompt_tokens": 32,
            "new_tokens": 256,
            "systems": {
                "onnxfn": {"tok_s": onnxfn_tok_s, "ttft_s": 0.05, "token_ids": ids},
                "genai": {"tok_s": genai_tok_s, "ttft_s": 0.04, "token_ids": ids},
                "llamacpp-server": {"tok_s": 70.0, "ttft_s": 0.1, "token_ids": []},
                "transformers": {"error": "failed to start: no | module"},
            },
        }
    }


def test_report_says_when_onnxfn_loses() -> None:
    text = report.render_decode(decode_results(onnxfn_tok_s=100.0, genai_tok_s=125.0))
    genai_row = next(line for line in text.splitlines() if line.startswith("| genai "))
    assert "0.80" in genai_row
    assert "**onnxfn loses** (onnxfn)" in genai_row


def test_report_says_when_onnxfn_wins_and_keeps_failed_rows() -> None:
    text = report.render_decode(decode_results(onnxfn_tok_s=120.0, genai_tok_s=100.0))
    genai_row = next(line for line in text.splitlines() if line.startswith("| genai "))
    assert "1.20" in genai_row and "onnxfn wins" in genai_row
    # A server is compared with onnxfn over HTTP; without that figure the row says so instead of a ratio.
    server_row = next(line for line in text.splitlines() if line.startswith("| llamacpp-server "))
    assert "no onnxfn-http figure" in server_row
    failed_row = next(line for line in text.splitlines() if line.startswith("| transformers "))
    assert "error: failed to start: no / module" in failed_row  # a pipe would break the table


def test_throughput_mode_is_shown_beside_the_default_and_compared_with_each_peer() -> None:
    def entry(tok_s: float) -> dict:
        return {"aggregate_tok_s": tok_s, "ttft_p50_s": 0.5, "ttft_p99_s": 1.0, "tpot_p50_s": 0.1, "tpot_p99_s": 0.1}

    systems = {
        "onnxfn-http": entry(75.0),
        "onnxfn-http-throughput": entry(120.0),
        "llamacpp-server": entry(40.0),
        "genai": entry(60.0),
    }
    conc = {"levels": [8], "prompt_tokens": 32, "new_tokens": 64, "systems_by_level": {"8": systems}}
    text = report.render_concurrency({"concurrency": conc})
    variant_row = next(line for line in text.splitlines() if line.startswith("| 8 | onnxfn-http-throughput "))
    assert "onnxfn, decode = throughput" in variant_row and "loses" not in variant_row
    server_row = next(line for line in text.splitlines() if line.startswith("| 8 | llamacpp-server "))
    assert "1.88" in server_row  # against onnxfn's default, as before
    assert "- 8 streams, onnxfn-http-throughput against llamacpp-server 3.00x, genai 2.00x" in text


@pytest.mark.parametrize(("share", "warned"), [(0.0, False), (0.2, True)])
def test_the_busy_warning_follows_other_processes_cpu_share_not_the_load_average(share: float, warned: bool) -> None:
    machine = {"cpu_model": "x", "logical_cpus": 2, "cpu_flags": [], "memory_gib": 1, "kernel": "k", "python": "3"}
    meta = {
        "started": "now", "duration_s": 60, "quick": False, "threads": 2, "bundle": "b", "gguf": "g", "hf_dir": "h",
        "prompt_source": "p", "plan": {"repetitions": 5}, "notes": [], "others_cpu_share": share,
        "load_average_start": 1.6, "machine": {**machine, "packages": {}},
    }  # fmt: skip
    text = report.render_header({"meta": meta})
    assert ("the machine was busy" in text) is warned
    assert "1-min load average 1.6 at the start" in text


def test_the_header_names_the_llama_cpp_build_and_the_extensions_that_did_not_run() -> None:
    build = {
        "cmake_args": "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF",
        "probes": {"avx2": "runs", "avx512": "runs", "amx_tile": "no (kernel refused tile state)"},
    }
    machine = {"cpu_model": "x", "logical_cpus": 2, "cpu_flags": [], "memory_gib": 1, "kernel": "k", "python": "3"}
    meta = {
        "started": "now", "duration_s": 60, "quick": False, "threads": 2, "bundle": "b", "gguf": "g", "hf_dir": "h",
        "prompt_source": "p", "plan": {"repetitions": 5}, "notes": [], "others_cpu_share": 0.0,
        "load_average_start": 0.1, "machine": {**machine, "packages": {}, "llamacpp_build": build},
    }  # fmt: skip
    text = report.render_header({"meta": meta})
    assert "llama.cpp build: GGML_NATIVE=OFF with AVX2, AVX512 (" in text
    assert "did not run: amx_tile (kernel refused tile state)" in text
    del meta["machine"]["llamacpp_build"]  # results from before the record existed
    assert "llama.cpp build" not in report.render_header({"meta": meta})


def test_the_process_snapshot_row_is_compared_with_every_start_not_judged_against_onnxfn() -> None:
    def entry(total_s: float) -> dict:
        return {"total_s": total_s, "phases_s": {"exec_to_ready": total_s / 2}, "peak_rss_mib": None}

    systems = {
        "onnxfn": entry(1.0),
        "onnxfn-http": entry(1.2),
        "onnxfn-http-process-snapshot": entry(0.3),
        "llamacpp": entry(0.9),
    }
    cold = {"warm_cache": {"systems": systems}, "dropped_cache": {"skipped": "needs root"}, "floor_s": 0.07}
    text = report.render_cold({"cold": cold})
    row = next(line for line in text.splitlines() if line.startswith("| onnxfn-http-process-snapshot "))
    assert "onnxfn, resumed from a process snapshot" in row and "loses" not in row
    assert "| 300 |" in row
    assert "against each (their time / its time; above 1.00 it starts sooner): onnxfn 3.33x, onnxfn-http 4.00x, " \
        "llamacpp 3.00x" in text  # fmt: skip


def test_round_ratios_pair_each_round_with_the_right_baseline() -> None:
    def samples(*rates: float) -> dict:
        return {"samples": [{"tok_s": r} for r in rates]}

    systems = {
        "onnxfn": samples(100.0, 90.0, 120.0),
        "onnxfn-http": samples(80.0, 80.0, 80.0),
        "onnxfn-http-throughput": samples(40.0, 40.0, 40.0),
        "genai": samples(125.0, 90.0, 100.0),  # round by round: 0.80, 1.00, 1.20
        "llamacpp-server": samples(40.0, 20.0, 80.0),  # against onnxfn-http: 2.00, 4.00, 1.00
        "transformers": {"error": "failed to start"},
    }
    assert report.round_ratios(systems, "tok_s") == (
        "genai 0.80 to 1.20 (median 1.00, 95 % interval 0.80-1.20), "
        "llamacpp-server 1.00 to 4.00 (median 2.00, 95 % interval 1.00-4.00)"
    )
    text = report.render_decode(decode_results(onnxfn_tok_s=100.0, genai_tok_s=125.0))
    assert "round by round" not in text  # no samples kept: no line


def test_the_verdict_is_a_tie_when_the_round_by_round_interval_holds_one() -> None:
    def with_rounds(onnxfn: list[float], genai: list[float]) -> str:
        results = decode_results(
            onnxfn_tok_s=sorted(onnxfn)[len(onnxfn) // 2], genai_tok_s=sorted(genai)[len(genai) // 2]
        )
        systems = results["decode"]["systems"]
        systems["onnxfn"]["samples"] = [{"tok_s": r} for r in onnxfn]
        systems["genai"]["samples"] = [{"tok_s": r} for r in genai]
        text = report.render_decode(results)
        return next(line for line in text.splitlines() if line.startswith("| genai "))

    # The medians say 0.96, but the rounds go either way: the row keeps its ratio and calls it a tie.
    tie = with_rounds([96.0, 92.0, 110.0, 90.0, 104.0], [100.0, 104.0, 100.0, 97.0, 100.0])
    assert "| 0.96 | tie (" in tie and "loses" not in tie
    # Behind in every round: a loss, however small.
    behind = with_rounds([99.0, 98.0, 99.5, 98.5, 99.0], [100.0, 100.0, 100.0, 100.0, 100.0])
    assert "**onnxfn loses** (onnxfn)" in behind
    ahead = with_rounds([101.0, 102.0, 101.5, 103.0, 101.0], [100.0, 100.0, 100.0, 100.0, 100.0])
    assert "onnxfn wins" in ahead


def test_a_time_kept_round_by_round_is_judged_the_way_its_ratio_reads() -> None:
    """For a time, onnxfn is better when it is shorter: the paired rounds must say so as the ratio does."""
    table = {
        "onnxfn": {"total_s": 0.50, "samples": [{"total_s": t} for t in (0.50, 0.49, 0.51, 0.50, 0.50)]},
        "genai": {"total_s": 0.75, "samples": [{"total_s": t} for t in (0.75, 0.74, 0.76, 0.75, 0.75)]},
    }
    assert report.ratio("genai", table, "total_s", higher_is_better=False) == ("1.50", "onnxfn wins")
    assert pairing.paired_ratios(table, "genai", "total_s", higher_is_better=False)[0] > 1.0
    table["onnxfn"], table["genai"] = table["genai"], table["onnxfn"]
    assert report.ratio("genai", table, "total_s", higher_is_better=False) == ("0.67", "**onnxfn loses** (onnxfn)")


def test_the_median_interval_narrows_with_rounds_and_repeats_itself() -> None:
    few = [0.95, 1.04, 0.99, 1.06, 1.01]
    many = few * 6  # the same spread, six times the rounds
    low_few, high_few = median_interval(few)
    low_many, high_many = median_interval(many)
    assert low_few <= low_many <= 1.01 <= high_many <= high_few
    assert high_many - low_many < high_few - low_few
    assert median_interval(many) == (low_many, high_many)  # seeded: a report renders the same twice
    # A peer ahead in every round: the interval lies wholly above 1.0.
    assert median_interval([1.02, 1.03, 1.05, 1.04, 1.06, 1.03, 1.02, 1.04])[0] > 1.0


def test_the_written_json_renders_back_to_the_written_table(tmp_path: Path) -> None:
    """results.md is report.render(results.json): a newer report can re-render an old run unchanged."""
    results = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results.json").read_text())
    # In the run's order, not alphabetical: the baseline first, its peers after.
    systems = results["decode"]["systems"]
    results["decode"]["systems"] = {name: systems[name] for name in sorted(systems, key=lambda n: n != "onnxfn")}
    report.save(results, tmp_path)
    written = (tmp_path / "results.md").read_text()
    assert written.index("| onnxfn | ") < written.index("| genai | ")
    assert report.render(json.loads((tmp_path / "results.json").read_text())) == written


def test_the_targets_pair_onnxfn_over_http_with_genai_in_process_round_by_round() -> None:
    def samples(*rates: float, key: str = "aggregate_tok_s") -> dict:
        return {key: sorted(rates)[len(rates) // 2], "samples": [{key: r} for r in rates]}

    eight = {
        "onnxfn": samples(400.0, 400.0, 400.0),
        "onnxfn-http": samples(300.0, 330.0, 360.0),
        "genai": samples(310.0, 320.0, 340.0),  # against onnxfn-http: 0.97, 1.03, 1.06
        "llamacpp-server": samples(100.0, 150.0, 120.0),  # 3.00, 2.20, 3.00
    }
    results = {
        "decode": {
            "systems": {"onnxfn": samples(100, 100, 100, key="tok_s"), "genai": samples(120, 125, 130, key="tok_s")}
        },
        "concurrency": {"systems_by_level": {"8": eight}},
    }
    rendered = report.table(targets.HEADER, targets.rows(results))
    rows = [line for line in rendered.splitlines() if line.startswith("| ") and "goal" not in line]
    assert rows == [
        "| decode, batch 1: onnxfn / genai on the same bundle | >= 1.0 | 0.80 | 0.80 (0.77-0.83) | **missed** |",
        "| 8 streams: onnxfn over HTTP / genai's static batch in-process | >= 1.0 | 1.03 | 1.03 (0.97-1.06) "
        "| tie: not shown either way |",
        "| 8 streams: onnxfn over HTTP / llama.cpp's server | >= 2.0 | 2.75 | 3.00 (2.20-3.00) | met |",
    ]
    assert targets.rows({"decode": {"systems": {"onnxfn": samples(1.0, key="tok_s")}}}) == []  # no peer, no row


def test_a_job_waits_for_the_previous_systems_threads_to_stop_spinning() -> None:
    def run(busy_per_window: list[float], limit: float = 1.0) -> tuple[float, int]:
        counter = [0.0]
        reads = iter([step for busy in busy_per_window for step in (0.0, busy)])

        def busy_seconds() -> float:
            counter[0] += next(reads)
            return counter[0]

        sleeps: list[float] = []
        waited = machine.wait_until_quiet(0.05, 0.1, limit, busy_seconds, sleeps.append)
        return round(waited, 3), len(sleeps)

    cpus = os.cpu_count() or 1
    spinning = 0.05  # one thread busy for the whole window
    quiet = 0.001 * cpus
    assert run([spinning, spinning, quiet]) == (0.15, 3)  # two busy windows, then a quiet one
    assert run([quiet]) == (0.05, 1)
    assert run([spinning] * 30, limit=0.2) == (0.2, 4)  # never quiet: gives up at the limit


def test_the_issues_targets_read_speed_size_memory_and_quality_off_one_run() -> None:
    def samples(*rates: float, key: str) -> dict:
        return {key: sorted(rates)[len(rates) // 2], "samples": [{key: r} for r in rates]}

    def row(system: str, mean_kl: float) -> dict:
        return {"system": system, "precision": system, "mean_kl": mean_kl}

    results = {
        "decode": {
            "systems": {
                "onnxfn": samples(130.0, 125.0, 135.0, key="tok_s"),
                "genai-int8": samples(100.0, 100.0, 100.0, key="tok_s"),  # 1.30, 1.25, 1.35
                "llamacpp": samples(110.0, 100.0, 120.0, key="tok_s"),  # 1.18, 1.25, 1.12
            }
        },
        "concurrency": {
            "systems_by_level": {
                "8": {
                    "onnxfn-http": samples(300.0, 330.0, 360.0, key="aggregate_tok_s"),
                    "genai-int8": samples(250.0, 300.0, 250.0, key="aggregate_tok_s"),  # 1.20, 1.10, 1.44
                }
            }
        },
        "artifacts": {"onnxfn": {"total_bytes": 123e6}, "llamacpp": {"total_bytes": 98e6}},
        "memory": {
            "onnxfn-http": {"rss_mib": 400.0, "peak_rss_mib": 450.0},
            "llamacpp-server": {"rss_mib": 250.0, "peak_rss_mib": 250.0},
        },
        "quality": {"candidates": [row("onnxfn", 0.0027), row("genai-int8", 0.0044), row("genai-int4", 0.03)]},
    }
    rendered = report.table(targets.HEADER, targets.rows(results))
    rows = [line for line in rendered.splitlines() if line.startswith("| ") and "goal" not in line]
    assert rows == [
        "| decode, batch 1: onnxfn / genai on the builder's int8 export | >= 1.2 | 1.30 | 1.30 (1.25-1.35) | met |",
        "| decode, batch 1: onnxfn / llama.cpp in-process on the same GGUF | >= 1.3 | 1.18 | 1.18 (1.12-1.25) "
        "| **missed** |",
        "| 8 streams: onnxfn over HTTP / genai int8's static batch in-process | >= 1.2 | 1.32 | 1.20 (1.10-1.44) "
        "| tie: not shown either way |",
        "| quality: mean KL vs fp32, onnxfn's bundle / genai's int8 export | <= 1.0 | 0.61 | - | met |",
        "| size: onnxfn's bundle / the GGUF | <= 1.5 | 1.26 | - | met |",
        "| RSS serving: onnxfn's server / llama.cpp's server | <= 1.3 | 1.60 | - | **missed** |",
    ]
    # A figure one side lacks (memory not measured, a failed system) leaves its row out, as for speed.
    del results["memory"]["llamacpp-server"]
    results["quality"]["candidates"][1] = {"system": "genai-int8", "error": "failed"}
    labels = [cells[0] for cells in targets.rows(results)]
    assert not any(label.startswith(("peak RSS", "quality")) for label in labels)


def test_the_footprint_shows_each_artifact_once_against_the_gguf() -> None:
    def artifact(label: str, total: float) -> dict:
        return {"label": label, "weights_bytes": total, "total_bytes": total, "kv_bytes_per_token": 0}

    bundle = artifact("bundle (gguf)", 123.4e6)
    artifacts = {
        "onnxfn": bundle,
        "onnxfn-http": bundle,
        "genai-int8": artifact("genai export (int8)", 259e6),
        "genai-int4": artifact("genai export (int4)", 86e6),
        "llamacpp": artifact("GGUF model.gguf", 100e6),
    }
    text = report.render_footprint({"artifacts": artifacts})
    rows = [line for line in text.splitlines() if line.startswith("| ") and "/ GGUF" not in line]
    assert rows == [
        "| bundle (gguf) | onnxfn | 123.4 | 1.23 |",
        "| genai export (int8) | genai-int8 | 259.0 | 2.59 |",
        "| genai export (int4) | genai-int4 | 86.0 | 0.86 |",
        "| GGUF model.gguf | llamacpp | 100.0 | 1.00 |",
    ]


def test_the_quality_table_names_each_rows_system_and_where_its_figures_come_from() -> None:
    def row(system: str, precision: str, origin: str, passes: bool = True) -> dict:
        failures = [] if passes else ["mean KL 0.0300 > 0.02"]
        return {
            "system": system, "precision": precision, "origin": origin, "top1_agreement": 0.97, "mean_kl": 0.0027,
            "max_kl": 0.02, "perplexity": 34.0, "perplexity_increase_pct": 0.4, "greedy_match_prompts": 3,
            "greedy_prompts": 8, "passes": passes, "failures": failures,
        }  # fmt: skip

    figures = {
        "reference": "fp32",
        "chosen": "gguf",
        "method": {"prompts": 8, "continuation_tokens": 24, "kl": "KL", "perplexity": "held-out"},
        "candidates": [
            row("onnxfn", "gguf", "the bundle's quality.json"),
            row("genai-int4", "int4", "measured by this run", passes=False),
        ],
    }
    text = report.render_quality({"quality": figures})
    assert "Bundle precision: **gguf**" in text
    assert "| gguf | 0.970 | 0.0027 | 0.020 | 34.00 | 0.4 % | 3/8 | yes | onnxfn | the bundle's quality.json |" in text
    assert "| no: mean KL 0.0300 > 0.02 | genai-int4 | measured by this run |" in text
