"""Text → the encoder's token ids, with no padding and no truncation of the tokenizer file's own.

A shipped `tokenizer.json` may pad and truncate to a fixed length (all-MiniLM-L6-v2's: 128, below the
model's 256); both are switched off here. Padding is the batcher's business (each forward pads only to its
longest row), and an input over the model's limit is the caller's decision: refuse it or cut it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer


class EncoderTokenizer:
    def __init__(self, path: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(path))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        # The special tokens the post-processor puts around one sequence ([CLS] … [SEP] for BERT), read off
        # a one-word encoding, so token-id inputs get the same frame as text.
        probe = self._tokenizer.encode("a")
        special = probe.special_tokens_mask
        first = special.index(0)
        last = len(special) - special[::-1].index(0)
        self.prefix: tuple[int, ...] = tuple(probe.ids[:first])
        self.suffix: tuple[int, ...] = tuple(probe.ids[last:])
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, special tokens included."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def frame(self, token_ids: Sequence[int]) -> list[int]:
        """Plain token ids (no special tokens) framed as `encode` frames a text's."""
        return [*self.prefix, *token_ids, *self.suffix]

    def truncate(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Keep the first tokens and the closing special tokens, `max_tokens` in all (as the tokenizer would)."""
        if len(token_ids) <= max_tokens:
            return token_ids
        keep = max_tokens - len(self.suffix)
        return token_ids[:keep] + list(self.suffix)
