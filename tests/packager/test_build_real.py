"""`pkg build` on the real demo model: auto keeps the GGUF's own blocks (`gguf`), with a fused graph."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from runtime.bundle import open_bundle
from tests.conftest import DEMO_FUNCTION, REPO

pytestmark = pytest.mark.real_model


def test_auto_keeps_the_ggufs_blocks_with_a_fused_quantized_graph(demo_bundle: Path) -> None:
    bundle = open_bundle(demo_bundle)
    facts = bundle.manifest.model
    assert facts.precision == "gguf"
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim) == (30, 9, 3, 64)
    assert facts.vocab_size == 49152 and facts.eos_token_ids[0] == 2
    ops = [node.op_type for node in onnx.load(str(bundle.model_path), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 30
    assert ops.count("MatMulNBits") == 30 * 4 + 1  # q/k/v (fused), o, gate+up (one), down; lm_head: all quantized
    assert json.loads(bundle.file("gguf-weights.json").read_text())["kept_float32"] == {}

    quality = json.loads(bundle.file("quality.json").read_text())
    assert quality["chosen"] == "gguf"
    (gguf,) = quality["candidates"]  # the first candidate passed: nothing re-quantized was tried
    (int8,) = quality["compared"]  # measured beside it, as the yardstick
    assert gguf["precision"] == "gguf" and not gguf["failures"] and gguf["top1_agreement"] >= 0.95
    assert int8["precision"] == "int8" and gguf["mean_kl"] <= int8["mean_kl"] < 0.02
    assert quality["torch_parity"]["identical_greedy"] == quality["torch_parity"]["prompts"]


def test_cli_rebuild_is_incremental_and_prints_the_summary(demo_bundle: Path) -> None:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "packager.cli", "build", str(DEMO_FUNCTION)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 60  # seconds, not the minutes of a cold build
    assert "(cached)" in result.stderr
    assert "bundle reused unchanged" in result.stdout
    for text in ("gguf", "chosen", "compared", "GroupQueryAttention 30", "quality against fp32"):
        assert text in result.stdout
