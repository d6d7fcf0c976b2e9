"""Phi-3 end to end on a tiny random-weight model: its fused q/k/v and gate/up projections through the builder,
parity with PyTorch, and the engine's greedy tokens equal transformers' (no Phi-3 weights are obtainable here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packager.build import BuildResult, build_function
from packager.progress import StepProgress
from packager.spec import load_spec
from runtime.bundle import open_bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.engine.tokenizer import Tokenizer
from tests.fixtures.tiny_llama import make_tiny_llama
from tests.packager.conftest import write_function

NEW_TOKENS = 16


def _tiny_phi3(directory: Path) -> Path:
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    make_tiny_llama(directory)  # its tokenizer and ChatML template; the Llama weights are replaced below
    for stale in (*directory.glob("*.safetensors"), directory / "config.json"):
        stale.unlink()
    config = Phi3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=384, max_position_embeddings=256, original_max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, tie_word_embeddings=False, initializer_range=0.15,
    )  # fmt: skip
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(directory)
    return directory


def test_phi3_exports_with_torch_parity_and_serves_transformers_tokens(
    tmp_path: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir = _tiny_phi3(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    function = write_function(tmp_path, "phi3", f"hf:{hf_dir}", '[export]\nprecision = "fp32"\nmax_context = 256\n')
    result = build_function(load_spec(function), StepProgress())
    assert isinstance(result, BuildResult)
    assert result.parity.identical_greedy == result.parity.prompts > 0
    bundle = open_bundle(tmp_path / result.bundle)
    facts = bundle.manifest.model
    assert (facts.architecture, facts.num_layers, facts.num_kv_heads) == ("phi3", 2, 2)

    tokenizer = Tokenizer(bundle.tokenizer_path, facts.chat_template, facts.bos_token_id, facts.eos_token_ids)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])
    )
    engine = Engine(bundle, EngineConfig(max_batch=1, max_context=256, prefill_chunk=8))
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        (served,) = engine.generate(GenerationRequest("phi3", prompt, params))
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert list(served.token_ids) == out[0, len(prompt) :].tolist()
