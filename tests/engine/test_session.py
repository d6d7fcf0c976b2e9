"""`DecoderSession` keeps inputs bound between runs; a run must still see exactly its own inputs."""

from __future__ import annotations

import numpy as np

from runtime.bundle import Bundle
from runtime.engine.kv_cache import KVPool
from runtime.engine.session import DecoderSession
from runtime.engine.session_build import SessionOptions, create_session
from runtime.engine.tokenizer import Tokenizer
from tests.engine.conftest import chat_ids


def test_a_decode_after_other_shapes_sees_its_own_mask_and_gives_the_same_logits(
    bundle: Bundle, tokenizer: Tokenizer
) -> None:
    facts = bundle.manifest.model
    pool = KVPool(facts, slots=2, max_context=64)
    decoder = DecoderSession(
        create_session(bundle.model_path, SessionOptions(), bundle), facts.io, facts.num_layers, pool.tensors,
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


def test_a_lone_row_decodes_as_with_a_mask_as_wide_as_its_length(bundle: Bundle, tokenizer: Tokenizer) -> None:
    """A decoding row's mask spans the whole KV buffer, zeros after its length; `verify` of one token binds a
    mask exactly as wide as the row. Both compute the same position, so the logits must match bit for bit,
    whichever way the row's length moves between steps, and after a prompt whose mask has the decode's shape."""
    facts = bundle.manifest.model
    context = 64
    pool = KVPool(facts, slots=1, max_context=context)
    decoder = DecoderSession(
        create_session(bundle.model_path, SessionOptions(), bundle), facts.io, facts.num_layers, pool.tensors,
        facts.vocab_size, max_rows=1, max_chunk=context,
    )  # fmt: skip
    prompt = chat_ids(tokenizer, "Name a large river.")
    n = len(prompt)
    token = int(decoder.prefill(0, prompt, 0)[-1].argmax())
    # One step further each time, then back to a shorter row, then past where it had been.
    for length in (n + 1, n + 2, n + 3, 5, n + 1, n + 4):
        decoded = decoder.decode(1, np.array([token]), np.array([length])).copy()
        exact = decoder.verify([token], length - 1)[0]
        assert np.array_equal(decoded[0], exact), f"row length {length}"
    # A full-width prompt binds a mask of the decode's shape over another buffer (all ones): the decode
    # right after it must bind its own again (both runs see the filler's KV before position n).
    filler = (prompt * (context // n + 1))[:context]
    decoder.prefill(0, filler, 0)
    decoded = decoder.decode(1, np.array([token]), np.array([n + 1])).copy()
    assert np.array_equal(decoded[0], decoder.verify([token], n)[0])
