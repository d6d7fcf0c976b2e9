"""LoRA adapters end to end on a tiny random-weight Llama: `pkg build` with [[adapters]], then the engine.

PEFT writes the adapters (random A and B: `init_lora_weights=False`), the real exporter and quality gate build the
bundle, and the engine serves base and adapter rows in one batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from packager.build import build_function
from packager.errors import UserError
from packager.progress import StepProgress
from packager.spec import load_spec
from runtime.adapters.layout import INDEX_INPUT
from runtime.bundle import open_bundle
from runtime.engine.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.request import GenerationRequest, SamplingParams, UnknownAdapterError
from tests.packager.conftest import isolated_cache, write_function  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("isolated_cache")  # builds use the session's own cache

# A random tiny model's distributions are flat, so int8 flips near-ties more often than on a language model.
SPEC = """[export]
precision = "int8"
max_context = 256
[export.quality]
min_top1_agreement = 0.8
[runtime]
max_adapters = 2
"""


def _peft_adapter(hf_dir: Path, out: Path, modules: list[str], rank: int, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "qv": _peft_adapter(tiny_hf_dir, root / "qv", ["q_proj", "v_proj"], 4, seed=1),
        "attn": _peft_adapter(tiny_hf_dir, root / "attn", ["q_proj", "k_proj", "o_proj", "down_proj"], 2, seed=2),
    }


@pytest.fixture
def built(tmp_path: Path, tiny_hf_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    declared = "".join(f'[[adapters]]\nname = "{n}"\nsource = "{p}"\n' for n, p in adapters.items())
    folder = write_function(tmp_path, "tiny-lora", f"hf:{tiny_hf_dir}", SPEC + declared)
    result = build_function(load_spec(folder), StepProgress())
    return tmp_path / result.bundle


def test_build_adapts_every_graph_and_records_each_adapters_parity(built: Path) -> None:
    bundle = open_bundle(built)
    described = bundle.manifest.adapters
    assert described is not None
    assert described["bundled"] == {"qv": "adapters/qv.safetensors", "attn": "adapters/attn.safetensors"}
    layout = described["layout"]
    assert layout["rank"] == 4
    names = {p["name"]: [m[0] for m in p["modules"]] for p in layout["projections"]}
    assert names == {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"], "down_proj": ["down_proj"]}
    for graph in ("model.onnx", "prefill.onnx", "prefill-quantized.onnx"):
        if graph in bundle.manifest.files:
            inputs = {i.name for i in onnx.load(str(built / graph), load_external_data=False).graph.input}
            assert INDEX_INPUT in inputs and "adapters.0.qkv_proj.A" in inputs, graph
    quality = json.loads((built / "quality.json").read_text())["adapters"]
    for name in ("qv", "attn"):
        figures = quality[name]
        assert figures["parity"]["identical_greedy"] == figures["parity"]["prompts"] > 0
        assert figures["quality"]["precision"] == "int8" and figures["quality"]["failures"] == []
        assert figures["bytes"] > 0


def test_mixed_batch_rows_equal_each_alone(built: Path) -> None:
    engine = Engine(open_bundle(built), EngineConfig(max_batch=6, max_adapters=2))
    engine.start()
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = {None: (5, 17, 42, 7, 99), "qv": (5, 17, 42, 7, 99), "attn": (8, 3, 120, 64)}

        def request(i: int, adapter: str | None) -> GenerationRequest:
            return GenerationRequest(f"r{i}", prompts[adapter], greedy, adapter=adapter)

        alone = {a: engine.generate(request(i, a))[0].token_ids for i, a in enumerate(prompts)}
        assert alone[None] != alone["qv"], "a random adapter must change the output"
        streams = [engine.submit(request(10 + i, a)) for i, a in enumerate([None, "qv", "attn", "qv", None, "attn"])]
        together = [tuple(t for out in stream for t in out.token_ids) for stream in streams]
        for tokens, adapter in zip(together, [None, "qv", "attn", "qv", None, "attn"], strict=True):
            assert tokens == alone[adapter], adapter
        with pytest.raises(UnknownAdapterError) as error:
            engine.submit(GenerationRequest("bad", (1, 2), greedy, adapter="nope"))
        assert error.value.available == ("attn", "qv")
    finally:
        engine.shutdown()


def test_an_adapter_for_another_model_is_refused_at_build(
    tmp_path: Path, tiny_hf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import save_file

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "wrong"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{key}.lora_A.weight": np.ones((2, 7), np.float32), f"{key}.lora_B.weight": np.ones((9, 2), np.float32)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    declared = f'[[adapters]]\nname = "w"\nsource = "{folder}"\n'
    spec = write_function(tmp_path, "tiny-wrong", f"hf:{tiny_hf_dir}", SPEC + declared)
    with pytest.raises(UserError, match=r"adapter 'w' .* does not fit the base model: layers.0.q_proj.a is \[7, 2\]"):
        build_function(load_spec(spec), StepProgress())


ADAPTERS = ("qv", "attn")


def test_one_slot_serves_two_adapters_in_turn(built: Path) -> None:
    """With `max_adapters = 1`, a request for a second adapter waits for the first's to finish, then evicts it."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = (5, 17, 42, 7, 99)
    roomy = Engine(open_bundle(built), EngineConfig(max_batch=4, max_adapters=2))
    try:
        alone = {a: roomy.generate(GenerationRequest(a, prompt, greedy, adapter=a))[0].token_ids for a in ADAPTERS}
    finally:
        roomy.shutdown()
    engine = Engine(open_bundle(built), EngineConfig(max_batch=4, max_adapters=1))
    engine.start()
    try:
        streams = [engine.submit(GenerationRequest(f"r{i}", prompt, greedy, adapter=a)) for i, a in enumerate(alone)]
        assert [tuple(t for out in s for t in out.token_ids) for s in streams] == list(alone.values())
        assert engine.adapters is not None
        assert [load.digest for load in engine.adapters.slots.loads] == [
            engine.adapters.catalog.get(a).digest
            for a in alone  # type: ignore[union-attr]
        ]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("bad", "alpha", "expected"),
    [(np.nan, 4, "1 NaN and 0 infinite values"), (np.inf, 4, "0 NaN and 1 infinite values"),
     (3.0, 4e38, "beyond float32's range")],
    ids=["nan", "inf", "scale-overflow"],
)  # fmt: skip
def test_pkg_build_refuses_an_adapter_that_could_poison_a_batch(
    tmp_path: Path, tiny_hf_dir: Path, bad: float, alpha: float, expected: str
) -> None:
    """Issue 47, row 2, at build: the `pkg build` process refuses it with the tensor named, before any export."""
    import os
    import subprocess
    import sys

    from safetensors.numpy import save_file

    folder = tmp_path / "poisoned"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": alpha}))
    key = "base_model.model.model.layers.1.self_attn.v_proj"
    b = np.ones((32, 2), np.float32)
    b[3, 1] = bad
    save_file({f"{key}.lora_A.weight": np.ones((2, 64), np.float32), f"{key}.lora_B.weight": b},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    spec = write_function(
        tmp_path, "tiny-poison", f"hf:{tiny_hf_dir}", SPEC + f'[[adapters]]\nname = "p"\nsource = "{folder}"\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "packager.cli", "build", str(spec)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "cannot be served" in result.stderr and "layers.1.v_proj.b" in result.stderr, result.stderr
    assert expected in result.stderr, result.stderr
    assert not (tmp_path / "build" / "tiny-poison" / "bundle").exists()
