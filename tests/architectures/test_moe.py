"""Mixture-of-Experts beyond the fp32 cases (cases_moe.py, run by test_decoders.py): a gpt-oss GGUF written as
llama.cpp writes it, built at precision `gguf` with its MXFP4 experts carried exactly into `QMoE`, checked against
transformers and served; and the operators' batch invariance that serving several streams relies on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize
from onnx import TensorProto, helper, numpy_helper

from packager.bench.moe import active_bytes_per_token
from packager.export.moe import QuantizedExperts, float_moe_nodes, qmoe_layout, qmoe_node, qmoe_nodes, unpack
from runtime.bundle import open_bundle
from runtime.engine.request import SamplingParams
from tests.architectures.cases_moe import GPT_OSS
from tests.architectures.conftest import (
    assert_batched_with_a_shared_prefix_as_alone,
    assert_gguf_parity_and_quality,
    make_model,
)
from tests.fixtures.gguf_bundle import BundleWeights, interleaved
from tests.fixtures.moe_gguf import write_gpt_oss_gguf
from tests.packager.conftest import write_function

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _build(root: Path, name: str, source: str, export: str, cache: Path) -> Path:
    """`pkg build` of a function with that source and `[export]` section: its bundle."""
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec

    function = write_function(root, name, source, f"[export]\nmax_context = 256\n{export}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONNXFN_CACHE_DIR", str(cache))
        patch.chdir(root)
        return root / build_function(load_spec(function), StepProgress()).bundle


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny gpt-oss GGUF (MXFP4 experts) and its `pkg build` at precision `gguf`: (HF folder, GGUF, bundle)."""
    from tests.conftest import tiny_model_cache

    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    hf = make_model(GPT_OSS, root / "hf")
    gguf_path = write_gpt_oss_gguf(hf, root / "gguf" / "tiny-gpt-oss.gguf")
    bundle = _build(
        root, "gpt-oss-gguf", f"gguf:{gguf_path}", 'precision = "gguf"\n', tiny_model_cache(tmp_path_factory)
    )
    return hf, gguf_path, bundle


def test_gpt_oss_gguf_experts_are_the_files_own_mxfp4_blocks(gpt_oss_gguf: tuple[Path, Path, Path]) -> None:
    _, gguf_path, bundle_dir = gpt_oss_gguf
    weights = BundleWeights(bundle_dir)
    report = weights.report["experts"]
    file = {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(str(gguf_path)).tensors}
    qmoe = [n for n in weights.model.graph.node if n.op_type == "QMoE"]
    assert len(report) == 2 and len(qmoe) == 4  # two layers; 4 experts a token, mixed two at a time
    for layer in ("0", "1"):
        entry = report[f"/model/layers.{layer}/moe/MoE"]
        assert entry["fc1"]["carried"] == entry["fc2"]["carried"] == "exact"
        assert set(entry["fc1"]["tensors"].values()) == set(entry["fc2"]["tensors"].values()) == {"MXFP4"}
        pairs = [n for n in qmoe if n.name.startswith(f"/model/layers.{layer}/")]
        assert {tuple(n.input[2:8]) for n in pairs} == {tuple(pairs[0].input[2:8])}  # one copy of the experts
        node = pairs[0]
        bits, block = qmoe_layout(node)
        assert (bits, block) == (8, 32)  # MXFP4's doubled e2m1 values (-12..12) in the 8-bit container
        fc1, fc2 = weights.qmoe_experts(node)
        gate, up = file[f"blk.{layer}.ffn_gate_exps.weight"], file[f"blk.{layer}.ffn_up_exps.weight"]
        np.testing.assert_array_equal(fc1.dequantize(), interleaved(gate, up))  # bit for bit: none re-quantized
        np.testing.assert_array_equal(fc2.dequantize(), file[f"blk.{layer}.ffn_down_exps.weight"])


def test_gpt_oss_gguf_matches_transformers_and_serves_a_batch_as_each_row_alone(
    gpt_oss_gguf: tuple[Path, Path, Path],
) -> None:
    """The file's fp32 model (its experts dequantized) is transformers' on the same weights; the bundle computes with
    int8 activations (QMoE's 8-bit experts have no other kernel), so it is held to the quality budget against that
    fp32 model, not to transformers' greedy tokens; served, each row of a batch gets the tokens it gets alone."""
    _, _, bundle_dir = gpt_oss_gguf
    assert_gguf_parity_and_quality(bundle_dir)
    bundle = open_bundle(bundle_dir)
    facts = bundle.manifest.model
    assert (facts.architecture, facts.precision) == ("gpt_oss", "gguf")
    assert_batched_with_a_shared_prefix_as_alone(bundle, GREEDY)


def _session(nodes: list[onnx.NodeProto], initializers: dict[str, np.ndarray]) -> Any:
    import onnxruntime as ort

    graph = helper.make_graph(
        nodes, "moe", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["tokens", None]) for n in ("x", "router")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", [8, 4])
def test_a_tokens_experts_output_does_not_depend_on_its_neighbours(bits: int) -> None:
    """A gpt-oss MoE layer (4 experts a token) as bundles run it: QMoE (8-bit experts: a GGUF's MXFP4, `int8`; 4-bit
    at accuracy level 4: `int4`) mixing two experts a call (moe.qmoe_nodes). A token's output is bit for bit the same
    alone and among 15 others, most routed to the same experts; it equals one QMoE of all 4 to float rounding, and
    the fp32 reference's MoE nodes (moe.float_moe_nodes) compute the layer as one fp32 MoE does."""
    rng = np.random.default_rng(bits)
    hidden, inter, experts, tokens = 128, 64, 8, 16
    values1 = rng.integers(0, 1 << bits, (experts, 2 * inter, hidden), dtype=np.uint8)
    values2 = rng.integers(0, 1 << bits, (experts, hidden, inter), dtype=np.uint8)
    fc1 = QuantizedExperts(
        bits, 32, values1, (rng.random((experts, 2 * inter, hidden // 32)) * 0.01).astype(np.float32)
    )
    fc2 = QuantizedExperts(bits, 32, values2, (rng.random((experts, hidden, inter // 32)) * 0.01).astype(np.float32))
    biases = {"b1": rng.standard_normal((experts, 2 * inter)).astype(np.float32) * 0.1,
              "b2": rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1}  # fmt: skip
    blocks = {"w1": fc1.packed(), "s1": fc1.scales, "w2": fc2.packed(), "s2": fc2.scales, **biases}
    floats = {"f1": fc1.dequantize(), "f2": fc2.dequantize(), **biases}
    moe = helper.make_node(
        "MoE", ["x", "router", "f1", "b1", "f2", "b2"], ["y"], name="/model/layers.0/moe/MoE", domain="com.microsoft",
        k=4, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1, swiglu_limit=7.0,
        activation_alpha=1.702, activation_beta=1.0,
    )  # fmt: skip
    pairs = qmoe_nodes(moe, ("w1", "s1"), ("w2", "s2"), bits, 32, accuracy_level=4)
    assert [n.op_type for n in pairs].count("QMoE") == 2
    whole = qmoe_node(moe, ("w1", "s1"), ("w2", "s2"), bits, 32, accuracy_level=4)
    reference = [n for node in pairs for n in (float_moe_nodes(node, "f1", "f2") if node.op_type == "QMoE" else [node])]
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    router = rng.standard_normal((tokens, experts)).astype(np.float32)
    router[:, :3] += 2.0  # most tokens pick experts 0-2: their rows are computed together

    def run(session: Any, rows: slice) -> np.ndarray:
        return session.run(None, {"x": x[rows], "router": router[rows]})[0]  # type: ignore[no-any-return]

    served = _session(pairs, blocks)
    together = run(served, slice(None))
    np.testing.assert_array_equal(together, np.concatenate([run(served, slice(i, i + 1)) for i in range(tokens)]))
    scale = np.abs(together).max()
    np.testing.assert_allclose(together, run(_session([whole], blocks), slice(None)), rtol=1e-5, atol=1e-5 * scale)
    fp32 = run(_session([moe], floats), slice(None))
    np.testing.assert_allclose(
        run(_session(reference, {**floats, **blocks}), slice(None)), fp32, rtol=1e-5, atol=1e-5 * scale
    )


def test_the_gguf_bundle_is_within_the_mxfp4_to_int8_growth(gpt_oss_gguf: tuple[Path, Path, Path]) -> None:
    """MXFP4 (4.25 bits a weight) held as int8 blocks with a float32 scale per 32 (9 bits): the experts grow ~2.1x,
    the rest stays the file's size."""
    _, gguf_path, bundle_dir = gpt_oss_gguf
    reader = GGUFReader(str(gguf_path))
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps.weight" in t.name)
    rest = sum(int(t.n_bytes) for t in reader.tensors) - experts
    weights = open_bundle(bundle_dir).manifest.files["model.onnx.data"].size
    assert weights <= rest * 1.5 + experts * 9 / 4.25 * 1.05, (weights, rest, experts)
    model = onnx.load(str(bundle_dir / "model.onnx"), load_external_data=False)
    assert not [n for n in model.graph.node if n.op_type == "MoE"]


def test_a_decode_token_reads_the_routed_share_of_the_experts(gpt_oss_gguf: tuple[Path, Path, Path]) -> None:
    """The active bytes behind the MoE bench's bandwidth limit: everything but the experts and the embedding, the
    routed top-k of n experts, one embedding row; in the file and in the decode graph (its QMoE inputs)."""
    hf, gguf_path, bundle_dir = gpt_oss_gguf
    reader = GGUFReader(str(gguf_path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    experts = sum(size for name, size in sizes.items() if "_exps." in name)
    embedding = reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")]
    config = json.loads((hf / "config.json").read_text())
    routed = config["num_experts_per_tok"] / config["num_local_experts"]
    active = active_bytes_per_token(gguf_path, bundle_dir)
    assert active["routed_share"] == routed
    vocab = int(embedding.shape[-1])
    expected = sum(sizes.values()) - experts * (1 - routed) - int(embedding.n_bytes) * (1 - 1 / vocab)
    assert active["gguf"] == pytest.approx(expected)
    # The bundle's experts are int8 (~2.1x the MXFP4 bytes) and its embedding a gathered table: a token reads more
    # than the file's active bytes, and far less than the bundle's weights.
    weights = open_bundle(bundle_dir).manifest.files["model.onnx.data"].size
    assert active["gguf"] < active["bundle"] < weights - experts * (1 - routed)


def test_gpt_oss_at_int4_quantizes_each_expert_as_the_builders_cpu_path(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """From a Hugging Face folder at precision int4: every expert's rows in 4-bit blocks of 32 (ONNX Runtime's
    quantizer, as the builder's CPU QMoE path), each weight within a block's step of the fp32 one."""
    from safetensors.torch import load_file

    from tests.conftest import tiny_model_cache

    root = tmp_path_factory.mktemp("gpt-oss-int4")
    hf = make_model(GPT_OSS, root / "hf")  # the fp32 case's model: its structure comes from the session's cache
    # Random weights are no language model: the budget only has to admit int4's rounding (quality.json has it).
    loose = "[export.quality]\nmin_top1_agreement = 0.0\nmax_mean_kl = 10.0\nmax_perplexity_increase_pct = 100.0\n"
    bundle = _build(
        root, "gpt-oss-int4", f"hf:{hf}", f'precision = "int4"\n{loose}', tiny_model_cache(tmp_path_factory)
    )
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    data = np.memmap(bundle / "model.onnx.data", dtype=np.uint8, mode="r")  # onnx refuses a hard-linked file

    def array(name: str) -> np.ndarray:
        (tensor,) = [t for t in model.graph.initializer if t.name == name]
        info = {e.key: e.value for e in tensor.external_data}
        start, length = int(info.get("offset", 0)), int(info["length"])
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        return np.array(data[start : start + length]).view(dtype).reshape(tuple(tensor.dims))

    source = {n: t.float().numpy() for n, t in load_file(str(next(hf.glob("*.safetensors")))).items()}
    for layer in (0, 1):
        pairs = [n for n in model.graph.node if n.op_type == "QMoE" and f"layers.{layer}/" in n.name]
        assert len(pairs) == 2 and qmoe_layout(pairs[0]) == (4, 32)
        for (w, s), name in (((2, 3), "gate_up_proj"), ((5, 6), "down_proj")):
            scales = array(pairs[0].input[s])
            experts = QuantizedExperts(4, 32, unpack(array(pairs[0].input[w]), 4), scales)
            expected = np.swapaxes(source[f"model.layers.{layer}.mlp.experts.{name}"], -1, -2)  # [E, rows, K]
            error = experts.dequantize() - expected
            # MLAS's symmetric grid puts a block's extreme on -8: the other sign's extreme may round a step short
            assert np.all(np.abs(error) <= np.repeat(np.abs(scales), 32, axis=-1) * (1 + 1e-5)), name
            assert np.linalg.norm(error) < 0.15 * np.linalg.norm(expected), name


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"layer_types": ["mamba", "attention"]}, "1 Mamba-2 layers"),
        ({"num_local_experts": 64, "num_experts_per_tok": 6}, "routes each token to experts"),
    ],
    ids=["granite-4-h-mamba", "granite-routed-experts"],
)
def test_granite_4_h_is_refused_before_the_build(changes: dict[str, object], refusal: str) -> None:
    from packager.errors import UserError
    from packager.export.architectures import architecture_of
    from tests.architectures.cases_moe import GRANITE_4_MICRO

    assert architecture_of(GRANITE_4_MICRO.config(), "config.json").model_type == "granitemoehybrid"
    with pytest.raises(UserError, match=refusal):
        architecture_of({**GRANITE_4_MICRO.config(), **changes}, "config.json")


@pytest.mark.parametrize(
    ("hf_class", "why"),
    [
        ("PhiMoEForCausalLM", "CUDA only"),
        ("PhimoeForCausalLM", "CUDA only"),
        ("Lfm2MoeForCausalLM", "convolution state"),
        ("Qwen3_5MoeForConditionalGeneration", "CUDA"),
    ],
)
def test_the_moe_models_onnxfn_cannot_serve_are_refused_with_the_reason(hf_class: str, why: str) -> None:
    from packager.errors import UserError
    from packager.export.architectures import architecture_of

    with pytest.raises(UserError, match=f"refuses: .*{why}.*the nearest supported architecture is .*GptOssForCausalLM"):
        architecture_of({"architectures": [hf_class]}, "config.json")
