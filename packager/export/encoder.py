"""Encoder (BERT-family) export: `torch.onnx.export` then ONNX Runtime's transformer fusions.

Chosen by measurement on all-MiniLM-L6-v2 (see the issue note): the legacy TorchScript exporter with eager
attention, then `onnxruntime.transformers.optimizer.optimize_model(model_type="bert")`, gives
EmbedLayerNormalization 1, Attention 6, SkipLayerNormalization 12, BiasGelu 6 (516 → 46 nodes) with
token embeddings equal to PyTorch's, in the packager's one environment (transformers 5). optimum-onnx's
O2 export gives no EmbedLayerNormalization (54 nodes) and needs transformers < 4.58. SDPA attention or
the dynamo exporter defeat the attention fusion, hence eager and `dynamo=False`.

A sequence classifier (`task = "classification"`) goes the same way with its head: the graph outputs the
logits (the pooler and classifier layers stay plain MatMul/Tanh nodes after the fused encoder).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import onnx

from packager.cache import cached_dir, digest_of
from packager.errors import UserError

ENCODER_EXPORT_VERSION = 1  # bump when the export below changes, to invalidate cached graphs
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT_NAME = "token_embeddings"
LOGITS_NAME = "logits"  # a classifier's output `[batch, labels]`
CLASSIFICATION = "classification"
MODEL_FILE = "model.onnx"
EXPORT_RECORD = "export.json"
# Every fusion must have happened: a graph without them is a failed optimisation, not a slower model.
REQUIRED_FUSIONS = ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization")
GELU_FUSIONS = ("BiasGelu", "FastGelu", "Gelu")


@dataclass(frozen=True)
class EncoderExport:
    directory: Path  # model.onnx and export.json
    precision: str
    key: str
    reused: bool

    @property
    def model_path(self) -> Path:
        return self.directory / MODEL_FILE

    def record(self) -> dict[str, object]:
        return json.loads((self.directory / EXPORT_RECORD).read_text())


def export_encoder(hf_dir: Path, content_key: str, task: str = "embedding") -> EncoderExport:
    """The fused fp32 graph of the encoder in `hf_dir` (token embeddings, or a classifier's logits), from the
    cache when its inputs are unchanged."""
    versions = [metadata.version(p) for p in ("torch", "transformers", "onnxruntime", "onnx")]
    # Embedding keys predate classifiers: only a classifier's key names its task, so cached embeddings stay valid.
    head = [task] if task == CLASSIFICATION else []
    key = digest_of("encoder-export", ENCODER_EXPORT_VERSION, content_key, versions, *head)
    directory, reused = cached_dir("export", key, lambda out: _export(hf_dir, out, task == CLASSIFICATION))
    return EncoderExport(directory, "fp32", key, reused)


def graph_ops(model_path: Path) -> Counter[str]:
    return Counter(node.op_type for node in onnx.load(str(model_path), load_external_data=False).graph.node)


def check_fused(model_path: Path) -> Counter[str]:
    """The graph's op counts; refuses a graph in which a required fusion is missing.

    Dynamic int8 quantization turns the fused ops into their quantized forms (QAttention, …), which count.
    """
    ops = graph_ops(model_path)
    missing = [op for op in REQUIRED_FUSIONS if not (ops[op] or ops["Q" + op])]
    if not any(ops[op] for op in GELU_FUSIONS):
        missing.append("/".join(GELU_FUSIONS))
    if missing:
        raise UserError(
            f"{model_path} lacks the fused {', '.join(missing)} ops (found: {dict(ops.most_common(8))}); "
            "ONNX Runtime's BERT optimizer did not recognise this architecture"
        )
    return ops


def _export(hf_dir: Path, out: Path, classifier: bool) -> None:
    import torch
    from onnxruntime.transformers import optimizer
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    os.environ.setdefault("TQDM_DISABLE", "1")
    config = AutoConfig.from_pretrained(hf_dir)
    loader = AutoModelForSequenceClassification if classifier else AutoModel
    model = loader.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    output_name = LOGITS_NAME if classifier else OUTPUT_NAME
    # Two rows, the second padded: transformers 5 drops an all-ones mask before tracing reaches it, and a
    # graph traced that way ignores padding.
    input_ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])

    class TokenEmbeddings(torch.nn.Module):
        """Keyword inputs for the exporter: transformers 5 reordered `forward`'s positional parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.encoder = model

        def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
            output = self.encoder(input_ids=input_ids, attention_mask=mask, token_type_ids=token_type_ids)
            return output.logits if classifier else output.last_hidden_state

    dynamic = {name: {0: "batch", 1: "tokens"} for name in INPUT_NAMES}
    dynamic[output_name] = {0: "batch"} if classifier else {0: "batch", 1: "tokens"}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        _ignore_harmless_export_warnings()
        raw = Path(tmp) / "unfused.onnx"
        torch.onnx.export(
            TokenEmbeddings(),
            (input_ids, attention_mask, torch.zeros_like(input_ids)),
            str(raw),
            input_names=list(INPUT_NAMES),
            output_names=[output_name],
            dynamic_axes=dynamic,
            opset_version=17,
            dynamo=False,
        )
        unfused = graph_ops(raw)
        optimized = optimizer.optimize_model(
            str(raw), model_type="bert", num_heads=config.num_attention_heads, hidden_size=config.hidden_size
        )
        optimized.save_model_to_file(str(out / MODEL_FILE))
    fused = check_fused(out / MODEL_FILE)
    record = {
        "exporter": "torch.onnx.export(dynamo=False) + onnxruntime.transformers.optimizer (bert)",
        "unfused_nodes": sum(unfused.values()),
        "fused_nodes": sum(fused.values()),
        "ops": dict(fused),
    }
    (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _ignore_harmless_export_warnings() -> None:
    """Silence the two warnings tracing a transformers encoder prints that do not apply here, and only those.

    - aten::index with two index tensors ("If indices include negative values, the exported graph will produce
      incorrect results"): transformers' padding mask is read as `padding_mask[batch_idx, kv_idx]` with
      `arange`s, never negative. A mask read wrong would show in every build: parity against PyTorch, and
      fp32's batch check (each sentence alone and in a padded batch, `min_batch_cosine`).
    - TracerWarning "Converting a tensor to a Python boolean" in `transformers.masking_utils`: whether the
      mask needs padding to the key length, which for an encoder (no cache) is always the input length:
      the traced constant (no padding) holds for every input.
    Any other warning, from these modules too, still prints.
    """
    warnings.filterwarnings(
        "ignore", message=r"Exporting aten::index operator of advanced indexing", module=r"torch\.onnx\."
    )
    warnings.filterwarnings(
        "ignore", message=r"Converting a tensor to a Python boolean", module=r"transformers\.masking_utils"
    )
