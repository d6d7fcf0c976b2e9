"""Mixture-of-Experts decoders whose every part onnxruntime-genai's builder (0.18) has, but no export of.

Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) is Qwen3's attention (q/k norms) with a routed MoE block: a router
`[experts, hidden]`, softmax over all experts, the top k renormalised when `norm_topk_prob`, and SiLU-gated
experts stacked as transformers 5 holds them (`gate_up_proj` `[E, 2I, H]`, gate rows then up rows; `down_proj`
`[E, H, I]`). The builder exports Qwen3 (`Qwen3Model`) and the same routed block inside Qwen3.5-MoE
(`Qwen35MoETextModel`: ONNX Runtime's `MoE` with fused SwiGLU, alpha 1 and beta 0 being SiLU(gate) * up); its
dispatch (`builder.create_model`, keyed by `architectures[0]`) only lacks the pairing. `install` adds it:
the Qwen3 dispatch entry builds `Qwen3MoeModel` for a config whose architecture is Qwen3-MoE.

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
_HOST = "Qwen3ForCausalLM"  # the dispatch entry Qwen3-MoE rides on


def install(builder: Any, config: Any) -> None:
    """Route `config` (the builder's hf_config) to an exporter of ours when the builder has none for it."""
    if (getattr(config, "architectures", None) or [None])[0] != QWEN3_MOE:
        return
    qwen = sys.modules["builders.qwen"]
    builder.Qwen3Model = _qwen3_moe_class(qwen.Qwen3Model)
    config.architectures = [_HOST]  # restored by the class, which then names itself after the real one


def _qwen3_moe_class(qwen3: type) -> type:
    class Qwen3MoeModel(qwen3):  # type: ignore[valid-type, misc]
        def __init__(self, config: Any, *args: Any) -> None:
            config.architectures = [QWEN3_MOE]
            super().__init__(config, *args)
            self.moe_attrs["activation_type"] = "swiglu"
            self.moe_attrs["swiglu_fusion"] = 1
            self.moe_attrs["normalize_routing_weights"] = bool(config.norm_topk_prob)
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
            self.layernorm_attrs["skip_input"] = f"{name}/output_0"

    return Qwen3MoeModel
