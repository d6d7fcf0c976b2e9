"""Quality verification on a tiny random Llama: fast, and exercises the real builder graphs a segment at a time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from transformers import AutoTokenizer

from packager.export.builder import ExportOptions
from packager.verify import (
    TIE_MARGIN,
    CandidateQuality,
    ExportSystem,
    QualityBudget,
    ReferenceParity,
    Verifier,
    load_answers,
    load_prompts,
    render_chat,
    write_quality_json,
)
from packager.verify.segments import partition, run_sequences
from tests.verify.conftest import MAX_POSITIONS, TinyExports

LOOSE = QualityBudget(min_top1_agreement=0.8, max_mean_kl=0.05, max_perplexity_increase_pct=10.0)


def test_chat_rendering_matches_transformers(tiny_exports: TinyExports) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_exports.hf)
    for messages in load_prompts():
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_chat(tiny_exports.chat_template, messages) == expected


def test_prompt_set_is_a_real_chat_set_with_answers() -> None:
    prompts = load_prompts()
    assert len(prompts) == len(load_answers()) == 8
    assert any(len(messages) > 1 for messages in prompts), "one multi-turn conversation"
    assert all(messages[-1]["role"] == "user" for messages in prompts)
    assert all(len(answer.split()) >= 10 for answer in load_answers())


def test_sequences_score_each_answer_token(tiny_verifier: Verifier) -> None:
    sequences = tiny_verifier.sequences
    for index, prompt in enumerate(sequences.prompts):
        window = sequences.scored(index)
        assert window.start == sequences.answers[index] - 1 and window.stop == len(prompt) - 1
        assert sequences.targets(index) == list(prompt[sequences.answers[index] :])


def test_fp32_graph_agrees_with_pytorch(tiny_verifier: Verifier) -> None:
    parity = tiny_verifier.parity()
    assert (parity.prompts, parity.identical_greedy, parity.first_divergence) == (8, 8, [None] * 8)
    assert parity.max_probability_delta < 1e-4


def test_damaged_export_does_not_agree_with_pytorch(tiny_exports: TinyExports) -> None:
    damaged = ExportSystem(tiny_exports.damaged, "damaged")
    verifier = Verifier(tiny_exports.structure, tiny_exports.source, MAX_POSITIONS, graph=damaged)
    parity = verifier.parity()
    assert parity.identical_greedy < parity.prompts
    assert parity.max_probability_delta > 0.01


def test_segments_compute_what_the_whole_graph_does(tiny_exports: TinyExports, tiny_verifier: Verifier) -> None:
    """One layer per segment (a budget of 1 byte) or the whole graph at once: the same logits as ONNX Runtime running
    the written export in one session, and the segments hold what `partition` says."""
    system = ExportSystem(tiny_exports.fp32.directory, "fp32")
    segments = partition(system, budget=1)
    assert [s[0].name.split("/")[2] if s[0].name.startswith("/model/layers") else s[0].name for s in segments][1:3] == [
        "layers.0", "layers.1",
    ]  # fmt: skip
    sequence = tiny_verifier.sequences.prompts[0]
    feeds = tiny_verifier._feeds
    kept_small, report = run_sequences(system, [sequence], feeds, lambda i, logits: logits, budget=1)
    kept_whole, _ = run_sequences(system, [sequence], feeds, lambda i, logits: logits, budget=1 << 40)
    session = ort.InferenceSession(str(tiny_exports.fp32.directory / "model.onnx"), providers=["CPUExecutionProvider"])
    (expected,) = session.run(["logits"], feeds(sequence))
    np.testing.assert_allclose(kept_small[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(kept_whole[0], expected[0], atol=1e-5)
    assert report.segments == len(segments) >= 4


def test_reference_compared_with_itself_is_exact(tiny_exports: TinyExports, tiny_verifier: Verifier) -> None:
    quality = tiny_verifier.evaluate(tiny_verifier.export_system(tiny_exports.fp32), "fp32", QualityBudget())
    assert quality.top1_agreement == 1.0
    assert quality.mean_kl == pytest.approx(0.0, abs=1e-7)
    assert quality.perplexity == pytest.approx(tiny_verifier.reference().perplexity, rel=1e-5)
    assert quality.greedy_match_prompts == quality.greedy_prompts == 8
    assert quality.passes and quality.failures == ()


def test_int8_export_is_close_to_fp32(tiny_exports: TinyExports, tiny_verifier: Verifier) -> None:
    quality = tiny_verifier.evaluate(tiny_verifier.export_system(tiny_exports.int8), "int8", LOOSE)
    assert quality.passes, quality.failures
    assert 0.0 < quality.mean_kl < LOOSE.max_mean_kl
    assert quality.max_kl >= quality.mean_kl
    assert quality.top1_agreement >= LOOSE.min_top1_agreement
    assert abs(quality.perplexity_increase_pct) < 5.0


def test_int8_measured_in_memory_equals_the_written_export(tiny_exports: TinyExports, tiny_verifier: Verifier) -> None:
    """A candidate measured without being written (the yardstick) is exactly the one `export_decoder` writes."""
    written = tiny_verifier.evaluate(tiny_verifier.export_system(tiny_exports.int8), "int8", LOOSE)
    in_memory = tiny_verifier.evaluate(tiny_verifier.system(ExportOptions("int8")), "int8", LOOSE)
    assert in_memory == written


def test_damaged_export_fails_with_its_numbers(tiny_exports: TinyExports, tiny_verifier: Verifier) -> None:
    quality = tiny_verifier.evaluate(ExportSystem(tiny_exports.damaged, "damaged"), "damaged", LOOSE)
    assert not quality.passes
    assert quality.top1_agreement < 0.5
    assert quality.mean_kl > 0.5
    assert quality.greedy_match_prompts == 0
    top1, kl, perplexity = quality.failures
    assert f"{quality.top1_agreement:.3f}" in top1 and "0.800" in top1
    assert f"{quality.mean_kl:.4f}" in kl and "0.0500" in kl
    assert f"{quality.perplexity_increase_pct:+.1f}%" in perplexity and "+10.0%" in perplexity


def test_perplexity_budget_alone_can_fail_a_candidate(tiny_exports: TinyExports, tiny_verifier: Verifier) -> None:
    strict = QualityBudget(min_top1_agreement=0.0, max_mean_kl=10.0, max_perplexity_increase_pct=-50.0)
    quality = tiny_verifier.evaluate(tiny_verifier.export_system(tiny_exports.int8), "int8", strict)
    assert len(quality.failures) == 1
    assert quality.failures[0].startswith("held-out perplexity")


def test_progress_counts_segments(tiny_exports: TinyExports, tiny_verifier: Verifier) -> None:
    calls: list[tuple[int, int]] = []
    system = tiny_verifier.export_system(tiny_exports.int8)
    tiny_verifier.evaluate(system, "int8", QualityBudget(), lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] == tiny_verifier.reports["int8"].segments
    assert [done for done, _ in calls] == list(range(1, calls[-1][1] + 1))


def test_quality_json_records_every_figure(tmp_path: Path) -> None:
    good = CandidateQuality("int8", 0.97, 0.004, 0.06, 31.8, 0.7, 4, 8, ())
    broken = CandidateQuality("int4", 0.0, math.nan, math.inf, math.nan, math.nan, 0, 8, ("mean KL divergence nan",))
    parity = ReferenceParity(prompts=8, identical_greedy=7, first_divergence=[None] * 7 + [11])
    write_quality_json(tmp_path / "quality.json", parity, [good, broken], "int8", QualityBudget())
    report = json.loads((tmp_path / "quality.json").read_text())
    assert report["chosen"] == "int8"
    assert report["budget"] == {"min_top1_agreement": 0.95, "max_mean_kl": 0.02, "max_perplexity_increase_pct": 10.0}
    assert report["torch_parity"]["first_divergence"] == [None] * 7 + [11]
    assert str(TIE_MARGIN) in report["method"]["torch_parity"]
    first, second = report["candidates"]
    assert first["passes"] is True and first["mean_kl"] == 0.004 and first["greedy_match_prompts"] == 4
    assert second["passes"] is False and second["mean_kl"] is None and second["failures"] == ["mean KL divergence nan"]
