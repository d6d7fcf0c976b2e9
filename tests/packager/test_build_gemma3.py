"""Gemma 3 end to end on a tiny random-weight model: transformers-5 folder → builder → bundle → engine.

What Gemma 3 adds over Llama is exercised on purpose: rope parameters nested by layer type (the builder
cannot read them without our adaptation), sliding-window layers beside a full one with a window shorter
than the prompts, and a base-model tokenizer that adds `<bos>` itself. Gemma 2 (the same windows, with
logit soft-capping) and the original Gemma (no window) go through the same checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from packager.build import BuildResult, build_function
from packager.errors import UserError
from packager.progress import StepProgress
from packager.spec import load_spec
from runtime.bundle import open_bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.engine.tokenizer import Tokenizer
from tests.fixtures.tiny_gemma3 import LAYER_TYPES, SLIDING_WINDOW, make_tiny_gemma3
from tests.packager.conftest import write_function

SPEC = 'task = "completion"\n[export]\nprecision = "fp32"\nmax_context = 256\n'
NEW_TOKENS = 24
PROMPTS = (
    "The river runs past the old mill, where the baker opens the shop at dawn. Write a short poem about the sea.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. The quick brown fox jumps over the lazy dog.",
)
EXPORTED_AS = {1: "gemma", 2: "gemma2", 3: "gemma3_text"}  # SUPPORTED_DECODERS values


def _build(root: Path, hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> BuildResult:
    monkeypatch.chdir(root)  # the bundle lands in ./build/NAME/bundle
    function = write_function(root, "gemma", f"hf:{hf_dir}", SPEC)
    result = build_function(load_spec(function), StepProgress())
    assert isinstance(result, BuildResult)
    return result


def _torch_greedy(hf_dir: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,  # raw: `scores` would have min_new_tokens' masked EOS in their softmax
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(row[0], -1)[t].item() for row, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


@pytest.mark.parametrize("generation", [3, 2, 1], ids=lambda g: f"gemma{g}")
def test_gemma_exports_with_torch_parity_and_serves_windowed_attention(
    generation: int, tmp_path: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_dir = make_tiny_gemma3(tmp_path / "hf", generation=generation)
    result = _build(tmp_path, hf_dir, monkeypatch)
    # The build fails unless the fp32 graph's greedy tokens equal PyTorch's; the quality prompts are
    # longer than the window, so that already covers windowed attention in one forward and in decoding.
    assert result.parity.identical_greedy == result.parity.prompts > 0

    bundle = open_bundle(tmp_path / result.bundle)
    facts = bundle.manifest.model
    assert (facts.architecture, facts.num_layers, facts.num_kv_heads, facts.head_dim) == (
        EXPORTED_AS[generation],
        3,
        1,
        32,
    )
    assert facts.bos_token_id == 2 and facts.chat_template is None
    # Every layer has a full-length cache (what the KV pool binds); the sliding ones window in the kernel.
    assert "sliding_window" not in json.loads(bundle.file("genai_config.json").read_text())["model"]["decoder"]
    graph = onnx.load(str(bundle.model_path), load_external_data=False).graph
    windows = [
        next(a.i for a in node.attribute if a.name == "local_window_size")
        for node in graph.node
        if node.op_type == "GroupQueryAttention"
    ]
    windowed = generation > 1
    assert windows == [SLIDING_WINDOW if windowed and t == "sliding_attention" else -1 for t in LAYER_TYPES]

    tokenizer = Tokenizer(bundle.tokenizer_path, facts.chat_template, facts.bos_token_id, facts.eos_token_ids)
    prompts = [tuple(tokenizer.encode_prompt(text)) for text in PROMPTS]
    assert all(p[0] == 2 and len(p) > 2 * SLIDING_WINDOW for p in prompts)
    # Chunks of 8 cross the window's edge mid-prompt; both prompts run in one batch.
    engine = Engine(bundle, EngineConfig(max_batch=2, prefill_chunk=8, max_context=256, prefix_cache_bytes=0))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True)
    try:
        engine.start()
        streams = [engine.submit(GenerationRequest(f"gemma-{i}", p, params)) for i, p in enumerate(prompts)]
        served = [[(lp.token_id, lp.logprob) for out in stream for lp in out.logprobs] for stream in streams]
    finally:
        engine.shutdown()
    for prompt, got in zip(prompts, served, strict=True):
        tokens, logprobs = _torch_greedy(hf_dir, list(prompt))
        assert [t for t, _ in got] == tokens
        assert [lp for _, lp in got] == pytest.approx(logprobs, abs=1e-3)


def test_gemma3_with_dynamic_rope_past_its_context_is_refused_before_export(
    tmp_path: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linear rope on the global layers builds now (tests/architectures/test_rope.py); dynamic NTK past
    max_position_embeddings (here 128, the bundle 256) rescales every position by the sequence length, which no
    fixed rotary table computes: refused, before anything is exported."""
    hf_dir = make_tiny_gemma3(tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"]["full_attention"].update(rope_type="dynamic", factor=2.0)
    config["max_position_embeddings"] = 128
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"dynamic NTK.*max_position_embeddings = 128.*export.max_context to at most"):
        _build(tmp_path, hf_dir, monkeypatch)
    assert not (tmp_path / "build").exists()  # no bundle folder begun
