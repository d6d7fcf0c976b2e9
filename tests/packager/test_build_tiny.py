"""`pkg build` end to end on a tiny random-weight Llama: bundle contents, caching, tamper and interruption.

These run the real exporter (onnxruntime-genai's builder) and the real quality gate, on a model small
enough to export in seconds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from packager import bundle as bundle_module
from packager.build import build_function
from packager.errors import UserError
from packager.progress import StepProgress
from packager.spec import load_spec
from runtime.bundle import BundleError, open_bundle
from tests.packager.conftest import write_function

# A random tiny model is not a language model: keep the gate meaningful but attainable for int8.
INT8_SPEC = '[export]\nprecision = "int8"\nmax_context = 256\n'


@pytest.fixture
def tiny_function(tmp_path: Path, tiny_hf_dir: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # bundles land in ./build/NAME/bundle
    return write_function(tmp_path, "tiny", f"hf:{tiny_hf_dir}", INT8_SPEC)


def test_build_writes_a_verified_bundle_with_fused_graph(tiny_function: Path, tmp_path: Path) -> None:
    progress = StepProgress()
    result = build_function(load_spec(tiny_function), progress)

    assert result.bundle == Path("build/tiny/bundle")
    bundle = open_bundle(tmp_path / result.bundle)
    facts = bundle.manifest.model
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim) == (2, 4, 2, 16)
    assert (facts.vocab_size, facts.context_length, facts.eos_token_ids) == (384, 256, (2,))
    assert facts.precision == "int8" and facts.architecture == "llama"
    assert facts.io.past_key == "past_key_values.%d.key" and facts.io.present_value == "present.%d.value"
    assert "<|im_start|>" in (facts.chat_template or "")
    assert set(bundle.manifest.files) >= {"model.onnx", "model.onnx.data", "tokenizer.json", "quality.json"}
    assert bundle.manifest.spec_digest == load_spec(tiny_function).digest

    ops = {node.op_type for node in onnx.load(str(bundle.model_path), load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization"} <= ops

    quality = json.loads(bundle.file("quality.json").read_text())
    assert quality["chosen"] == "int8"
    assert result.parity.identical_greedy == result.parity.prompts > 0
    expected = ["structure", "reference", "parity", "export int8", "verify int8", "bundle"]
    if next(r for r in progress.records if r.name == "parity").cached:  # the session built this model before
        expected.remove("reference")  # the reference runs only to measure parity
    assert [r.name for r in progress.records] == expected


def test_unchanged_rebuild_reuses_every_step(tiny_function: Path) -> None:
    spec = load_spec(tiny_function)
    build_function(spec, StepProgress())
    first_manifest = Path("build/tiny/bundle/manifest.json").read_bytes()

    progress = StepProgress()
    start = time.perf_counter()
    result = build_function(spec, progress)
    assert time.perf_counter() - start < 30
    assert all(record.cached for record in progress.records), [(r.name, r.cached) for r in progress.records]
    assert result.bundle_reused
    assert Path("build/tiny/bundle/manifest.json").read_bytes() == first_manifest


def test_tampered_bundle_is_refused_naming_the_file(tiny_function: Path) -> None:
    build_function(load_spec(tiny_function), StepProgress())
    root = Path("build/tiny/bundle")
    data = root / "model.onnx.data"
    payload = bytearray(data.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    data.write_bytes(bytes(payload))
    with pytest.raises(BundleError, match=r"model\.onnx\.data has sha256 .* tampered"):
        open_bundle(root)

    # A rebuild notices and writes a good bundle again.
    build_function(load_spec(tiny_function), StepProgress())
    open_bundle(root)

    (root / "extra.py").write_text("print('injected')\n")
    with pytest.raises(BundleError, match="files its manifest does not list: extra.py"):
        open_bundle(root)
    (root / "extra.py").unlink()
    (root / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="missing tokenizer.json"):
        open_bundle(root)


def test_failure_while_writing_keeps_the_previous_bundle(tiny_function: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_function(load_spec(tiny_function), StepProgress())
    before = open_bundle("build/tiny/bundle").manifest.digest

    # Change the spec so the bundle must be rewritten, then fail halfway through copying files.
    spec_file = tiny_function / "function.toml"
    spec_file.write_text(spec_file.read_text() + '[runtime]\nsystem_prompt = "changed"\n')
    copies = 0
    real_copy = bundle_module.shutil.copyfile

    def failing_copy(src: object, dst: object) -> object:
        nonlocal copies
        copies += 1
        if copies == 3:
            raise OSError(28, "No space left on device")
        return real_copy(src, dst)

    monkeypatch.setattr(bundle_module.shutil, "copyfile", failing_copy)
    with pytest.raises(OSError, match="No space left"):
        build_function(load_spec(tiny_function), StepProgress())
    assert open_bundle("build/tiny/bundle").manifest.digest == before
    assert not list(Path("build/tiny").glob(".bundle-tmp-*"))


def test_build_killed_at_random_points_never_leaves_a_bundle_that_looks_valid(
    tiny_function: Path, tmp_path: Path
) -> None:
    """SIGKILL a real `pkg build` process at random moments: afterwards the bundle verifies or is absent."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    source = load_spec(tiny_function).model.source
    spec_file = tiny_function / "function.toml"
    command = [sys.executable, "-m", "packager.cli", "build", str(tiny_function)]
    rng = random.Random(7)
    for attempt in range(6):
        # A new system prompt each time changes the spec digest, so every run must rewrite the bundle.
        spec_file.write_text(
            f'name = "tiny"\n[model]\nsource = "{source}"\n{INT8_SPEC}[runtime]\nsystem_prompt = "try {attempt}"\n'
        )
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 4.0))
        process.send_signal(signal.SIGKILL)
        process.wait()
        root = tmp_path / "build/tiny/bundle"
        if root.exists():
            open_bundle(root)  # raises BundleError if what is there is half-written
    subprocess.run(command, cwd=tmp_path, env=env, check=True, capture_output=True)
    assert open_bundle(tmp_path / "build/tiny/bundle").manifest.spec_digest == load_spec(tiny_function).digest


def test_unsupported_architecture_names_the_supported_ones(
    tmp_path: Path, tiny_hf_dir: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_hf_dir, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    function = write_function(tmp_path, "gpt2", f"hf:{gpt2}")
    with pytest.raises(UserError, match=r"'GPT2LMHeadModel', which onnxfn cannot export yet; supported: ") as raised:
        build_function(load_spec(function), StepProgress())
    named = str(raised.value).split("supported: ")[1].split(", ")
    assert named == sorted(named)  # every supported architecture, in order
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "PhiForCausalLM", "GptOssForCausalLM"} <= set(
        named
    )
    assert "GPT2LMHeadModel" not in named and "ChatGLMModel" not in named  # refused ones are not offered
