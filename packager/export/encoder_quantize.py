"""Quantized variants of the fused fp32 encoder graph, each cached by its inputs.

Schemes (figures on all-MiniLM-L6-v2 in the issue note and quality.json):
- `int8`: dynamic int8 (`quantize_dynamic`), per-channel weights: fastest and smallest, least exact.
- `int8-mixed`: the same with the FFN output projections (the MatMuls fed by a Gelu) kept fp32: they
  carry the largest activations, and their rounding error dominates the drift.
- `int8-nbits`: weight-only 8-bit blocks (`MatMulNBits`, block 32, symmetric, accuracy level 4 = int8
  compute; lower levels measured 4x slower): nearly exact, smaller file, no faster than fp32.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import onnx

from packager.cache import cached_dir, digest_of
from packager.export.encoder import EXPORT_RECORD, GELU_FUSIONS, MODEL_FILE, EncoderExport, graph_ops

QUANTIZE_VERSION = 1  # bump when a scheme below changes, to invalidate cached graphs
SCHEMES = ("int8", "int8-mixed", "int8-nbits")
NBITS_BLOCK_SIZE = 32
NBITS_ACCURACY_LEVEL = 4


def quantize_encoder(reference: EncoderExport, precision: str) -> EncoderExport:
    """`reference` (the fused fp32 export) quantized with scheme `precision`; fp32 returns `reference`."""
    if precision == "fp32":
        return reference
    if precision not in SCHEMES:
        raise ValueError(f"unknown encoder precision {precision!r}; expected fp32 or one of {', '.join(SCHEMES)}")
    key = digest_of("encoder-quantize", QUANTIZE_VERSION, reference.key, precision, metadata.version("onnxruntime"))
    directory, reused = cached_dir("export", key, lambda out: _quantize(reference, precision, out))
    return EncoderExport(directory, precision, key, reused)


def ffn_output_matmuls(model: onnx.ModelProto) -> list[str]:
    """MatMul nodes whose input is a Gelu's output: each layer's FFN down-projection."""
    gelu_outputs = {out for node in model.graph.node if node.op_type in GELU_FUSIONS for out in node.output}
    return [node.name for node in model.graph.node if node.op_type == "MatMul" and node.input[0] in gelu_outputs]


def _quantize(reference: EncoderExport, precision: str, out: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target = out / MODEL_FILE
    if precision == "int8-nbits":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            onnx.load(str(reference.model_path)),
            bits=8,
            block_size=NBITS_BLOCK_SIZE,
            is_symmetric=True,
            accuracy_level=NBITS_ACCURACY_LEVEL,
        )
        quantizer.process()
        quantizer.model.save_model_to_file(str(target))
    else:
        excluded = ffn_output_matmuls(onnx.load(str(reference.model_path))) if precision == "int8-mixed" else []
        with tempfile.TemporaryDirectory() as tmp:
            # quantize_dynamic writes helper files beside its output: keep them out of the cache entry.
            staged = Path(tmp) / MODEL_FILE
            quantize_dynamic(
                reference.model_path,
                staged,
                per_channel=True,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=excluded,
                # The fused contrib ops carry no type information the quantizer can infer from.
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
            shutil.copyfile(staged, target)
    record = {**reference.record(), "precision": precision, "ops": dict(graph_ops(target))}
    (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
