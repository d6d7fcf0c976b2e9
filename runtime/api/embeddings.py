"""`POST /v1/embeddings` in OpenAI's shape, over the encoder engine.

Request fields: `model`, `input` (a string, a list of strings, a list of token ids or a list of such
lists), `encoding_format` (`float` or `base64`: little-endian float32 bytes, what the openai client asks
for by default), `dimensions` (accepted only when it equals the model's: this model was not trained for
shorter vectors, so cutting them would silently degrade retrieval), `user` (ignored). Token ids are the
model's vocabulary ids without special tokens; they are framed exactly as text is ([CLS] … [SEP]).

An input longer than the model's limit (special tokens included) is a 400 `context_length_exceeded`
unless the request opts in to truncation with vLLM's extension `truncate_prompt_tokens` (an integer up
to the limit, or -1 for the limit): each input is then cut to that many tokens, keeping its start.

The model check, the reading of `input` and the batched run are shared with `/v1/classify` (classify.py);
`runtime.http.endpoints.task_routes` says which of the encoder and decoder routes a bundle serves.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.api.errors import APIError, from_engine_error, invalid_param
from runtime.api.fields import BodyReader, show
from runtime.api.protocol import unsupported
from runtime.api.service import ModelService
from runtime.engine.request import EngineOverloadedError

if TYPE_CHECKING:  # a chat server never imports the encoder stack
    from runtime.encoder.engine import EncoderEngine

_FIELDS = frozenset(("model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"))
MAX_INPUTS = 2048  # OpenAI's limit per request


async def embedding_body(state: ModelService, body: Any) -> dict[str, Any]:
    """The response object for a decoded request body (HTTP and the queue alike); client mistakes raise APIError."""
    engine = encoder_engine(state)
    reader = BodyReader(body, _FIELDS)
    model = check_model(reader, state)
    encoding = reader.string("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid_param("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {show(encoding)}")
    dims = engine.facts.dimensions
    requested = reader.integer("dimensions", None, lo=1)
    if requested is not None and requested != dims:
        raise unsupported(
            "dimensions",
            f"'dimensions' = {requested} is not supported: {model} makes {dims}-dimensional embeddings and was not "
            "trained for shorter ones; omit 'dimensions' or send the full size",
        )
    rows = input_rows(engine, reader, state)
    vectors = await run_rows(engine, rows)
    tokens = sum(map(len, rows))
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(vector, encoding)} for i, vector in enumerate(vectors)
    ]
    return {"object": "list", "data": data, "model": state.policy.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def encoder_engine(state: ModelService) -> EncoderEngine:
    from runtime.encoder.engine import EncoderEngine

    engine = state.require_engine()
    assert isinstance(engine, EncoderEngine)  # the routes (and the queue's kinds) match the bundle's task
    return engine


def check_model(reader: BodyReader, state: ModelService) -> str:
    model = reader.string("model", required=True)
    assert model is not None
    if model != state.policy.model_name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {state.policy.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return model


def input_rows(engine: EncoderEngine, reader: BodyReader, state: ModelService) -> list[list[int]]:
    """`input` as framed token-id rows within the model's limit, cut if `truncate_prompt_tokens` asks."""
    limit = engine.facts.max_tokens
    if state.policy.max_prompt_tokens is not None:
        limit = min(limit, state.policy.max_prompt_tokens)
    truncate = reader.integer("truncate_prompt_tokens", None, lo=-1, hi=limit)
    if truncate == 0:
        raise invalid_param("truncate_prompt_tokens", f"'truncate_prompt_tokens' must be -1 or between 1 and {limit}")
    return _rows(engine, reader.raw("input"), limit, limit if truncate == -1 else truncate)


async def run_rows(engine: EncoderEngine, rows: list[list[int]]) -> np.ndarray:
    """The rows through the engine's batcher: `[len(rows), dims]` (embeddings or label probabilities)."""
    try:
        return await asyncio.wrap_future(engine.embed(rows))
    except EngineOverloadedError as exc:
        raise from_engine_error(exc) from exc


def _rows(engine: EncoderEngine, value: Any, limit: int, truncate: int | None) -> list[list[int]]:
    """The request's inputs as framed token-id rows, each within `limit` (or cut to `truncate`)."""
    tokenizer = engine.tokenizer
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid_param("input", f"'input' must be a non-empty string or list, got {show(value)}")
    if len(value) > MAX_INPUTS:
        raise invalid_param("input", f"'input' holds {len(value)} items; at most {MAX_INPUTS} are allowed")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]  # one input given as token ids
    if all(isinstance(v, str) for v in value):
        empty = next((i for i, v in enumerate(value) if not v), None)
        if empty is not None:
            raise invalid_param(f"input[{empty}]", f"input[{empty}] is an empty string; every input needs text")
        rows = tokenizer.encode(value)
    elif all(isinstance(v, list) for v in value):
        rows = [tokenizer.frame(_token_ids(v, i, tokenizer.vocab_size)) for i, v in enumerate(value)]
    else:
        raise invalid_param(
            "input", "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    if truncate is not None:
        return [tokenizer.truncate(row, truncate) for row in rows]
    for i, row in enumerate(rows):
        if len(row) > limit:
            raise APIError(
                400,
                f"input[{i}] is {len(row)} tokens long; this model reads at most {limit} (special tokens included). "
                "Shorten it, or send 'truncate_prompt_tokens' (-1 cuts to the limit)",
                param="input",
                code="context_length_exceeded",
            )
    return rows


def _token_ids(value: list[Any], index: int, vocab_size: int) -> list[int]:
    if not value:
        raise invalid_param(f"input[{index}]", f"input[{index}] is an empty token list")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise invalid_param(
                f"input[{index}]", f"input[{index}] holds {show(token)}: token ids are integers in [0, {vocab_size})"
            )
    return value


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
