"""The bench's bare ONNX Runtime loop (the ceiling row) computes what onnxfn's engine computes on the same graph,
and real workers running it measure figures the report can pair round by round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from packager.bench.systems.base import PromptSpec, SystemConfig
from packager.bench.systems.ortloop import OrtLoopSystem
from runtime.bundle import open_bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import GenerationRequest, SamplingParams

NEW_TOKENS = 12
TEXTS = ("The license grants you the right to", "Copying and distribution of this file, with or")


@pytest.fixture(scope="module")
def prompts(demo_bundle: Path) -> list[PromptSpec]:
    tokenizer = Tokenizer.from_file(str(open_bundle(demo_bundle, verify=False).tokenizer_path))
    ids = [tokenizer.encode(text).ids for text in TEXTS]
    width = min(len(i) for i in ids)  # a static batch: one length
    return [PromptSpec(ids=i[:width], text=text) for i, text in zip(ids, TEXTS, strict=True)]


def engine_tokens(bundle_path: Path, prompt: PromptSpec) -> list[int]:
    """Greedy tokens of onnxfn's engine with prompts through model.onnx too (no prefill graph), as the loop."""
    bundle = open_bundle(bundle_path, verify=False)
    engine = Engine(bundle, EngineConfig(max_batch=1, max_context=128, prefill_graph=False))
    engine.start()
    try:
        sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        (output,) = engine.generate(GenerationRequest("ceiling", tuple(prompt.ids), sampling))
    finally:
        engine.shutdown()
    return list(output.token_ids)


def test_the_bare_loop_decodes_the_engines_greedy_tokens_alone_and_in_a_static_batch(
    demo_bundle: Path, prompts: list[PromptSpec]
) -> None:
    config = SystemConfig("ort-loop", str(demo_bundle), "", "", threads=2, max_batch=4, python=sys.executable)
    loop = OrtLoopSystem(config)
    try:
        alone = [loop.run([prompt], NEW_TOKENS)[0] for prompt in prompts]
        together = loop.run(prompts, NEW_TOKENS)
    finally:
        loop.close()
    for solo, batched in zip(alone, together, strict=True):
        assert solo.tokens == batched.tokens == NEW_TOKENS
        assert 0 < solo.first <= solo.last
        assert batched.token_ids == solo.token_ids
    assert alone[0].token_ids == engine_tokens(demo_bundle, prompts[0])
    assert alone[0].token_ids != alone[1].token_ids  # two prompts, two continuations: the rows are not mixed up


def test_the_prefill_section_pairs_rounds_on_real_workers(demo_bundle: Path, tmp_path: Path) -> None:
    """The prefill figures, measured by worker processes, render with a round-by-round ratio for each system."""
    from packager.bench import report, sections
    from packager.bench.pool import Worker
    from packager.bench.prompts import PromptFactory

    plan = sections.Plan(
        2, 8, 4, prefill_lengths=(16,), concurrency_levels=(1,), concurrency_prompt=8, concurrency_tokens=4
    )
    configs = [SystemConfig(n, str(demo_bundle), "", "", 2, 1, sys.executable) for n in ("onnxfn", "ort-loop")]
    workers = [Worker(config, tmp_path) for config in configs]
    try:
        figures = sections.measure_prefill(workers, PromptFactory(demo_bundle / "tokenizer.json"), plan)
    finally:
        for worker in workers:
            worker.close()
    text = report.render_prefill({"prefill": figures})
    row = next(line for line in text.splitlines() if line.startswith("| 16 | ort-loop "))
    cells = [cell.strip() for cell in row.split("|")]
    assert float(cells[3]) > 0 and float(cells[5]) > 0  # prefill tok/s and onnxfn x
    assert "error" not in text
