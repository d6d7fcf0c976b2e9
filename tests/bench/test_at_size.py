"""The bench at size (packager/bench/at_size*.py, synthetic_models.py, node_profile.py), on a tiny GGUF.

The 1B/8B builds are the bench's, never the suite's: here the same code builds the tiny every-type GGUF
(tests/fixtures/tiny_gguf.py) with a real `pkg build --json` in a fresh cache, profiles a real decode step of the
bundle, and renders hand-made results whose verdicts are known. No timing is asserted, only what was measured.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from packager.bench import at_size, at_size_report, node_profile, suite
from packager.bench import synthetic_models as models
from packager.bench.systems import PROCESS_SNAPSHOT
from packager.spec import load_spec
from runtime.bundle import open_bundle
from tests.fixtures.tiny_gguf import FFN, HIDDEN, KV_HEADS, LAYERS, write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Path]:
    """(GGUF, the build record, the root the build ran in): the tiny GGUF built by `run_build`."""
    root = tmp_path_factory.mktemp("at-size")
    gguf = write_tiny_gguf(root / "tiny.gguf")
    folder = root / "build" / "tiny-at-size" / "function"
    folder.mkdir(parents=True)
    gate = "".join(f"{key} = {value}\n" for key, value in models.QUALITY_GATE.items())
    text = f'name = "tiny-at-size"\n[model]\nsource = "gguf:{gguf}"\n[export]\nprecision = "gguf"\nmax_context = 256\n'
    (folder / "function.toml").write_text(text + f"[export.quality]\n{gate}")
    record = models.run_build(root, folder, root / "build.log")
    return gguf, record, root


def test_a_build_is_measured_step_by_step_in_a_fresh_cache_that_it_removes(
    tiny_build: tuple[Path, dict[str, Any], Path],
) -> None:
    _, record, root = tiny_build
    steps = record["report"]["steps"]
    assert [s["name"] for s in steps][-1] == "bundle"
    # A fresh cache: every step ran the first time it came (the gguf candidate reuses the export the reference made)
    first = {s["name"]: s for s in reversed(steps)}
    assert not any(s["cached"] for s in first.values())
    assert all(s["peak_rss_bytes"] > 0 for s in steps)
    assert record["peak_tree_rss_bytes"] > 0 and record["wall_s"] >= sum(s["seconds"] for s in steps)
    assert [p.name for p in (root / "build" / "tiny-at-size").iterdir() if p.name.startswith("cache-")] == []
    # The bundle's files were hard links into that cache: they are whole after it is gone.
    bundle = Path(record["report"]["bundle"])
    assert open_bundle(bundle, verify=True).manifest.digest == record["report"]["digest"]


def test_a_recorded_bundle_is_reused_only_while_it_is_the_one_built_from_that_gguf(
    tiny_build: tuple[Path, dict[str, Any], Path], tmp_path: Path
) -> None:
    gguf, record, _ = tiny_build
    bundle = Path(record["report"]["bundle"])
    mine = {**record, "gguf": str(gguf)}
    assert models.reusable(bundle, mine, gguf)
    assert not models.reusable(bundle, mine, tmp_path / "other.gguf")
    assert not models.reusable(bundle, None, gguf)
    assert not models.reusable(bundle, {**mine, "report": {**record["report"], "digest": "sha256:0"}}, gguf)


def test_the_memory_bound_is_2_5_gb_plus_twice_the_largest_tensor_in_fp32(
    tiny_build: tuple[Path, dict[str, Any], Path],
) -> None:
    gguf, record, _ = tiny_build
    vocab = open_bundle(Path(record["report"]["bundle"])).manifest.decoder.vocab_size
    largest = max(vocab * HIDDEN, HIDDEN * FFN)  # the tiny model's FFN matrices outgrow its embedding
    assert models.memory_bound(gguf) == 2.5e9 + 2 * 4 * largest


def test_a_decode_step_is_split_by_kind_of_node_with_the_residual_nodes_apart(
    tiny_build: tuple[Path, dict[str, Any], Path],
) -> None:
    _, record, _ = tiny_build
    figures = node_profile.profile_decode(Path(record["report"]["bundle"]), threads=1, prompt=8, steps=4)
    assert figures["steps"] == 3  # the prompt's run and the first decode step are not counted
    kinds = figures["nodes_per_step"]
    # Q4_1, Q5_1, Q2_K, Q4_K and Q5_K carry a block minimum: their matmuls have residual nodes
    assert kinds[node_profile.RESIDUAL] > 0 and kinds["MatMulNBits (quantized weights)"] > 0
    assert kinds["attention (GroupQueryAttention)"] == LAYERS
    assert 0 < sum(figures["kinds_share"].values()) <= 1.0 + 1e-9
    assert figures["outside_nodes_ms"] >= 0
    assert 0 < figures["residual_bytes"] < figures["weights_bytes"]


def test_the_systems_read_the_bundle_and_the_gguf_with_their_own_kv_types(
    tiny_build: tuple[Path, dict[str, Any], Path],
) -> None:
    gguf, record, _ = tiny_build
    bundle = Path(record["report"]["bundle"])
    found = at_size.artifacts(bundle, gguf)
    facts = open_bundle(bundle).manifest.decoder
    head_dim = facts.head_dim
    assert found["llamacpp"].weights_bytes == gguf.stat().st_size
    assert found["llamacpp"].kv_bytes_per_token == 2 * LAYERS * KV_HEADS * head_dim * 2  # f16
    assert found["onnxfn"].kv_bytes_per_token == facts.kv_bytes_per_token()
    # onnxfn's kernels read its graph's initializers: the blocks, and the scale tables expanded from the factors the
    # bundle ships instead (runtime/engine/tables.py), which are larger than those factors.
    manifest = open_bundle(bundle).manifest
    files = sum(e.size for n, e in manifest.files.items() if n.startswith("model.onnx"))
    assert found["onnxfn"].expanded_bytes == manifest.table_bytes > 0
    assert files < found["onnxfn"].weights_bytes < files + manifest.table_bytes


def test_split_by_kind_counts_only_the_decode_runs_and_what_no_node_accounts_for() -> None:
    def run(ts: int, dur: int) -> dict[str, Any]:
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(ts: int, dur: int, op: str, name: str) -> dict[str, Any]:
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [run(0, 1000), node(10, 900, "MatMulNBits", "/prompt/MatMulNBits")]  # the prompt: skipped
    for start in (2000, 3000):
        events += [
            run(start, 100),
            node(start + 1, 60, "MatMulNBits", "/model/layers.0/mlp/down_proj/MatMulNBits"),
            node(start + 61, 10, "MatMul", "/model/layers.0/mlp/down_proj/residual/MatMul"),
            node(start + 71, 5, "ReduceSum", "/model/layers.0/mlp/down_proj/block_sums/ReduceSum"),
            node(start + 76, 4, "GroupQueryAttention", "/model/layers.0/attn/GroupQueryAttention"),
            {"cat": "Node", "name": "x_fence_before", "ts": start + 80, "dur": 50},  # not a kernel's time
        ]
    figures = node_profile.split_by_kind(events, skip_runs=1)
    assert figures["steps"] == 2 and figures["step_ms"] == pytest.approx(0.1)
    assert figures["kinds_ms"] == pytest.approx(
        {"GGUF residual (block sums, residual MatMul + Add)": 0.015, "MatMulNBits (quantized weights)": 0.06,
         "attention (GroupQueryAttention)": 0.004}
    )  # fmt: skip
    assert figures["outside_nodes_ms"] == pytest.approx(0.021)
    assert figures["nodes_per_step"][node_profile.RESIDUAL] == 2
    with pytest.raises(ValueError, match="no decode run"):
        node_profile.split_by_kind(events[:2], skip_runs=1)


def test_the_function_written_for_a_synthetic_model_is_precision_gguf_with_the_explicit_gate(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    folder = models.write_function(tmp_path, models.MODELS["synthetic-8b"], gguf, threads=2)
    spec = load_spec(folder)
    assert spec.name == "synthetic-8b" and spec.model.source == f"gguf:{gguf}"
    assert spec.export.precision == "gguf" and spec.export.max_context == models.MAX_CONTEXT
    quality = spec.export.quality
    assert (quality.min_top1_agreement, quality.max_mean_kl, quality.max_perplexity_increase_pct) == (0.5, 0.5, 50.0)
    assert spec.runtime.max_batch == models.MAX_BATCH and spec.runtime.threads == 2


def test_no_arguments_still_bench_the_demo_and_a_synthetic_model_gets_its_own_sections() -> None:
    demo = suite.parse_args([])
    assert (demo.model, demo.sections, demo.out) == ("smollm2", list(suite.SECTIONS), REPO / "bench")
    big = suite.parse_args(["--model", "synthetic-8b"])
    assert (big.sections, big.out, big.mix, big.rebuild) == (list(at_size.SECTIONS), REPO / "bench" / "synthetic-8b",
                                                             "q4_k_m", False)  # fmt: skip
    assert suite.parse_args(["--model", "synthetic-1b", "--sections", "decode,build"]).sections == ["decode", "build"]
    with pytest.raises(SystemExit):
        suite.parse_args(["--model", "synthetic-1b", "--sections", "ray"])  # not a section at size


# Hand-made results of a run at size whose verdicts are known: met, missed (kept, with where it goes), a tie.
def _results() -> dict[str, Any]:
    def samples(key: str, values: list[float]) -> dict[str, Any]:
        return {key: sorted(values)[len(values) // 2], "samples": [{key: v} for v in values]}

    machine = {"cpu_model": "cpu", "cpu_flags": ["avx2"], "logical_cpus": 2, "memory_gib": 23.0, "kernel": "6",
               "python": "3.11", "packages": {"onnxfn": "0"}, "llamacpp_build": None}  # fmt: skip
    meta = {"started": "now", "duration_s": 60.0, "quick": False, "threads": 2, "model": "synthetic-1b",
            "published_config": "llama-3.2-1b", "mix": "q4_k_m", "function": "f", "bundle": "b", "gguf": "g",
            "prompt_source": "p", "plan": {"repetitions": 3}, "max_context": 1024,
            "quality_gate": models.QUALITY_GATE, "machine": machine, "load_average_start": 4.0,
            "load_averages": [5.0, 6.0], "others_cpu_share": 0.5}  # fmt: skip
    rss = {"loaded_rss_mib": 900.0, "rss_mib": 1000.0, "peak_rss_mib": 1100.0}
    gib = 1 << 30
    artifact = {"label": "x", "weights_bytes": gib // 2, "total_bytes": gib // 2, "kv_bytes_per_token": 1024}
    step = {"name": "carry", "seconds": 300.0, "cached": False, "peak_rss_bytes": 2 * 10**9}
    return {
        "meta": meta,
        "decode": {"prompt_tokens": 32, "new_tokens": 128, "systems": {
            "onnxfn": {**samples("tok_s", [12.0, 13.0, 14.0]), "ttft_s": 0.1, "token_ids": [1]},
            "llamacpp": {**samples("tok_s", [10.0, 10.0, 10.0]), "ttft_s": 0.2, "token_ids": [2]}}},
        "prefill": {"lengths": [512], "systems_by_length": {"512": {
            "onnxfn": {**samples("tok_s", [150.0, 160.0, 170.0]), "ttft_s": 3.2},
            "llamacpp": {**samples("tok_s", [100.0, 100.0, 100.0]), "ttft_s": 5.1}}}},
        "concurrency": {"levels": [8], "prompt_tokens": 32, "new_tokens": 32, "systems_by_level": {"8": {
            "onnxfn-http": {**samples("aggregate_tok_s", [20.0, 40.0, 50.0]), "ttft_p50_s": 1, "ttft_p99_s": 2,
                            "tpot_p50_s": 0.1, "tpot_p99_s": 0.2},
            "llamacpp-server": {**samples("aggregate_tok_s", [10.0, 10.0, 10.0]), "ttft_p50_s": 1, "ttft_p99_s": 2,
                                "tpot_p50_s": 0.1, "tpot_p99_s": 0.2}}}},
        "servers": {"rss": {"onnxfn-http": rss, "llamacpp-server": rss}, "start_errors": {}},
        "kv_pool_bytes": 256 << 20,
        "artifacts": {name: artifact for name in ("onnxfn", "onnxfn-http", "llamacpp", "llamacpp-server")},
        "build": {"when": "then", "command": "pkg build", "wall_s": 1200.0, "peak_tree_rss_bytes": 4.2e9,
                  "bound_bytes": 3.3e9, "time_target_s": 900.0, "load_average_start": 3.0, "load_average_end": 4.0,
                  "others_cpu_share": 0.3, "report": {"steps": [step]}},
    }  # fmt: skip


def test_the_targets_table_keeps_every_target_with_its_verdict_and_where_it_goes() -> None:
    text = at_size_report.render(_results())
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| met |" in rows["decode, batch 1: onnxfn / llama-cpp-python in-process, same GGUF"]
    assert "**missed**" in rows["prefill, 512 tokens: onnxfn / llama-cpp-python"]  # 1.6x of the 2x goal
    assert "tie: not shown either way" in rows["8 streams over HTTP: onnxfn's server / llama_cpp.server"]
    # 1000 MiB over 512 MiB of GGUF + 256 MiB of KV pool
    assert "| 1.30 | - | **missed** | RSS 1,000 MiB" in rows["server RSS / (GGUF + KV pool)"]
    assert "4.20 GB of 3.30 GB" in rows["build peak RSS of the process tree / bound"]
    assert "20.0 min | - | **missed** | largest step: carry 25 %" in rows["build time / 15 min"]
    assert "the machine was busy: the ratios are noisy" in text and "32 GB" in text  # the load, what was skipped


def test_a_run_that_lost_a_system_still_renders_its_targets() -> None:
    results = copy.deepcopy(_results())
    results["decode"]["systems"]["llamacpp"] = {"error": "llamacpp worker exited with -4"}
    del results["build"]
    results["build"] = None
    results["meta"]["others_cpu_share"] = 0.0
    text = at_size_report.render(results)
    assert "error: llamacpp worker exited with -4" in text and "the machine was quiet" in text
    assert "no build record" in text
    json.dumps(results)  # results stay JSON


def test_the_kv_pool_is_every_slot_holding_the_whole_context(tiny_build: tuple[Path, dict[str, Any], Path]) -> None:
    _, record, _ = tiny_build
    bundle = Path(record["report"]["bundle"])
    prepared = models.Prepared(models.MODELS["synthetic-1b"], "q4_1", Path("x.gguf"), load_spec(REPO / "functions" /
                               "smollm2-chat"), bundle, None)  # fmt: skip
    config = at_size.system_config(prepared, "onnxfn-http", threads=2)
    per_token = open_bundle(bundle).manifest.decoder.kv_bytes_per_token()
    assert config.max_context == models.MAX_CONTEXT and config.max_batch == models.MAX_BATCH
    assert at_size.kv_pool_bytes(config) >= models.MAX_BATCH * models.MAX_CONTEXT * per_token
    assert at_size.kv_pool_bytes(config) < models.MAX_BATCH * models.MAX_CONTEXT * per_token + (1 << 20)


def test_the_fresh_start_and_the_wake_from_a_process_snapshot_are_rows_of_the_targets() -> None:
    results = copy.deepcopy(_results())
    fresh = {"phases_s": {"imports": 0.5}, "peak_rss_mib": 900.0}
    results["cold"] = {"floor_s": 0.3, "dropped_cache": {"skipped": "not at size"}, "warm_cache": {"systems": {
        "onnxfn-http": {**fresh, "total_s": 3.0, "samples_s": [3.0, 3.1, 2.9]},
        "llamacpp": {**fresh, "total_s": 2.0, "samples_s": [2.0, 2.0, 2.0]},
        PROCESS_SNAPSHOT: {"total_s": 0.4, "phases_s": {"criu_restore": 0.25}, "peak_rss_mib": None,
                           "samples_s": [0.4, 0.4, 0.4], "dump_bytes": 1.5e9, "dump_s": 4.0}}}}  # fmt: skip
    text = at_size_report.render(results)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    fresh_row = rows["fresh start (page cache warm): onnxfn's server / llama-cpp-python load to first token"]
    assert "| <= 1.2 | 1.50 | 1.50 (" in fresh_row and "**missed**" in fresh_row
    wake = rows["wake from a process snapshot (CRIU restore) to first token; the dump's size"]
    assert "| 400 ms; dump 1,500 MB |" in wake and "criu restore 250 ms" in wake and "llamacpp fresh start" in wake
    results["cold"]["warm_cache"]["systems"][PROCESS_SNAPSHOT] = {"error": "CRIU is not installed"}
    text = at_size_report.render(results)
    assert "error: CRIU is not installed" in text


def test_shipping_is_a_row_of_the_targets_with_each_commands_peak_and_its_own_section() -> None:
    results = copy.deepcopy(_results())
    commands = [
        {"command": "pkg image build", "seconds": 8.0, "peak_rss_bytes": 95 << 20},
        {"command": "pkg image push", "seconds": 6.0, "peak_rss_bytes": 90 << 20},
        {"command": "pkg push", "seconds": 12.0, "peak_rss_bytes": 55 << 20},
    ]
    install = [{"event": "installed", "phases": {"switch": 0.0, "digest": 0.5, "load_and_smoke": 5.0}}]
    results["shipping"] = {"bundle_bytes": 758e6, "bound_bytes": 3.31e9, "commands": commands, "install": install}
    text = at_size_report.render(results)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    row = rows["image build, image push, pkg push: peak RSS of the process tree / bound"]
    assert "| 95 MiB of 3.31 GB | - | met |" in row and "pkg push 55 MiB; the bundle is 758 MB" in row
    assert "| pkg image build | 8.0 | 95 | 95 |" in text  # seconds, MiB, the bundle's MB over the seconds
    assert "The agent's install: digest 0.5 s, load_and_smoke 5.0 s, switch 0.0 s." in text

    # A command that failed is shown with its error, and the target is not met by the others' figures.
    results["shipping"]["commands"][2] = {**commands[2], "error": "exit 1: error: 1 of 1 device(s) failed"}
    text = at_size_report.render(results)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "**missed**" in rows["image build, image push, pkg push: peak RSS of the process tree / bound"]
    assert "| pkg push | - | - | - | exit 1: error: 1 of 1 device(s) failed |" in text
    results["shipping"] = {"skipped": "the bundle was given with --bundle"}
    assert "Not run: the bundle was given with --bundle." in at_size_report.render(results)
