"""`pkg build` on the real demo model: auto picks int8 (int4 breaks the budget), with a fused graph."""

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


def test_auto_chooses_int8_with_fused_quantized_graph(demo_bundle: Path) -> None:
    bundle = open_bundle(demo_bundle)
    facts = bundle.manifest.model
    assert facts.precision == "int8"
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim) == (30, 9, 3, 64)
    assert facts.vocab_size == 49152 and facts.eos_token_ids[0] == 2
    ops = [node.op_type for node in onnx.load(str(bundle.model_path), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 30
    assert ops.count("MatMulNBits") > 0 and "MatMul" not in ops  # every projection quantized

    quality = json.loads(bundle.file("quality.json").read_text())
    assert quality["chosen"] == "int8"
    by_precision = {c["precision"]: c for c in quality["candidates"]}
    int4, int8 = by_precision["int4"], by_precision["int8"]
    assert int4["mean_kl"] > 0.02 and int4["failures"]  # re-quantized Q4_1 loses too much
    assert int8["mean_kl"] < 0.02 and int8["top1_agreement"] >= 0.95 and not int8["failures"]
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
    for text in ("int8", "chosen", "GroupQueryAttention 30", "quality against fp32"):
        assert text in result.stdout
