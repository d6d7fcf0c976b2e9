"""Which prefill chunks of one step share a session run (runtime/engine/runner.py `prefill_runs`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from runtime.engine.runner import prefill_runs
from runtime.engine.scheduler import PrefillChunk


def chunk(slot: int, start: int, stop: int) -> PrefillChunk:
    """A chunk as the runner reads it: its leader's slot and the positions it computes."""
    group = SimpleNamespace(sequences=[SimpleNamespace(slot=slot)])
    return cast(PrefillChunk, SimpleNamespace(group=group, start=start, stop=stop))


def shapes(runs: list[list[PrefillChunk]]) -> list[list[tuple[int, int, int]]]:
    return [[(c.group.sequences[0].slot, c.start, c.stop) for c in run] for run in runs]


def test_first_chunks_in_consecutive_slots_share_a_run() -> None:
    chunks = [chunk(2, 0, 30), chunk(3, 0, 32), chunk(4, 0, 28)]
    assert shapes(prefill_runs(chunks, together=True)) == [[(2, 0, 30), (3, 0, 32), (4, 0, 28)]]


def test_without_a_row_gathering_prefill_graph_every_chunk_runs_alone() -> None:
    chunks = [chunk(0, 0, 30), chunk(1, 0, 30)]
    assert shapes(prefill_runs(chunks, together=False)) == [[(0, 0, 30)], [(1, 0, 30)]]


def test_chunks_with_past_context_run_alone() -> None:
    # ONNX Runtime's attention takes several new tokens per row only without past context.
    chunks = [chunk(0, 32, 64), chunk(1, 0, 32), chunk(2, 0, 32), chunk(3, 16, 48)]
    assert shapes(prefill_runs(chunks, together=True)) == [[(0, 32, 64)], [(1, 0, 32), (2, 0, 32)], [(3, 16, 48)]]


def test_a_gap_between_slots_starts_a_new_run() -> None:
    # A request with n = 2 holds slots 0 and 1; its prompt is prefilled in slot 0 only.
    chunks = [chunk(0, 0, 20), chunk(2, 0, 20), chunk(3, 0, 20)]
    assert shapes(prefill_runs(chunks, together=True)) == [[(0, 0, 20)], [(2, 0, 20), (3, 0, 20)]]


def test_padding_beyond_a_quarter_of_the_prompt_tokens_starts_a_new_run() -> None:
    # 32 + 8 padded to 2 x 32 would compute 64 positions for 40 tokens.
    chunks = [chunk(0, 0, 32), chunk(1, 0, 8), chunk(2, 0, 10)]
    assert shapes(prefill_runs(chunks, together=True)) == [[(0, 0, 32)], [(1, 0, 8), (2, 0, 10)]]
