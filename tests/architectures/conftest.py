"""Each case's tiny model written and built once per session (`pkg build` at fp32, through the real builder)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.bundle import Bundle
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.request import GenerationRequest, SamplingParams
from tests.architectures.cases import Case

# A GGUF twin's build: random blocks are no language model, so the budget only has to admit the int8 activations'
# rounding (the fp32 reference's parity with transformers is what proves the export).
GGUF_SPEC = """[export]
precision = "gguf"
max_context = 256
[export.quality]
min_top1_agreement = 0.5
max_mean_kl = 1.0
max_perplexity_increase_pct = 100.0
"""


def make_model(case: Case, directory: Path) -> Path:
    """A Hugging Face folder of `case` with seeded random weights, wide enough that next tokens are not near-ties."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.fixtures.tiny_llama import make_tiny_llama

    make_tiny_llama(directory)  # its tokenizer and ChatML template; the Llama weights are replaced below
    for stale in (*directory.glob("*.safetensors"), directory / "config.json"):
        stale.unlink()
    config = AutoConfig.for_model(case.model_type, **case.config())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.15)
            elif "bias" in name:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return directory


def assert_gguf_parity_and_quality(bundle_dir: Path) -> None:
    """A `gguf` build's fp32 reference (the file's blocks in float32) agreed with transformers on the same weights
    (greedy on all 8 prompts, probabilities within 1e-4), and the bundle passed its quality budget against it."""
    import json

    quality = json.loads((bundle_dir / "quality.json").read_text())
    parity = quality["torch_parity"]
    assert parity["identical_greedy"] == parity["prompts"] == 8, parity
    assert parity["max_probability_delta"] < 1e-4, parity
    (gguf,) = quality["candidates"]
    assert quality["chosen"] == gguf["precision"] == "gguf" and gguf["passes"], gguf


def transformers_greedy(hf: Path, prompt: list[int], context: int, new_tokens: int) -> list[int]:
    """transformers' greedy tokens, as a bundle of `context` positions computes them (rotary.bundle_config: a longrope
    model past its original context rotates every sequence with its long factors, as transformers does a long one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packager.export.rotary import bundle_config

    config = bundle_config(AutoConfig.from_pretrained(hf), context)
    model = AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float32).eval()
    # The engine's ignore_eos keeps an end-of-sequence token it picks and goes on: no EOS here, rather than
    # min_new_tokens, which forbids it; the mask is given, since the prompt holds the pad (= EOS) token.
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


class Builds:
    """Built bundles by case name: each case is written and built the first time a test asks for it."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root = root
        self.cache = cache
        self._built: dict[str, tuple[Path, Path]] = {}

    def get(self, case: Case) -> tuple[Path, Path]:
        """(the Hugging Face folder, the bundle)."""
        if case.name not in self._built:
            from packager.build import build_function
            from packager.progress import StepProgress
            from packager.spec import load_spec
            from tests.packager.conftest import write_function

            folder = self.root / case.name
            hf = make_model(case, folder / "hf")
            spec = '[export]\nprecision = "fp32"\nmax_context = 256\n'
            function = write_function(folder, case.name, f"hf:{hf}", spec)
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("ONNXFN_CACHE_DIR", str(self.cache))
                patch.chdir(folder)
                result = build_function(load_spec(function), StepProgress())
            self._built[case.name] = (hf, folder / result.bundle)
        return self._built[case.name]


@pytest.fixture(scope="package")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds]:
    """Every test of this folder's builds; their structure exports share one pre-imported builder process
    (export/structure_process.py), stopped when the folder's last test is done."""
    from packager.export.structure_process import shared_structure_process
    from tests.conftest import tiny_model_cache

    with shared_structure_process():
        yield Builds(tmp_path_factory.mktemp("architectures"), tiny_model_cache(tmp_path_factory))


def assert_batched_with_a_shared_prefix_as_alone(bundle: Bundle, params: SamplingParams) -> None:
    """Four prompts sharing a 40-token prefix: decoded together (continuous batching, the prefix from the cache)
    each row's tokens equal the row decoded alone."""
    prefix = tuple(3 + (i * 11) % 380 for i in range(40))
    prompts = [prefix + tuple(5 + (i * j) % 300 for j in range(5 + 3 * i)) for i in range(4)]
    facts = bundle.manifest.model
    config = EngineConfig(max_batch=4, max_context=256, kv_memory_bytes=4 * 256 * facts.kv_bytes_per_token())
    engine = Engine(bundle, config)
    try:
        alone = [list(engine.generate(GenerationRequest(f"alone-{i}", p, params))[0].token_ids)
                 for i, p in enumerate(prompts)]  # fmt: skip
        streams = [engine.submit(GenerationRequest(f"batch-{i}", p, params)) for i, p in enumerate(prompts)]
        together = [[t for out in stream for t in out.token_ids] for stream in streams]
        assert together == alone
        assert engine.stats().prefix_hits > 0  # the shared prefix was served from the cache
    finally:
        engine.shutdown()
