"""Read a llama.cpp GGUF LoRA adapter (what `convert_lora_to_gguf.py` writes from a PEFT folder) into `LoraWeights`.

The layout, from llama.cpp's `convert_lora_to_gguf.py` (writer) and `src/llama-adapter.cpp` (loader):

- metadata: `general.architecture` (the base's GGUF arch), `general.type = "adapter"`, `adapter.type = "lora"`,
  `adapter.lora.alpha` (float32: PEFT's `lora_alpha`).
- tensors: `<base tensor name>.lora_a` and `.lora_b` for each adapted weight, e.g. `blk.3.attn_q.weight.lora_a`.
  They hold PEFT's matrices unchanged: `lora_a` is `lora_A` `[rank, in]` and `lora_b` is `lora_B` `[out, rank]`
  in numpy (row-major) order, which GGUF lists reversed (`ne = [in, rank]` and `[rank, out]`); the loader checks
  `a.ne[1] == b.ne[0]` (the rank). Here `a = lora_a.T` `[in, rank]` and `b = lora_b.T` `[rank, out]`.
- scale: llama.cpp multiplies each delta by `alpha / rank` (`rank = b.ne[0]`), or by 1 when alpha is 0 or absent
  (`llama_adapter_lora_weight::get_scale`, and `build_lora_mm` in `src/llama-graph.cpp`).
- `*_norm.weight` vectors (which mergekit-extract-lora adds) are skipped, as llama.cpp's loader skips them.
- For the `llama` arch the converter permutes the rows of the q and k projections (`LlamaModel.permute`, the
  interleaved rotary layout llama.cpp uses) and so the rows of their `lora_b`; the base onnxfn exports keeps
  Hugging Face's order, so those are permuted back, which needs the base's head counts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from packager.adapters.weights import LoraMatrices, LoraWeights
from packager.errors import UserError

if TYPE_CHECKING:  # `gguf` comes with the packager extra: imported when a GGUF adapter is read, not with `pkg`
    from gguf import GGUFReader, ReaderField, ReaderTensor

GGUF_MAGIC = b"GGUF"

# llama.cpp's per-block tensor names → the Hugging Face projection names of `ADAPTABLE_MODULES`.
GGUF_MODULES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}

# GGUF archs whose converter permutes q/k rows into llama.cpp's rotary layout (convert_hf_to_gguf's LlamaModel,
# which Llama and Mistral checkpoints go through).
ROPE_PERMUTED_ARCHS = frozenset({"llama"})

_LORA_NAME = re.compile(r"^(?P<weight>.+)\.lora_(?P<part>[ab])$")
_BLOCK_WEIGHT = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<name>[a-z_0-9]+)\.weight$")
_CONVERT_HINT = (
    "llama.cpp's convert_lora_to_gguf.py makes one from a PEFT folder "
    "(python convert_lora_to_gguf.py --base BASE_MODEL_DIR --outtype f16 PEFT_DIR)"
)


def read_gguf_lora(path: Path, *, n_head: int | None = None, n_head_kv: int | None = None) -> LoraWeights:
    """The LoRA adapter in the GGUF file `path`, in onnxfn's orientation and at its own precision (F32 and F16 stay
    as they are, BF16 becomes float32 exactly).

    `n_head` / `n_head_kv` are the base's attention head counts; they are needed only when a `llama`-arch adapter
    adapts q or k projections (to undo the converter's rotary row permutation), and a ValueError says so.
    """
    reader = _open(path)
    arch = _string(reader, "general.architecture")
    _check_kind(reader, path)
    alpha = _alpha(reader, path)
    # GGUFReader flags a file in the other byte order than this machine's with "S" (swapped).
    little_endian = (reader.byte_order == "I") == (np.little_endian)

    pairs: dict[tuple[int, str], dict[str, ReaderTensor]] = {}
    for tensor in reader.tensors:
        name = tensor.name
        match = _LORA_NAME.match(name)
        if match is None:
            if name.endswith("_norm.weight"):
                continue  # llama.cpp's loader skips these too (mergekit-extract-lora adds them)
            raise UserError(
                f"{path}: tensor {name!r} is not a LoRA tensor (LoRA tensors end in .lora_a or .lora_b). "
                f"Use a LoRA adapter file as {_CONVERT_HINT}"
            )
        key = _module_key(match.group("weight"), path)
        pairs.setdefault(key, {})[match.group("part")] = tensor

    if not pairs:
        raise UserError(f"{path}: the adapter has no LoRA tensors (.lora_a / .lora_b). Re-convert it: {_CONVERT_HINT}")

    matrices: dict[tuple[int, str], LoraMatrices] = {}
    ranks: dict[int, list[str]] = {}
    for (layer, module), parts in sorted(pairs.items(), key=lambda item: (item[0][0], _module_order(item[0][1]))):
        lora_a, lora_b = parts.get("a"), parts.get("b")
        if lora_a is None or lora_b is None:
            present, missing = ("lora_a", "lora_b") if lora_b is None else ("lora_b", "lora_a")
            name = (lora_a or lora_b).name  # type: ignore[union-attr]
            raise UserError(
                f"{path}: {name!r} ({present}) has no {missing} partner: every adapted weight needs both. "
                f"The file is incomplete or was not written by llama.cpp; re-convert the adapter: {_CONVERT_HINT}"
            )
        a_rows = _array(lora_a, path, little_endian)  # [rank, in]
        b_rows = _array(lora_b, path, little_endian)  # [out, rank]
        if a_rows.shape[0] != b_rows.shape[1]:
            raise UserError(
                f"{path}: {lora_a.name!r} and {lora_b.name!r} do not chain: lora_a is [rank={a_rows.shape[0]}, "
                f"in={a_rows.shape[1]}] and lora_b is [out={b_rows.shape[0]}, rank={b_rows.shape[1]}] (numpy order; "
                f"GGUF lists them reversed), so their ranks differ. An adapter from llama.cpp's old `finetune` "
                f"example has lora_a untransposed and is not supported; re-convert from the PEFT folder: "
                f"{_CONVERT_HINT}"
            )
        rank = int(b_rows.shape[1])
        ranks.setdefault(rank, []).append(lora_b.name)
        if arch in ROPE_PERMUTED_ARCHS and module in ("q_proj", "k_proj"):
            heads = n_head if module == "q_proj" else (n_head_kv or n_head)
            if heads is None:
                raise ValueError(
                    f"{path}: a {arch!r} adapter's {module} rows are in llama.cpp's rotary order; "
                    "pass the base's n_head (and n_head_kv) to read_gguf_lora to restore Hugging Face's order"
                )
            b_rows = _unpermute_rows(b_rows, heads, lora_b.name, path)
        matrices[(layer, module)] = LoraMatrices(a=np.ascontiguousarray(a_rows.T), b=np.ascontiguousarray(b_rows.T))

    if len(ranks) > 1:
        listed = "; ".join(
            f"rank {r}: {', '.join(names[:3])}{' …' if len(names) > 3 else ''}" for r, names in ranks.items()
        )
        raise UserError(
            f"{path}: the adapter's ranks differ between tensors ({listed}); onnxfn stacks adapters with one rank "
            "each. Train the adapter with one rank for every target module (PEFT's `r`, without `rank_pattern`)"
        )
    (rank,) = ranks
    # llama.cpp: `scale = alpha ? alpha / rank : 1` (llama_adapter_lora_weight::get_scale).
    scale = alpha / rank if alpha else 1.0
    return LoraWeights(rank=rank, scale=scale, matrices=matrices, source=str(path))


def _open(path: Path) -> GGUFReader:
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise UserError(f"{path}: cannot read the adapter file: {e.strerror or e}") from e
    if head != GGUF_MAGIC:
        raise UserError(
            f"{path} is not a GGUF file (it starts with {head!r}, and GGUF files start with {GGUF_MAGIC!r}). "
            f"Give a GGUF LoRA adapter ({_CONVERT_HINT}), or the PEFT folder itself "
            "(adapter_config.json and adapter_model.safetensors)"
        )
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise UserError(f"{path}: not a readable GGUF file ({e}); it may be truncated. Download it again") from e


def _field_value(field: ReaderField) -> object:
    from gguf.constants import GGUFValueType

    if not field.types or field.types[0] == GGUFValueType.ARRAY:
        return None
    return field.contents()


def _string(reader: GGUFReader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = _field_value(field)
    return value if isinstance(value, str) else None


def _check_kind(reader: GGUFReader, path: Path) -> None:
    general_type = _string(reader, "general.type")
    if general_type != "adapter":
        what = "has no general.type" if general_type is None else f"has general.type = {general_type!r}"
        raise UserError(
            f"{path} is a GGUF model, not an adapter (it {what}; an adapter has general.type = 'adapter'). "
            f"A LoRA adapter file is expected here: {_CONVERT_HINT}. A full model belongs in [model] source"
        )
    adapter_type = _string(reader, "adapter.type")
    if adapter_type != "lora":
        got = "no adapter.type" if adapter_type is None else f"adapter.type = {adapter_type!r}"
        raise UserError(
            f"{path} is a GGUF adapter with {got}, and onnxfn reads LoRA adapters only (adapter.type = 'lora'); "
            f"a control vector or other adapter cannot be served per request. Give a LoRA adapter: {_CONVERT_HINT}"
        )


def _alpha(reader: GGUFReader, path: Path) -> float:
    field = reader.fields.get("adapter.lora.alpha")
    if field is None:
        return 0.0  # llama.cpp reads an absent alpha as 0, which means scale 1
    value = _field_value(field)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise UserError(
            f"{path}: adapter.lora.alpha is {value!r}, not a number (llama.cpp writes PEFT's lora_alpha as a float32). "
            f"Re-convert the adapter: {_CONVERT_HINT}"
        )
    return float(value)


def _module_key(weight: str, path: Path) -> tuple[int, str]:
    match = _BLOCK_WEIGHT.match(weight)
    if match is None or match.group("name") not in GGUF_MODULES:
        supported = ", ".join(f"blk.N.{name}.weight ({module})" for name, module in GGUF_MODULES.items())
        raise UserError(
            f"{path}: the adapter adapts {weight!r}, which onnxfn cannot serve per request: only the attention and "
            f"MLP projections of the decoder layers are adaptable ({supported}). LoRA on token_embd, output "
            "(lm_head), fused projections (attn_qkv) or other tensors is not supported; "
            "train the adapter with target_modules limited to q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj "
            "and down_proj"
        )
    return int(match.group("layer")), GGUF_MODULES[match.group("name")]


def _module_order(module: str) -> int:
    return list(GGUF_MODULES.values()).index(module)


def _array(tensor: ReaderTensor, path: Path, little_endian: bool) -> np.ndarray:
    """The tensor's values as a 2-D array in numpy order (`ne` reversed), copied out of the file's memory map."""
    kind = tensor.tensor_type
    if len(tensor.shape) != 2:
        raise UserError(
            f"{path}: {tensor.name!r} has {len(tensor.shape)} dimensions ({list(tensor.shape)} in GGUF order); "
            f"LoRA matrices have 2. Re-convert the adapter: {_CONVERT_HINT}"
        )
    from gguf import GGMLQuantizationType

    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    data = np.asarray(tensor.data)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(data, dtype=data.dtype.newbyteorder("=")).reshape(rows, cols)
    if kind == GGMLQuantizationType.BF16:
        # The reader gives BF16 as raw bytes: each value is the upper half of a float32's bits.
        raw = np.frombuffer(data.tobytes(), dtype="<u2" if little_endian else ">u2").reshape(rows, cols)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    raise UserError(
        f"{path}: {tensor.name!r} is stored as {kind.name}, a quantized type; onnxfn keeps an adapter in its own "
        "float precision and reads F32, F16 and BF16 LoRA tensors. Re-convert the adapter with "
        "convert_lora_to_gguf.py --outtype f16 (or f32, bf16)"
    )


def _unpermute_rows(b_rows: np.ndarray, heads: int, name: str, path: Path) -> np.ndarray:
    """Undo convert_hf_to_gguf's `LlamaModel.permute` on the output rows: it maps each head's rows
    `[half 0 | half 1]` to interleaved pairs, `w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)`."""
    out = b_rows.shape[0]
    if heads <= 0 or out % (2 * heads):
        raise UserError(
            f"{path}: {name!r} has {out} output rows, which do not split into {heads} heads of an even size; "
            "the adapter was made for another base model"
        )
    return b_rows.reshape(heads, out // heads // 2, 2, -1).swapaxes(1, 2).reshape(b_rows.shape)
