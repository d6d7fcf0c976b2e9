"""`DecoderSession` keeps inputs bound between runs; a run must still see exactly its own inputs."""

from __future__ import annotations

import numpy as np

from runtime.bundle import Bundle
from runtime.engine.kv_cache import KVPool
from runtime.engine.session import DecoderSession, SessionOptions, create_session
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids


def test_a_decode_after_other_shapes_sees_its_own_mask_and_gives_the_same_logits(
    bundle: Bundle, tokenizer: Tokenizer
) -> None:
    facts = bundle.manifest.model
    pool = KVPool(facts, slots=2, max_context=64)
    decoder = DecoderSession(
        create_session(bundle.model_path, SessionOptions()), facts.io, facts.num_layers, pool.tensors,
        facts.vocab_size, max_rows=2, max_chunk=64,
    )  # fmt: skip
    prompt = chat_ids(tokenizer, "Name a large river.")
    n = len(prompt)
    # The reference: slot 0's first run is this decode, so every input is bound afresh. The prompt's
    # KV is computed in slot 1 (another binding) and copied over.
    token = int(decoder.prefill(1, prompt, 0)[-1].argmax())
    pool.copy(1, 0, n)
    one_row = np.array([token]), np.array([n + 1])
    fresh = decoder.decode(1, *one_row).copy()
    # Slot 0's binding now serves a prompt of another width, and two rows are decoded with row 0 the
    # short one (its staged mask row is [1, 0, 0, ...]); row 0 overwrites position 0, so the prompt is
    # prefilled again before the same decode.
    decoder.prefill(0, prompt, 0)
    decoder.decode(2, np.array([token, token]), np.array([1, n + 1]))
    decoder.prefill(0, prompt, 0)
    assert np.array_equal(decoder.decode(1, *one_row), fresh)
