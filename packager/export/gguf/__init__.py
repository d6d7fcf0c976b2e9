"""Precision `gguf`: the graph computing with the source GGUF's own quantized blocks (carry.py), read exactly
(blocks.py) into ONNX Runtime's block-quantized operators (operators.py)."""
