"""GGUF LoRA adapters, written as llama.cpp's convert_lora_to_gguf.py lays them out, read into `LoraWeights`."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from packager.adapters.gguf_lora import read_gguf_lora
from packager.errors import UserError

HIDDEN, KV, FFN, RANK = 16, 8, 24, 4
N_HEAD, N_HEAD_KV = 4, 2  # head_dim 4
# HF module → (GGUF name, in, out)
SHAPES = {
    "q_proj": ("attn_q", HIDDEN, HIDDEN),
    "k_proj": ("attn_k", HIDDEN, KV),
    "v_proj": ("attn_v", HIDDEN, KV),
    "o_proj": ("attn_output", HIDDEN, HIDDEN),
    "gate_proj": ("ffn_gate", HIDDEN, FFN),
    "up_proj": ("ffn_up", HIDDEN, FFN),
    "down_proj": ("ffn_down", FFN, HIDDEN),
}


def peft_matrices(
    modules: tuple[str, ...], layers: tuple[int, ...] = (0, 1), rank: int = RANK, seed: int = 0
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """PEFT's (lora_A [rank, in], lora_B [out, rank]) per (layer, module), random."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in layers:
        for module in modules:
            _, n_in, n_out = SHAPES[module]
            a = rng.standard_normal((rank, n_in)).astype(np.float32)
            b = rng.standard_normal((n_out, rank)).astype(np.float32)
            out[(layer, module)] = (a, b)
    return out


def llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, which LoraTorchTensor applies to lora_B's rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_adapter(
    path: Path,
    matrices: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]],
    *,
    arch: str = "qwen2",
    alpha: float | None = 8.0,
    dtype: type = np.float32,
    general_type: str | None = "adapter",
    adapter_type: str | None = "lora",
    extra: dict[str, np.ndarray] | None = None,
    skip: set[str] | None = None,
) -> Path:
    """A GGUF as convert_lora_to_gguf.py writes it: arch, general.type, adapter.type, adapter.lora.alpha, then
    `blk.N.<name>.weight.lora_a` (lora_A, [rank, in]) and `.lora_b` (lora_B, [out, rank]) in numpy order."""
    writer = gguf.GGUFWriter(path, arch)
    if general_type is not None:
        writer.add_type(general_type)
    if adapter_type is not None:
        writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    tensors: dict[str, np.ndarray] = {}
    for (layer, module), (a, b) in matrices.items():
        name = f"blk.{layer}.{SHAPES[module][0]}.weight"
        if arch == "llama" and module == "q_proj":
            b = llama_permute(b, N_HEAD, N_HEAD)
        if arch == "llama" and module == "k_proj":
            b = llama_permute(b, N_HEAD, N_HEAD_KV)
        tensors[f"{name}.lora_a"] = a.astype(dtype)
        tensors[f"{name}.lora_b"] = b.astype(dtype)
    tensors.update(extra or {})
    for name, data in tensors.items():
        if name not in (skip or set()):
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


ALL = tuple(SHAPES)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reads_back_every_module_in_its_own_precision(tmp_path: Path, dtype: type) -> None:
    original = peft_matrices(ALL)
    path = write_adapter(tmp_path / "a.gguf", original, dtype=dtype, alpha=8.0)
    weights = read_gguf_lora(path)
    assert weights.rank == RANK
    assert weights.scale == 8.0 / RANK
    assert weights.modules == ALL
    assert weights.source == str(path)
    assert set(weights.matrices) == set(original)
    for key, (a, b) in original.items():
        got = weights.matrices[key]
        assert got.a.dtype == dtype and got.b.dtype == dtype
        assert got.a.shape == (SHAPES[key[1]][1], RANK) and got.b.shape == (RANK, SHAPES[key[1]][2])
        np.testing.assert_array_equal(got.a, a.T.astype(dtype))
        np.testing.assert_array_equal(got.b, b.T.astype(dtype))


def test_delta_matches_peft(tmp_path: Path) -> None:
    """`scale * (x @ a) @ b` is PEFT's `lora_alpha / r * lora_B(lora_A(x))`."""
    original = peft_matrices(("v_proj",), layers=(0,))
    weights = read_gguf_lora(write_adapter(tmp_path / "a.gguf", original, alpha=16.0))
    (lora_a, lora_b) = original[(0, "v_proj")]
    x = np.random.default_rng(1).standard_normal((3, HIDDEN)).astype(np.float32)
    got = weights.matrices[(0, "v_proj")]
    np.testing.assert_allclose(weights.scale * (x @ got.a) @ got.b, 16.0 / RANK * (x @ lora_a.T) @ lora_b.T, rtol=1e-6)


def test_bf16_becomes_float32_exactly(tmp_path: Path) -> None:
    original = peft_matrices(("q_proj",), layers=(2,))
    a, b = original[(2, "q_proj")]
    path = tmp_path / "a.gguf"
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 4.0)
    for suffix, m in (("lora_a", a), ("lora_b", b)):
        bits = (m.view(np.uint32) >> 16).astype(np.uint16)  # truncation: bf16 of m, exactly representable
        writer.add_tensor(f"blk.2.attn_q.weight.{suffix}", bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = read_gguf_lora(path).matrices[(2, "q_proj")]
    assert got.a.dtype == np.float32
    trunc = lambda m: (m.view(np.uint32) & 0xFFFF0000).view(np.float32)  # noqa: E731
    np.testing.assert_array_equal(got.a, trunc(a).T)
    np.testing.assert_array_equal(got.b, trunc(b).T)


def test_llama_q_k_rows_are_unpermuted(tmp_path: Path) -> None:
    original = peft_matrices(("q_proj", "k_proj", "v_proj"), layers=(0,))
    path = write_adapter(tmp_path / "a.gguf", original, arch="llama")
    with pytest.raises(ValueError, match="n_head"):
        read_gguf_lora(path)
    weights = read_gguf_lora(path, n_head=N_HEAD, n_head_kv=N_HEAD_KV)
    for key, (a, b) in original.items():
        np.testing.assert_array_equal(weights.matrices[key].a, a.T)
        np.testing.assert_array_equal(weights.matrices[key].b, b.T)
    # Without q/k there is nothing to unpermute, and no head counts are needed.
    read_gguf_lora(write_adapter(tmp_path / "v.gguf", peft_matrices(("v_proj",)), arch="llama"))


def test_alpha_zero_or_absent_means_scale_one(tmp_path: Path) -> None:
    original = peft_matrices(("o_proj",))
    assert read_gguf_lora(write_adapter(tmp_path / "zero.gguf", original, alpha=0.0)).scale == 1.0
    assert read_gguf_lora(write_adapter(tmp_path / "none.gguf", original, alpha=None)).scale == 1.0


def test_norm_vectors_are_skipped(tmp_path: Path) -> None:
    extra = {"blk.0.attn_norm.weight": np.ones(HIDDEN, dtype=np.float32)}
    weights = read_gguf_lora(write_adapter(tmp_path / "a.gguf", peft_matrices(("up_proj",)), extra=extra))
    assert weights.modules == ("up_proj",)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(b'{"__metadata__": {}}')
    with pytest.raises(UserError, match=r"adapter_model.safetensors is not a GGUF file") as e:
        read_gguf_lora(path)
    assert "PEFT folder" in str(e.value)


@pytest.mark.parametrize("general_type", [None, "model"])
def test_a_model_not_an_adapter(tmp_path: Path, general_type: str | None) -> None:
    path = write_adapter(tmp_path / "model.gguf", peft_matrices(("q_proj",)), general_type=general_type)
    with pytest.raises(UserError) as e:
        read_gguf_lora(path)
    message = str(e.value)
    assert str(path) in message
    assert "not an adapter" in message and "LoRA adapter file is expected" in message
    assert "convert_lora_to_gguf.py" in message and "PEFT folder" in message


def test_adapter_type_other_than_lora(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "cv.gguf", peft_matrices(("q_proj",)), adapter_type="control_vector")
    with pytest.raises(UserError, match=r"adapter.type = 'control_vector'.*LoRA adapters only") as e:
        read_gguf_lora(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("name", ["token_embd.weight", "output.weight", "blk.0.attn_qkv.weight"])
def test_tensor_outside_the_map(tmp_path: Path, name: str) -> None:
    extra = {
        f"{name}.lora_a": np.zeros((RANK, HIDDEN), dtype=np.float32),
        f"{name}.lora_b": np.zeros((HIDDEN, RANK), dtype=np.float32),
    }
    path = write_adapter(tmp_path / "a.gguf", peft_matrices(("q_proj",)), extra=extra)
    with pytest.raises(UserError) as e:
        read_gguf_lora(path)
    message = str(e.value)
    assert repr(name) in message and "cannot serve per request" in message
    assert "blk.N.attn_q.weight (q_proj)" in message and "blk.N.ffn_down.weight (down_proj)" in message
    assert "token_embd" in message and "output" in message


def test_not_a_lora_tensor(tmp_path: Path) -> None:
    extra = {"blk.0.attn_q.weight": np.zeros((HIDDEN, HIDDEN), dtype=np.float32)}
    with pytest.raises(UserError, match=r"'blk.0.attn_q.weight' is not a LoRA tensor"):
        read_gguf_lora(write_adapter(tmp_path / "a.gguf", peft_matrices(("v_proj",)), extra=extra))


@pytest.mark.parametrize(
    ("skipped", "present", "missing"), [("lora_b", "lora_a", "lora_b"), ("lora_a", "lora_b", "lora_a")]
)
def test_missing_partner(tmp_path: Path, skipped: str, present: str, missing: str) -> None:
    skip = {f"blk.1.ffn_down.weight.{skipped}"}
    path = write_adapter(tmp_path / "a.gguf", peft_matrices(("down_proj",)), skip=skip)
    with pytest.raises(UserError) as e:
        read_gguf_lora(path)
    message = str(e.value)
    assert str(path) in message
    assert f"'blk.1.ffn_down.weight.{present}' ({present}) has no {missing} partner" in message


def test_ranks_that_differ(tmp_path: Path) -> None:
    matrices = peft_matrices(("q_proj",), rank=4) | peft_matrices(("v_proj",), rank=8)
    with pytest.raises(UserError, match=r"ranks differ between tensors \(rank 4: .*rank 8: "):
        read_gguf_lora(write_adapter(tmp_path / "a.gguf", matrices))


def test_shapes_that_do_not_chain(tmp_path: Path) -> None:
    a = np.zeros((RANK, HIDDEN), dtype=np.float32)
    b = np.zeros((HIDDEN, RANK + 1), dtype=np.float32)
    with pytest.raises(UserError, match=r"do not chain: lora_a is \[rank=4, in=16\] and lora_b is \[out=16, rank=5\]"):
        read_gguf_lora(write_adapter(tmp_path / "a.gguf", {(0, "o_proj"): (a, b)}))


def test_quantized_tensors(tmp_path: Path) -> None:
    # Q8_0 blocks hold 32 values of a row, so this adapter's rows are 32 long: in = out = rank = 32.
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((32, 32)).astype(np.float32) for _ in range(2))
    path = tmp_path / "a.gguf"
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 32.0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("blk.0.attn_q.weight.lora_a", gguf.quants.quantize(a, q8), raw_dtype=q8)
    writer.add_tensor("blk.0.attn_q.weight.lora_b", gguf.quants.quantize(b, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=r"stored as Q8_0, a quantized type.*--outtype f16"):
        read_gguf_lora(path)
