"""Completions: raw prompts (text or token ids, one or several) in, legacy completion objects out.

With several prompts, choice `i * n + j` is sequence `j` of prompt `i`, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from runtime.api.errors import unknown_adapter
from runtime.api.formatting import ResponseMeta, check_prompt_length, finite_logprob
from runtime.api.generation import Generation
from runtime.api.protocol import CompletionRequest, check_adapter
from runtime.api.service import ModelService
from runtime.engine.request import GenerationRequest, TokenLogprob, UnknownAdapterError


def submit_completion(state: ModelService, parsed: CompletionRequest) -> tuple[Generation, ResponseMeta, list[str]]:
    """Tokenize and queue every prompt; also returns each prompt's echo (empty unless `echo`).

    Shared by HTTP and the queue frontends.
    """
    engine = state.require_engine()
    check_adapter(engine.adapters, state.policy, parsed.adapter)
    token_prompts = [engine.tokenizer.encode_prompt(p) if isinstance(p, str) else list(p) for p in parsed.prompts]
    for ids in token_prompts:
        check_prompt_length(len(ids), state.policy.max_prompt_tokens, engine.max_context, "prompt")
    echoes = [
        (p if isinstance(p, str) else engine.tokenizer.decode(p, skip_special_tokens=False)) if parsed.echo else ""
        for p in parsed.prompts
    ]
    meta = ResponseMeta.new("cmpl", parsed.model, state.settings.fingerprint)
    requests = [
        GenerationRequest(f"{meta.id}-{i}", tuple(ids), parsed.sampling, adapter=parsed.adapter)
        for i, ids in enumerate(token_prompts)
    ]
    try:
        generation = Generation(engine, requests, state.metrics.timer(), prompt_param="prompt")
    except UnknownAdapterError as exc:  # removed since `check_adapter` (earlier prompts run to their end unread)
        raise unknown_adapter(state.policy.model_name, parsed.adapter or "", exc.available) from exc
    return generation, meta, echoes


def _empty_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class _ChoiceLogprobs:
    """OpenAI's legacy logprobs object, built up token by token; `text_offset` counts characters of the choice."""

    def __init__(self, start_offset: int) -> None:
        self.offset = start_offset

    def take(self, entries: tuple[TokenLogprob, ...]) -> dict[str, list[Any]]:
        part = _empty_logprobs()
        for entry in entries:
            part["tokens"].append(entry.text)
            part["token_logprobs"].append(finite_logprob(entry.logprob))
            part["top_logprobs"].append({text: finite_logprob(lp) for _, text, lp in entry.top})
            part["text_offset"].append(self.offset)
            self.offset += len(entry.text)
        return part


async def completion_chunks(
    generation: Generation, meta: ResponseMeta, parsed: CompletionRequest, echoes: list[str]
) -> AsyncGenerator[dict[str, Any], None]:
    """The `text_completion` chunks of a streamed reply, ending with the usage chunk when asked for."""
    n = parsed.sampling.n
    logprobs = {i * n + j: _ChoiceLogprobs(len(echoes[i])) for i in range(len(echoes)) for j in range(n)}

    def chunk(index: int, text: str, part: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": part, "finish_reason": finish}
        body = meta.envelope("text_completion", [choice])
        if parsed.include_usage:
            body["usage"] = None
        return body

    if parsed.echo:
        for index in logprobs:
            yield chunk(index, echoes[index // n], None, None)
    async for prompt_index, output in generation.outputs():
        index = prompt_index * n + output.index
        part = logprobs[index].take(output.logprobs) if parsed.sampling.logprobs else None
        finish = output.finish_reason.value if output.finish_reason is not None else None
        if output.text or output.logprobs or finish:
            yield chunk(index, output.text, part, finish)
    if parsed.include_usage:
        yield {**meta.envelope("text_completion", []), "usage": generation.usage}


async def collect_completion(
    generation: Generation, meta: ResponseMeta, parsed: CompletionRequest, echoes: list[str]
) -> dict[str, Any]:
    """The whole `text_completion` object once every sequence of every prompt has finished."""
    n = parsed.sampling.n
    count = len(echoes) * n
    texts: list[list[str]] = [[echoes[i // n]] for i in range(count)]
    logprobs = [_ChoiceLogprobs(len(echoes[i // n])) for i in range(count)]
    parts = [_empty_logprobs() for _ in range(count)]
    finish: list[str | None] = [None] * count
    try:
        async for prompt_index, output in generation.outputs():
            index = prompt_index * n + output.index
            texts[index].append(output.text)
            for key, values in logprobs[index].take(output.logprobs).items():
                parts[index][key].extend(values)
            if output.finish_reason is not None:
                finish[index] = output.finish_reason.value
    finally:
        generation.cancel()
    choices = [
        {
            "index": i,
            "text": "".join(texts[i]),
            "logprobs": parts[i] if parsed.sampling.logprobs else None,
            "finish_reason": finish[i],
        }
        for i in range(count)
    ]
    return {**meta.envelope("text_completion", choices), "usage": generation.usage}
