"""The dense architectures' refusals, and the pieces their builds rely on, checked without a build.

- Every text decoder of the builder's dispatch that onnxfn refuses says why and names a supported one; a supported
  architecture with a config key the builder ignores (OLMo's `clip_qkv`, Phi's `qk_layernorm`) is refused too.
- The position ids computed in the graph (export/positions.py, for graphs that rotate outside attention) are the
  positions GroupQueryAttention derives from the mask, for each way the engine runs the graph.
- The K-quant blocks the GGUF fixture writes dequantize (by the `gguf` package) to the weights within their step.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from packager.errors import UserError
from packager.export.architectures import REFUSED, SUPPORTED_DECODERS, architecture_of
from tests.architectures.cases_dense import DENSE_CASES
from tests.fixtures.kquants import quantize_q4_k, quantize_q6_k

# Text decoders in onnxruntime-genai 0.18's create_model dispatch that onnxfn refuses (MoE ones: cases_moe.py).
REFUSED_DENSE = (
    "ChatGLMModel", "ChatGLMForConditionalGeneration", "InternLM2ForCausalLM", "Phi3SmallForCausalLM",
    "VideoChatFlashQwenForCausalLM", "Lfm2ForCausalLM", "Lfm2VlForConditionalGeneration",
    "Lfm2AudioForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Phi3VForCausalLM", "Phi4MMForCausalLM", "Mistral3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
)  # fmt: skip


@pytest.mark.parametrize("hf_class", REFUSED_DENSE)
def test_a_refused_decoder_says_why_and_names_the_nearest_supported_one(hf_class: str) -> None:
    with pytest.raises(UserError) as refused:
        architecture_of({"architectures": [hf_class]}, "config.json")
    message = str(refused.value)
    nearest = message.rsplit("the nearest supported architecture is ", 1)[1]
    assert "which onnxfn refuses: " in message and nearest in SUPPORTED_DECODERS, message
    assert refused.value.exit_code == 2


def test_every_dense_case_is_a_supported_architecture() -> None:
    for case in DENSE_CASES:
        entry = architecture_of(case.config(), case.name)
        assert entry.status != REFUSED and entry.model_type == case.model_type


@pytest.mark.parametrize(("case_name", "key", "value"), [("olmo", "clip_qkv", 8.0), ("phi-2", "qk_layernorm", True)])
def test_a_config_key_the_builder_ignores_is_refused(case_name: str, key: str, value: object) -> None:
    case = next(c for c in DENSE_CASES if c.name == case_name)
    with pytest.raises(UserError, match=rf"sets {key} = {value!r} .*which onnxruntime-genai's builder ignores"):
        architecture_of({**case.config(), key: value}, "config.json")


def _positions_graph() -> bytes:
    """input_ids, attention_mask, position_ids -> the position ids, after derive_position_ids."""
    import onnx_ir as ir

    from packager.export.positions import derive_position_ids

    ids = ir.val("input_ids", ir.DataType.INT64, ["batch", "new"])
    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch", "total"])
    positions = ir.val("position_ids", ir.DataType.INT64, ["batch", "new"])
    out = ir.node("Identity", [positions], name="out").outputs[0]
    out.name, out.dtype = "out", ir.DataType.INT64
    graph = ir.Graph([ids, mask, positions], [out], nodes=[out.producer()], opset_imports={"": 21}, name="g")
    assert derive_position_ids(graph)
    graph.sort()
    assert [v.name for v in graph.inputs] == ["input_ids", "attention_mask"]
    return ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()  # type: ignore[no-any-return]


def test_positions_computed_in_the_graph_are_group_query_attentions() -> None:
    session = ort.InferenceSession(_positions_graph(), providers=["CPUExecutionProvider"])

    def positions(new: int, mask: list[list[int]]) -> list[list[int]]:
        feeds = {"input_ids": np.zeros((len(mask), new), np.int64), "attention_mask": np.asarray(mask, np.int64)}
        return session.run(["out"], feeds)[0].tolist()  # type: ignore[no-any-return]

    # Right-padded first prompts prefilled together: 0..S-1 in every row (a padded row's tail is never read).
    assert positions(4, [[1, 1, 1, 1], [1, 1, 0, 0]]) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    # A chunk of 3 after a past of 5 (chunked prefill, a prefix-cache hit): 5, 6, 7.
    assert positions(3, [[1] * 8]) == [[5, 6, 7]]
    # A ragged decode step over a mask as wide as the KV buffer: each row at its own length.
    assert positions(1, [[1] * 6 + [0] * 4, [1] * 9 + [0], [1] + [0] * 9]) == [[5], [8], [0]]
    # An empty row (all padding) gets position 0, not -1 (a table row that does not exist).
    assert positions(1, [[0] * 4]) == [[0]]


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K], ids=lambda t: t.name)
def test_the_fixtures_k_quants_dequantize_to_the_weights(qtype: GGMLQuantizationType) -> None:
    weights = np.random.default_rng(0).normal(0.0, 0.15, (16, 512)).astype(np.float32)
    weights[3] = 0.0  # an all-zero block stays zero
    raw = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q6_K: quantize_q6_k}[qtype](weights)
    back = dequantize(raw, qtype).reshape(weights.shape)
    levels = 16 if qtype == GGMLQuantizationType.Q4_K else 64
    step = (weights.max() - weights.min()) / (levels - 1)
    assert np.abs(back - weights).max() < step and not back[3].any()
