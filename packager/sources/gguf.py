"""A GGUF file's model as a Hugging Face folder without weights: config.json and the tokenizer, cached by the
file's sha256. The weights stay in the file and are read from it one tensor at a time (sources/weights.py).

`dequantized_folder` still writes the whole model as fp32 safetensors, for the tools that want a complete
folder (the bench's transformers baseline, the tests' PEFT training); `pkg build` never calls it. Found on
transformers 5: `save_pretrained` refuses a GGUF-loaded model ("quantized with gguf and is not serializable")
until the quantizer is detached; the weights are plain fp32 tensors by then.

The tokenizer and chat template come from a `tokenizer.json` (with its `tokenizer_config.json`) lying beside
the GGUF file when there is one, else from the GGUF's own metadata through transformers' converter; the
converted `tokenizer.json` is then checked to encode a text set token for token as transformers does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib.resources import files
from pathlib import Path

from packager.cache import cached_dir
from packager.errors import UserError
from packager.export.architectures import SUPPORTED_DECODERS
from packager.progress import StepProgress
from packager.sources.gguf_dense import DENSE_GGUF, dense_config
from packager.sources.gguf_dense import MODEL_TYPES as DENSE_MODEL_TYPES
from packager.sources.gguf_gpt_oss import ARCHITECTURE as GPT_OSS
from packager.sources.gguf_gpt_oss import gpt_oss_config
from packager.sources.gguf_metadata import read_metadata
from packager.sources.gguf_rope import add_gguf_rope

DEQUANTIZE_VERSION = 3  # bump when the conversion below changes, to invalidate cached folders
CONFIG_VERSION = 2  # bump when the config folder below changes
BESIDE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# GGUF `general.architecture` names whose transformers `model_type` differs.
_MODEL_TYPES = {
    "gemma3": "gemma3_text",
    "gpt-oss": "gpt_oss",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    **DENSE_MODEL_TYPES,
}
_CHECK_TEXTS = (
    "Hello, world! How are you today?",
    "  leading spaces, trailing spaces  \n\nand blank lines\n",
    "Numbers 0 1 12 123 1234 3.14159 and code: def f(x): return x ** 2",
    "Unicode: café naïve Æsir — “quotes” 東京 😀 🇫🇷 Ελληνικά",
)


def gguf_architecture(gguf_path: Path) -> str:
    """The model type of a GGUF file, from its metadata: refused here, before a minute of loading, if onnxfn cannot
    export it."""
    try:
        architecture = read_metadata(gguf_path).architecture
    except (KeyError, ValueError, IndexError) as exc:
        raise UserError(
            f"{gguf_path.name} is not a readable GGUF file ({exc}); download it again", exit_code=2
        ) from exc
    model_type = _MODEL_TYPES.get(architecture, architecture)
    supported = sorted({_gguf_name(m) for m in SUPPORTED_DECODERS.values()})
    if model_type not in SUPPORTED_DECODERS.values():
        raise UserError(
            f"{gguf_path.name} holds a {architecture!r} model (its general.architecture), which onnxfn cannot export; "
            f"it exports decoders of these GGUF architectures: {', '.join(supported)}",
            exit_code=2,
        )
    return model_type


def _general_architecture(gguf_path: Path) -> str:
    return read_metadata(gguf_path).architecture


def _gguf_name(model_type: str) -> str:
    return next((gguf for gguf, mapped in _MODEL_TYPES.items() if mapped == model_type), model_type)


def _beside(tokenizer_from: Path) -> tuple[list[Path], str]:
    beside = [tokenizer_from / n for n in BESIDE_TOKENIZER_FILES if (tokenizer_from / n).is_file()]
    if not any(p.name == "tokenizer.json" for p in beside):
        beside = []
    return beside, hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in beside)).hexdigest()[:16]


def gguf_config_folder(
    gguf_path: Path, sha256: str, source: str, progress: StepProgress, *, tokenizer_from: Path
) -> tuple[Path, str, bool]:
    """Return `(folder, the model's content key, reused)`: config.json and the tokenizer of the GGUF file with that
    sha256; a tokenizer in `tokenizer_from` wins over the GGUF's own."""
    gguf_architecture(gguf_path)
    beside, tokenizer_key = _beside(tokenizer_from)
    with progress.step("config", f"read {gguf_path.name}'s config and tokenizer") as step:

        def produce(out: Path) -> None:
            _write_config(gguf_path, out, beside, source)

        key = f"{sha256}-{tokenizer_key}-c{CONFIG_VERSION}"
        folder, reused = cached_dir("gguf-config", key, produce)
        if reused:
            step.cached(str(folder))
    return folder, key, reused


def _write_config(gguf_path: Path, out: Path, beside: list[Path], source: str) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = _general_architecture(gguf_path)
    if architecture == GPT_OSS:  # transformers cannot read its config (gguf_gpt_oss.py)
        config = gpt_oss_config(gguf_path)
    elif architecture in DENSE_GGUF:  # nor theirs (gguf_dense.py)
        config = dense_config(gguf_path)
    else:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _add_expert_length(gguf_path, architecture, config)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    add_gguf_rope(gguf_path, config)  # transformers drops the GGUF's rope scaling (gguf_rope.py)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)  # what saving the model would write beside it
    if beside:
        for path in beside:
            shutil.copyfile(path, out / path.name)
        return
    # AutoTokenizer reads the GGUF's config first, which transformers cannot for gpt-oss; the fast class reads the
    # tokenizer alone.
    reader = PreTrainedTokenizerFast if architecture == GPT_OSS or architecture in DENSE_GGUF else AutoTokenizer
    tokenizer = reader.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
    check_tokenizer(out / "tokenizer.json", tokenizer, source)


def _add_expert_length(gguf_path: Path, architecture: str, config: object) -> None:
    """transformers (5.23) drops a Qwen-MoE file's `expert_feed_forward_length` and
    `expert_shared_feed_forward_length`, which leaves the config's defaults (Qwen3-30B-A3B's 768, Qwen1.5-MoE's
    1408 and 5632: wrong for every other size)."""
    fields = read_metadata(gguf_path).fields
    for key, attribute in (
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
    ):
        length = fields.get(f"{architecture}.{key}")
        if length is not None and hasattr(config, attribute):
            setattr(config, attribute, int(length))


def dequantized_folder(
    gguf_path: Path, sha256: str, source: str, progress: StepProgress, *, tokenizer_from: Path
) -> tuple[Path, str, bool]:
    """Return `(hf_dir, its content key, reused)`: the whole model as an fp32 Hugging Face folder (tools, not builds:
    it holds the fp32 model in memory and on disk)."""
    gguf_architecture(gguf_path)
    beside, tokenizer_key = _beside(tokenizer_from)
    with progress.step("dequantize", f"dequantize {gguf_path.name} to fp32") as step:

        def produce(out: Path) -> None:
            _convert(gguf_path, out, beside, source)

        key = f"{sha256}-{tokenizer_key}-v{DEQUANTIZE_VERSION}"
        hf_dir, reused = cached_dir("hf", key, produce)
        if reused:
            step.cached(str(hf_dir))
    return hf_dir, key, reused


def _convert(gguf_path: Path, out: Path, beside: list[Path], source: str) -> None:
    # transformers' GGUF reader draws its own tqdm bar; ours already shows this step.
    os.environ.setdefault("TQDM_DISABLE", "1")
    architecture = _general_architecture(gguf_path)
    if architecture == GPT_OSS or architecture in DENSE_GGUF:  # transformers cannot load these from a GGUF
        _convert_ours(gguf_path, out, beside, source)
        return
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _add_expert_length(gguf_path, architecture, config)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype="float32"
    )
    # from_pretrained sets hf_quantizer without PreTrainedModel declaring it: mypy sees torch's Module.__setattr__
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    add_gguf_rope(gguf_path, model.config)  # in the config written (the rotary buffers are not saved)
    model.save_pretrained(out)
    if beside:
        for path in beside:
            shutil.copyfile(path, out / path.name)
        return
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
    check_tokenizer(out / "tokenizer.json", tokenizer, source)


def _convert_ours(gguf_path: Path, out: Path, beside: list[Path], source: str) -> None:
    """The fp32 folder of a GGUF whose config transformers cannot read: the config folder `pkg build` writes, and
    every tensor as the build reads it (sources/weights.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packager.sources.weights import GgufWeights

    _write_config(gguf_path, out, beside, source)
    config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = GgufWeights(gguf_path, out)
    state = {name: weights.load(name) for name in model.state_dict() if weights.has(name)}
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    if config.tie_word_embeddings:
        missing -= {"lm_head.weight"}
    if missing:
        raise UserError(f"model.source = {source!r}: {gguf_path.name} lacks {', '.join(sorted(missing))}")
    model.save_pretrained(out)


def check_texts() -> list[str]:
    """Texts a converted tokenizer must encode as transformers does: the quality prompts, held-out text, odd input."""
    data = files("packager") / "data"
    prompts = json.loads((data / "quality_prompts.json").read_text())["prompts"]
    contents = [m["content"] for prompt in prompts for m in prompt["messages"]]
    heldout = (data / "heldout.txt").read_text()
    return [*_CHECK_TEXTS, *contents, *heldout.split("\n\n")]


def check_tokenizer(tokenizer_json: Path, reference: object, source: str) -> None:
    """Refuse a converted `tokenizer.json` that encodes any check text unlike transformers' tokenizer."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(tokenizer_json))
    for text in check_texts():
        for special in (False, True):
            expected = reference(text, add_special_tokens=special)["input_ids"]  # type: ignore[operator]
            got = ours.encode(text, add_special_tokens=special).ids
            if got != expected:
                first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
                raise UserError(
                    f"model.source = {source!r}: the tokenizer converted from the GGUF's metadata encodes "
                    f"{text[:60]!r} unlike transformers (first difference at token {first}: {got[:12]} vs "
                    f"{expected[:12]}); put the model's own tokenizer.json and tokenizer_config.json beside the GGUF"
                )
