"""Decoder architectures `pkg build` exports, keyed by the `architectures[0]` of config.json.

Each one goes through onnxruntime-genai's model builder and yields the graph contract the runtime
serves (input_ids + attention_mask, GroupQueryAttention over a shared KV buffer, keys-then-values
past inputs). An architecture is listed only once a test exports it and checks that contract.
"""

from __future__ import annotations

SUPPORTED_DECODERS: dict[str, str] = {
    "LlamaForCausalLM": "llama",  # Llama 2/3, SmolLM and SmolLM2, TinyLlama
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
