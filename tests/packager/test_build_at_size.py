"""A model at the size users deploy: Llama-3.2-1B's shape as a GGUF, built in bounded memory, served, exact.

Two of its 16 layers, so that the suite stays short: every tensor has the published shape, the embedding (the
largest) included, and the bound does not depend on the layer count. The whole model's build (time and peak RSS of
each step, against the same bound) is in bench/synthetic-1b/results.md (`scripts/bench.py --model synthetic-1b`).

The GGUF is synthetic (packager/synthetic: the published config's shapes and llama.cpp's tensor layout, the demo's
tokenizer, seeded random Q4_1/Q8_0 blocks), so its text means nothing: the quality gate is set explicitly (random
weights give near-flat logits, where int8 activations flip near-ties), and what is checked is what does not depend
on the weights' meaning: the build's peak memory against its bound, every block carried exactly, and the engine's
tokens the same in a batch as alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from packager.memory import run_sampled
from packager.synthetic import published_config, synthetic_gguf
from runtime.bundle import open_bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import GenerationRequest, SamplingParams
from tests.fixtures.gguf_bundle import BundleWeights, GgufSource
from tests.packager.conftest import write_function
from tests.packager.test_gguf_exact import _close_to_fp32_rounding as close_to_fp32_rounding

REPO = Path(__file__).resolve().parents[2]
# The bound the build must keep, whatever the layer count: 2.5 GB plus twice the largest fp32 tensor (the embedding).
BASE_BOUND = 2.5e9
LAYERS = 2  # of the published 16
GATE = "[export.quality]\nmin_top1_agreement = 0.5\nmax_mean_kl = 0.5\nmax_perplexity_increase_pct = 50.0\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """`pkg build` of the 1B shape at precision gguf, run as its own process while its tree's RSS is sampled:
    (GGUF file, bundle, peak RSS in bytes)."""
    root = tmp_path_factory.mktemp("at-size")
    gguf = synthetic_gguf("llama-3.2-1b", layers=LAYERS)  # the user's file: from the shared cache, written once
    # The build itself runs cold, in a cache of its own.
    env = {**os.environ, "ONNXFN_CACHE_DIR": str(root / "cache"), "PYTHONPATH": str(REPO)}
    spec = f'[export]\nprecision = "gguf"\nmax_context = 1024\n{GATE}[runtime]\nkv_memory_mb = 64\n'
    function = write_function(root, "synthetic-1b", f"gguf:{gguf}", spec)
    command = [sys.executable, "-m", "packager.cli", "build", str(function)]
    with (root / "build.log").open("w+") as log:  # the whole tree is sampled: the builder runs in a child
        run = run_sampled(command, cwd=root, env=env, stdout=log)
        log.seek(0)
        assert run.returncode == 0, log.read()[-3000:]
    return gguf, root / "build" / "synthetic-1b" / "bundle", run.peak_rss


def test_the_1b_shape_builds_within_the_memory_bound(built: tuple[Path, Path, int]) -> None:
    gguf, bundle_dir, peak = built
    config = published_config("llama-3.2-1b")
    embedding = open_bundle(bundle_dir).manifest.model.vocab_size * config.hidden_size * 4
    bound = BASE_BOUND + 2 * embedding
    assert peak <= bound, f"peak RSS {peak / 1e9:.2f} GB above the bound {bound / 1e9:.2f} GB"
    weights = open_bundle(bundle_dir).manifest.files["model.onnx.data"].size
    assert weights <= 1.25 * gguf.stat().st_size, (weights, gguf.stat().st_size)


def test_every_block_of_the_1b_shape_is_the_files_own(built: tuple[Path, Path, int]) -> None:
    gguf, bundle_dir, _ = built
    weights, source = BundleWeights(bundle_dir), GgufSource(gguf)
    assert weights.report["kept_float32"] == {}
    assert weights.report["gguf_types"] == {"Q4_1": 7 * LAYERS, "Q8_0": 1}  # 7 projections a layer; the embedding
    for node in (
        "/model/layers.0/attn/qkv_proj/MatMul",
        f"/model/layers.{LAYERS - 1}/mlp/down_proj/MatMul",
        "/lm_head/MatMul",
    ):
        carried = weights.report["carried"][node]
        close_to_fp32_rounding(weights.rows(node), source.rows(carried["runs"]))


def test_the_1b_shape_serves_the_same_tokens_in_a_batch_as_alone(built: tuple[Path, Path, int]) -> None:
    _, bundle_dir, _ = built
    bundle = open_bundle(bundle_dir)
    facts = bundle.manifest.model
    engine = Engine(bundle, EngineConfig(max_batch=4, kv_memory_bytes=4 * 256 * facts.kv_bytes_per_token()))
    engine.start()
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompts = [tuple(range(5 + i, 40 + 7 * i)) for i in range(4)]
        alone = [list(engine.generate(GenerationRequest(f"alone-{i}", p, params))[0].token_ids)
                 for i, p in enumerate(prompts)]  # fmt: skip
        streams = [engine.submit(GenerationRequest(f"batch-{i}", p, params)) for i, p in enumerate(prompts)]
        together = [[t for out in stream for t in out.token_ids] for stream in streams]
        assert together == alone
        assert len({tuple(t) for t in alone}) > 1  # different prompts, different tokens: the check can fail
    finally:
        engine.shutdown()
