"""Turn each sampled token of a sequence into a `SequenceOutput`: text delta, logprobs, finish reason."""

from __future__ import annotations

from collections.abc import Iterable

from runtime.engine.request import FinishReason, SamplingParams, SequenceOutput, TokenLogprob
from runtime.engine.sampling import TokenChoice
from runtime.engine.tokenizer import IncrementalDetokenizer, StopStringFilter, Tokenizer


class OutputProcessor:
    """Per-sequence detokenization and stop conditions.

    A stop token (EOS unless `ignore_eos`, or one of `stop_token_ids`) is reported in `token_ids`
    and counted in `completion_tokens` but adds no text; a stop string is never part of the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        request_id: str,
        index: int,
        prompt_tokens: int,
        max_context: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop_strings = StopStringFilter(params.stop)
        self._request_id = request_id
        self._index = index
        self._prompt_tokens = prompt_tokens
        self._max_completion = min(params.max_tokens, max_context - prompt_tokens)
        self.completion_tokens = 0

    @property
    def remaining_tokens(self) -> int:
        """Tokens this sequence may still produce before its length limit."""
        return self._max_completion - self.completion_tokens

    def process(self, choice: TokenChoice) -> SequenceOutput:
        token = choice.token_id
        self.completion_tokens += 1
        finish: FinishReason | None = None
        if token in self._stop_ids:
            finish = FinishReason.STOP
            text = self._drain()
        else:
            text = self._stop_strings.push(self._detokenizer.push(token))
            if self._stop_strings.stopped:
                finish = FinishReason.STOP
            elif self.completion_tokens >= self._max_completion:
                finish = FinishReason.LENGTH
                text += self._drain()
        return SequenceOutput(
            request_id=self._request_id,
            index=self._index,
            token_ids=(token,),
            text=text,
            logprobs=(self._logprob(choice),) if choice.logprob is not None else (),
            finish_reason=finish,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self.completion_tokens,
        )

    def aborted(self) -> SequenceOutput:
        return SequenceOutput(
            request_id=self._request_id,
            index=self._index,
            token_ids=(),
            text="",
            finish_reason=FinishReason.ABORT,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self.completion_tokens,
        )

    def _drain(self) -> str:
        """All text still held back, at the end of the sequence."""
        text = self._stop_strings.push(self._detokenizer.flush())
        return text if self._stop_strings.stopped else text + self._stop_strings.flush()

    def _logprob(self, choice: TokenChoice) -> TokenLogprob:
        assert choice.logprob is not None
        text = self._tokenizer.id_to_text
        return TokenLogprob(
            token_id=choice.token_id,
            text=text(choice.token_id),
            logprob=choice.logprob,
            top=tuple((t, text(t), lp) for t, lp in choice.top),
        )
