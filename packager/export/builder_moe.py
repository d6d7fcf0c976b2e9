"""Mixture-of-Experts decoders whose every part onnxruntime-genai's builder (0.18) has, but no export of.

Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) is Qwen3's attention (q/k norms) with a routed MoE block: a router
`[experts, hidden]`, softmax over all experts, the top k renormalised when `norm_topk_prob`, and SiLU-gated
experts stacked as transformers 5 holds them (`gate_up_proj` `[E, 2I, H]`, gate rows then up rows; `down_proj`
`[E, H, I]`). The builder exports Qwen3 (`Qwen3Model`) and the same routed block inside Qwen3.5-MoE
(`Qwen35MoETextModel`: ONNX Runtime's `MoE` with fused SwiGLU, alpha 1 and beta 0 being SiLU(gate) * up); its
dispatch (`builder.create_model`, keyed by `architectures[0]`) only lacks the pairing. `install` adds it: for a
Qwen3-MoE config the Qwen3 dispatch entry builds the routed class instead (in the export's own process, which
exports that one model). Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) is the same on Qwen2's attention (q/k/v
biases), its routing weights not renormalised, plus a shared expert behind a sigmoid gate (Qwen3.5-MoE's, in the
builder too).

ONNX Runtime's CPU `MoE` runs fused SwiGLU only with gate and up rows interleaved (`swiglu_fusion = 1`; measured:
`2` is refused on the CPU), so fc1 is `gate_up_proj` with its rows reordered by one `index_select`, which a GGUF
carry reads as a permutation of the file's rows (gguf/experts.py).

Layers the config keeps dense (`mlp_only_layers`, `decoder_sparse_step`) are the builder's ordinary MLP.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

QWEN3_MOE = "Qwen3MoeForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
# architectures[0] -> (the dispatch entry it rides on, the builder class that entry builds, in builders.qwen)
_RIDES_ON = {QWEN3_MOE: ("Qwen3ForCausalLM", "Qwen3Model"), QWEN2_MOE: ("Qwen2ForCausalLM", "QwenModel")}


def install(builder: Any, config: Any) -> None:
    """Route `config` (the builder's hf_config) to an exporter of ours when the builder has none for it."""
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture not in _RIDES_ON:
        return
    host, base_name = _RIDES_ON[architecture]
    qwen = sys.modules["builders.qwen"]
    exporter = _routed_class(getattr(qwen, base_name), architecture)
    if architecture == QWEN2_MOE:
        exporter = _with_shared_expert(exporter, qwen.Qwen35MoETextModel)
    setattr(builder, base_name, exporter)
    config.architectures = [host]  # restored by the class, which then names itself after the real one


def _routed_class(base: type, architecture: str) -> type:
    """`base` (a dense Qwen exporter) with the routed MoE block in place of its MLP."""

    class RoutedMoeModel(base):  # type: ignore[valid-type, misc]
        def __init__(self, config: Any, *args: Any) -> None:
            config.architectures = [architecture]
            super().__init__(config, *args)
            self.moe_attrs["activation_type"] = "swiglu"
            self.moe_attrs["swiglu_fusion"] = 1
            # Always renormalised in the operator; a model that does not renormalise scales the output by the top
            # k's share of the softmax instead (`_scaled_by_routed_share`): ONNX Runtime 1.31's CPU MoE with
            # normalize_routing_weights = 0 depends on what its output buffer held before (measured: a Qwen2-MoE
            # graph off by 1.8 in the logits, right once each MoE output is a graph output of its own).
            self.moe_attrs["normalize_routing_weights"] = True
            self.renormalised = bool(config.norm_topk_prob)
            self.moe_intermediate_size = config.moe_intermediate_size

        def get_moe_module(self, layer_id: int, layer: Any) -> Any:
            return layer.mlp

        def make_moe(self, layer_id: int, moe: Any, root_input: str) -> None:
            if not hasattr(moe, "experts"):  # a layer the config keeps dense
                self.make_mlp(layer_id, moe, root_input)
                return
            super().make_moe(layer_id, moe, root_input)

        def make_moe_preprocessing(self, layer_id: int, moe: Any, root_input: str) -> None:
            gate_up = moe.experts.gate_up_proj
            inter = gate_up.shape[1] // 2
            interleaved = torch.arange(2 * inter).reshape(2, inter).T.reshape(-1)  # gate 0, up 0, gate 1, ...
            self.make_moe_expert_initializers(
                layer_id, moe.experts, gate_up.index_select(1, interleaved), moe.experts.down_proj
            )
            names = self.make_moe_expert_names(layer_id)
            experts = self.moe_attrs["num_experts"]
            self.make_initializer(torch.zeros(experts, 2 * inter), names["gate_up_bias"], to=self.io_dtype)
            self.make_initializer(torch.zeros(experts, self.hidden_size), names["down_bias"], to=self.io_dtype)

        def make_moe_router(self, layer_id: int, moe: Any, root_input: str) -> None:
            basename = f"/model/layers.{layer_id}/moe/router"
            matmul = self.make_matmul(moe.gate, f"{basename}/MatMul", root_input)
            self.make_reshape(
                f"{basename}/Reshape",
                [f"{matmul}/output_0", f"/model/constants/INT64/{[-1, self.moe_attrs['num_experts']]}"],
                dtype=self.io_dtype,
                shape=self.make_moe_router_shape(),
            )

        def make_moe_subgraph(self, layer_id: int, moe: Any, root_input: str) -> None:
            name = f"/model/layers.{layer_id}/moe/{self.moe_attrs['op_type']}"
            names = self.make_moe_expert_names(layer_id)
            self.make_moe_op(
                name,
                root_input=root_input,
                router_probs=f"/model/layers.{layer_id}/moe/router/Reshape/output_0",
                weight1=names["gate_up_weight"],
                bias1=names["gate_up_bias"],
                weight2=names["down_weight"],
                bias2=names["down_bias"],
            )
            output = f"{name}/output_0"
            self.layernorm_attrs["skip_input"] = (
                output if self.renormalised else self._scaled_by_routed_share(layer_id, output)
            )

        def _scaled_by_routed_share(self, layer_id: int, output: str) -> str:
            """`output` (the top k mixed with renormalised weights) times the top k's share of the softmax over
            every expert: the mix with the softmax's own weights, as a model that does not renormalise computes."""
            base = f"/model/layers.{layer_id}/moe/router"
            k = self.moe_attrs["top_k"]
            rows = ["batch_size", "sequence_length"]
            self.make_softmax(
                f"{base}/Softmax", f"{base}/MatMul/output_0", self.io_dtype, [*rows, self.moe_attrs["num_experts"]]
            )
            self.make_topk(
                f"{base}/TopK", [f"{base}/Softmax/output_0", f"/model/constants/INT64/{[k]}"], self.io_dtype, [*rows, k]
            )
            self.make_reduce_sum(
                f"{base}/Share",
                [f"{base}/TopK/output_0", "/model/constants/INT64/[-1]"],
                self.io_dtype,
                [*rows, 1],
                keepdims=True,
            )
            self.make_mul(
                f"{base}/Scaled", [output, f"{base}/Share/output_0"], self.io_dtype, self.make_hidden_state_shape()
            )
            return f"{base}/Scaled/output_0"

    return RoutedMoeModel


def _with_shared_expert(routed: type, qwen35_moe: Any) -> type:
    """Qwen2-MoE's block: the routed experts plus a shared expert (a SwiGLU MLP of `shared_expert_intermediate_size`)
    scaled by `sigmoid(shared_expert_gate(x))`: Qwen3.5-MoE's shared expert in the builder, added by `GatedAdd`."""

    class SharedExpertMoeModel(routed):  # type: ignore[valid-type, misc]
        def __init__(self, config: Any, *args: Any) -> None:
            super().__init__(config, *args)
            self.shared_expert_intermediate_size = config.shared_expert_intermediate_size

        def make_moe_subgraph(self, layer_id: int, moe: Any, root_input: str) -> None:
            super().make_moe_subgraph(layer_id, moe, root_input)
            routed_output = self.layernorm_attrs["skip_input"]
            shared, gate = qwen35_moe.make_shared_expert(
                self, layer_id, moe.shared_expert, moe.shared_expert_gate, root_input
            )
            name = f"/model/layers.{layer_id}/moe/GatedAdd"
            self.make_gated_add(name, routed_output, shared, gate, shape=self.make_hidden_state_shape())
            self.layernorm_attrs["skip_input"] = f"{name}/output_0"

    return SharedExpertMoeModel
