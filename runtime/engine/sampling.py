"""Choose the next token of every row of a decode batch from its logits.

Order (as in HF and vLLM): repetition penalty (HF multiplicative, over prompt and output),
presence and frequency penalties (OpenAI, over the output), logit_bias, then temperature, top-k,
top-p and min-p. `temperature == 0` is greedy. Penalties, bias, temperature and greedy are applied
to the whole batch with flat index arrays; the filters work per sampled row on the candidates
within `_CANDIDATE_NATS` of the row's best logit (tokens further out carry less probability in
total than float32 can represent next to the best token), so no row ever sorts the vocabulary.

Logprobs are those of the raw model distribution (log-softmax of the unprocessed logits), as
vLLM returns by default; the OpenAI API does not specify which distribution it reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.random  # numpy loads it on first use: ~10 ms of a cold start's first request otherwise

from runtime.engine.constraints import GrammarConstraint, advance, mask_logits
from runtime.engine.request import SamplingParams

if TYPE_CHECKING:
    from numpy.typing import NDArray

_CANDIDATE_NATS = 30.0
_NUCLEUS_HEAD = float(np.exp(-8.0))
_SEED_MASK = 2**64 - 1
_GREEDY_TEMPERATURE = 1e-5
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class SequenceSampler:
    """One sequence's sampling settings, random stream and token history."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        index: int = 0,
        constraint: GrammarConstraint | None = None,
    ) -> None:
        self.params = params
        self.constraint = constraint
        # default_rng takes non-negative entropy; OpenAI allows negative seeds, so use their 64-bit pattern.
        self.rng = np.random.default_rng(None if params.seed is None else (params.seed & _SEED_MASK, index))
        self.output_token_ids: list[int] = []
        # Below this, dividing by the temperature overflows float32: it is greedy in all but name.
        self.greedy = params.temperature < _GREEDY_TEMPERATURE
        self.penalized = (
            params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        self.processed = self.penalized or bool(params.logit_bias)
        # The row's token is its logits' argmax and nothing else is asked of it: the common case, kept lean.
        self.plain_greedy = self.greedy and not (self.processed or params.logprobs or constraint is not None)
        self._prompt = np.unique(np.asarray(prompt_token_ids, dtype=np.int64)) if self.penalized else None
        self._bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        self._bias = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))

    def penalty_indices(
        self, pending: Sequence[int] = ()
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """Tokens seen in prompt or output (unique), and the output's tokens with their counts.

        `pending`: tokens chosen after the output so far but not booked into it yet, counted as output.
        """
        output = np.asarray([*self.output_token_ids, *pending] if pending else self.output_token_ids, dtype=np.int64)
        seen = np.union1d(self._prompt, output) if self._prompt is not None else output
        out_ids, counts = np.unique(output, return_counts=True)
        return seen, out_ids, counts


@dataclass(frozen=True)
class TokenChoice:
    token_id: int
    logprob: float | None = None  # raw model log-probability of token_id
    top: tuple[tuple[int, float], ...] = ()  # (token id, raw logprob), best first


def sample(
    logits: NDArray[np.float32], samplers: Sequence[SequenceSampler], pending: Sequence[Sequence[int]] = ()
) -> list[TokenChoice]:
    """Pick one token per row of `logits` (`[rows, vocab]`, modified in place).

    `pending[row]`: tokens that row's sequence chose earlier in the step, not yet booked into its sampler's
    `output_token_ids` (a verify's accepted drafts); penalties count them as output. Empty: none anywhere.
    """
    if all(s.plain_greedy for s in samplers):
        return [TokenChoice(token) for token in logits.argmax(axis=1).tolist()]
    want_logprobs = [i for i, s in enumerate(samplers) if s.params.logprobs]
    raw_logprobs = _log_softmax(logits[want_logprobs]) if want_logprobs else None
    constrained = [(row, s.constraint) for row, s in enumerate(samplers) if s.constraint is not None]
    if constrained:
        mask_logits(logits, constrained)
    if any(s.processed for s in samplers):
        _apply_penalties_and_bias(logits, samplers, pending)
    chosen = _greedy_or_sampled(logits, samplers)
    if constrained:
        advance(constrained, chosen)
    if raw_logprobs is None:
        return [TokenChoice(int(t)) for t in chosen]
    choices = [TokenChoice(int(t)) for t in chosen]
    for raw, row in zip(raw_logprobs, want_logprobs, strict=True):
        token = choices[row].token_id
        choices[row] = TokenChoice(token, float(raw[token]), _top_logprobs(raw, samplers[row].params.top_logprobs))
    return choices


def _log_softmax(rows: NDArray[np.float32]) -> NDArray[np.float32]:
    # numpy types reductions with an axis as Any; the annotations say what they return here.
    shifted: NDArray[np.float32] = rows - rows.max(axis=1, keepdims=True)
    log_total: NDArray[np.float32] = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return shifted - log_total


def _top_logprobs(raw: NDArray[np.float32], count: int) -> tuple[tuple[int, float], ...]:
    if count <= 0:
        return ()
    best = np.argpartition(raw, -count)[-count:]
    best = best[np.argsort(-raw[best], kind="stable")]
    return tuple((int(t), float(raw[t])) for t in best)


def _apply_penalties_and_bias(
    logits: NDArray[np.float32], samplers: Sequence[SequenceSampler], pending: Sequence[Sequence[int]]
) -> None:
    rep_rows, rep_ids, rep_pen = [], [], []
    out_rows, out_ids, out_sub = [], [], []
    bias_rows, bias_ids, bias_vals = [], [], []
    for row, s in enumerate(samplers):
        p = s.params
        if s.penalized:
            seen, ids, counts = s.penalty_indices(pending[row] if pending else ())
            if p.repetition_penalty != 1.0:
                rep_rows.append(np.full(seen.size, row))
                rep_ids.append(seen)
                rep_pen.append(np.full(seen.size, p.repetition_penalty, dtype=np.float32))
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                out_rows.append(np.full(ids.size, row))
                out_ids.append(ids)
                out_sub.append((p.frequency_penalty * counts + p.presence_penalty).astype(np.float32))
        if s._bias_ids.size:
            bias_rows.append(np.full(s._bias_ids.size, row))
            bias_ids.append(s._bias_ids)
            bias_vals.append(s._bias)
    # Indices are unique within each row, so fancy-indexed updates never collide.
    if rep_rows:
        r, t, pen = np.concatenate(rep_rows), np.concatenate(rep_ids), np.concatenate(rep_pen)
        values = logits[r, t]
        logits[r, t] = np.where(values > 0, values / pen, values * pen)
    if out_rows:
        r, t = np.concatenate(out_rows), np.concatenate(out_ids)
        logits[r, t] -= np.concatenate(out_sub)
    if bias_rows:
        r, t = np.concatenate(bias_rows), np.concatenate(bias_ids)
        logits[r, t] += np.concatenate(bias_vals)


def _greedy_or_sampled(logits: NDArray[np.float32], samplers: Sequence[SequenceSampler]) -> NDArray[np.intp]:
    chosen: NDArray[np.intp] = np.argmax(logits, axis=1)  # `[rows]`; numpy types an argmax along an axis as Any
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if not sampled:
        return chosen
    temperatures = np.array([samplers[i].params.temperature for i in sampled], dtype=np.float32)
    # Extreme penalties or bias can push logits to inf (and inf - inf to NaN); one such row must not fail
    # the batch, so NaN counts as impossible and inf as merely very likely.
    scaled = np.nan_to_num(logits[sampled] / temperatures[:, None], nan=-np.inf, posinf=_FLOAT32_MAX)
    best = scaled.max(axis=1)
    for row, values, top in zip(sampled, scaled, best, strict=True):
        chosen[row] = _sample_row(values, float(top), samplers[row])
    return chosen


def _sample_row(scaled: NDArray[np.float32], best: float, sampler: SequenceSampler) -> int:
    """Sample from softmax(scaled) restricted by the row's top-k, top-p and min-p."""
    p = sampler.params
    if not np.isfinite(best):  # every token is impossible: nothing to sample from
        return int(np.argmax(scaled))
    candidates = np.flatnonzero(scaled >= best - _CANDIDATE_NATS)
    weights = np.exp(scaled[candidates] - best)
    if 0 < p.top_k < weights.size:
        top = np.argpartition(-weights, p.top_k - 1)[: p.top_k]
        candidates, weights = candidates[top], weights[top]
    if p.top_p < 1.0:
        candidates, weights = _nucleus(candidates, weights, p.top_p)
    if p.min_p > 0.0:
        # weights are relative to the best token, so min-p is a plain threshold.
        kept = weights >= p.min_p
        candidates, weights = candidates[kept], weights[kept]
    cumulative = np.cumsum(weights, dtype=np.float64)
    pick = int(np.searchsorted(cumulative, sampler.rng.random() * cumulative[-1], side="right"))
    return int(candidates[min(pick, candidates.size - 1)])


def _nucleus(
    candidates: NDArray[np.intp], weights: NDArray[np.float32], top_p: float
) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
    """The smallest set of most likely candidates whose mass reaches `top_p` of the total."""
    target = top_p * weights.sum(dtype=np.float64)
    # Sorting only the likely head is enough whenever the head alone reaches the target.
    head = np.flatnonzero(weights >= _NUCLEUS_HEAD)
    if weights[head].sum(dtype=np.float64) < target:
        head = np.arange(weights.size)
    order = head[np.argsort(-weights[head], kind="stable")]
    cumulative = np.cumsum(weights[order], dtype=np.float64)
    keep = int(np.searchsorted(cumulative, target)) + 1
    order = order[:keep]
    return candidates[order], weights[order]
