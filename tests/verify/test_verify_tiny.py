"""Quality verification on a tiny random Llama: fast, and exercises the real builder graphs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from packager.errors import UserError
from packager.verify import (
    CONTINUATION_TOKENS,
    CandidateQuality,
    QualityBudget,
    QualityEvaluator,
    ReferenceParity,
    load_prompts,
    render_chat,
    torch_parity,
    write_quality_json,
)
from tests.verify.conftest import TinyExports

LOOSE = QualityBudget(min_top1_agreement=0.8, max_mean_kl=0.05, max_perplexity_increase_pct=10.0)


def test_chat_rendering_matches_transformers(tiny_exports: TinyExports) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_exports.hf)
    for messages in load_prompts():
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_chat(tiny_exports.chat_template, messages) == expected


def test_prompt_set_is_a_real_chat_set() -> None:
    prompts = load_prompts()
    assert len(prompts) == 8
    assert any(len(messages) > 1 for messages in prompts), "one multi-turn conversation"
    assert all(messages[-1]["role"] == "user" for messages in prompts)


def test_fp32_export_decodes_like_pytorch(tiny_exports: TinyExports) -> None:
    parity = torch_parity(tiny_exports.hf, tiny_exports.fp32, tiny_exports.tokenizer, tiny_exports.chat_template)
    assert parity.prompts == 8
    assert parity.identical_greedy == 8
    assert parity.first_divergence == [None] * 8


def test_damaged_export_does_not_decode_like_pytorch(tiny_exports: TinyExports) -> None:
    parity = torch_parity(tiny_exports.hf, tiny_exports.damaged, tiny_exports.tokenizer, tiny_exports.chat_template)
    assert parity.identical_greedy < parity.prompts
    assert any(index is not None and 0 <= index < 16 for index in parity.first_divergence)


def test_reference_compared_with_itself_is_exact(tiny_exports: TinyExports, tiny_evaluator: QualityEvaluator) -> None:
    quality = tiny_evaluator.evaluate(tiny_exports.fp32, "fp32", QualityBudget())
    assert quality.top1_agreement == 1.0
    assert quality.mean_kl == pytest.approx(0.0, abs=1e-9)
    assert quality.perplexity == pytest.approx(tiny_evaluator.reference_perplexity)
    assert quality.greedy_match_prompts == quality.greedy_prompts == 8
    assert quality.passes and quality.failures == ()


def test_int8_export_is_close_to_fp32(tiny_exports: TinyExports, tiny_evaluator: QualityEvaluator) -> None:
    quality = tiny_evaluator.evaluate(tiny_exports.int8, "int8", LOOSE)
    assert quality.passes, quality.failures
    assert 0.0 < quality.mean_kl < LOOSE.max_mean_kl
    assert quality.max_kl >= quality.mean_kl
    assert quality.top1_agreement >= LOOSE.min_top1_agreement
    assert abs(quality.perplexity_increase_pct) < 5.0


def test_damaged_export_fails_with_its_numbers(tiny_exports: TinyExports, tiny_evaluator: QualityEvaluator) -> None:
    quality = tiny_evaluator.evaluate(tiny_exports.damaged, "damaged", LOOSE)
    assert not quality.passes
    assert quality.top1_agreement < 0.5
    assert quality.mean_kl > 0.5
    assert quality.greedy_match_prompts == 0
    top1, kl, perplexity = quality.failures
    assert f"{quality.top1_agreement:.3f}" in top1 and "0.800" in top1
    assert f"{quality.mean_kl:.4f}" in kl and "0.0500" in kl
    assert f"{quality.perplexity_increase_pct:+.1f}%" in perplexity and "+10.0%" in perplexity


def test_perplexity_budget_alone_can_fail_a_candidate(
    tiny_exports: TinyExports, tiny_evaluator: QualityEvaluator
) -> None:
    strict = QualityBudget(min_top1_agreement=0.0, max_mean_kl=10.0, max_perplexity_increase_pct=-50.0)
    quality = tiny_evaluator.evaluate(tiny_exports.int8, "int8", strict)
    assert len(quality.failures) == 1
    assert quality.failures[0].startswith("held-out perplexity")


def test_progress_counts_up_to_its_total(tiny_exports: TinyExports) -> None:
    prompts = len(load_prompts())
    calls: list[tuple[int, int]] = []
    evaluator = QualityEvaluator(
        tiny_exports.fp32,
        tiny_exports.tokenizer,
        tiny_exports.chat_template,
        progress=lambda d, t: calls.append((d, t)),
    )
    reference_total = 2 + 2 * prompts  # session, greedy and teacher-forced pass per prompt, held-out text
    assert calls[0] == (0, reference_total) and calls[-1] == (reference_total, reference_total)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    calls.clear()
    evaluator.evaluate(tiny_exports.int8, "int8", QualityBudget())
    assert calls == [(done, 2 + prompts) for done in range(3 + prompts)]


def test_export_without_genai_config_is_refused(tiny_exports: TinyExports, tmp_path: Path) -> None:
    shutil.copy(tiny_exports.int8 / "model.onnx", tmp_path / "model.onnx")
    evaluator = QualityEvaluator(tiny_exports.fp32, tiny_exports.tokenizer, tiny_exports.chat_template)
    with pytest.raises(UserError, match="genai_config.json"):
        evaluator.evaluate(tmp_path, "int8", QualityBudget())


def test_quality_json_records_every_figure(tmp_path: Path) -> None:
    good = CandidateQuality("int8", 0.97, 0.004, 0.06, 31.8, 0.7, 4, 8, ())
    broken = CandidateQuality("int4", 0.0, math.nan, math.inf, math.nan, math.nan, 0, 8, ("mean KL divergence nan",))
    parity = ReferenceParity(prompts=8, identical_greedy=7, first_divergence=[None] * 7 + [11])
    write_quality_json(tmp_path / "quality.json", parity, [good, broken], "int8", QualityBudget())
    report = json.loads((tmp_path / "quality.json").read_text())
    assert report["chosen"] == "int8"
    assert report["budget"] == {"min_top1_agreement": 0.95, "max_mean_kl": 0.02, "max_perplexity_increase_pct": 10.0}
    assert report["torch_parity"] == {"prompts": 8, "identical_greedy": 7, "first_divergence": [None] * 7 + [11]}
    assert report["method"]["continuation_tokens"] == CONTINUATION_TOKENS
    first, second = report["candidates"]
    assert first["passes"] is True and first["mean_kl"] == 0.004 and first["greedy_match_prompts"] == 4
    assert second["passes"] is False and second["mean_kl"] is None and second["failures"] == ["mean KL divergence nan"]
