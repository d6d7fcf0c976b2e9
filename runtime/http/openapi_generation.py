"""OpenAPI pieces of the generating routes: `/v1/chat/completions` and `/v1/completions` (see openapi.py)."""

from __future__ import annotations

from runtime.adapters.layout import NAME
from runtime.api.protocol import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS, RequestPolicy
from runtime.http.openapi import RoutePiece, Schema, generation_operation, nullable, ref

_IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")


# Request pieces shared by chat and completions.
def _sampling_properties(policy: RequestPolicy, max_tokens_key: str) -> dict[str, Schema]:
    token_id = {"type": "integer", "minimum": 0, "maximum": policy.vocab_size - 1}
    stop_string = {"type": "string", "minLength": 1}
    return {
        "model": {
            "anyOf": [
                {"const": policy.model_name},
                {"type": "string", "pattern": f"^{_literal(policy.model_name)}:{NAME.pattern.removeprefix('^')}"},
            ],
            "description": f"{policy.model_name!r} (the base model) or '{policy.model_name}:ADAPTER', one of its "
            "LoRA adapters (GET /v1/models lists them; another is a 404)",
        },
        "stream": nullable({"type": "boolean"}),
        "stream_options": nullable(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {"include_usage": {"type": "boolean"}, "include_obfuscation": {"type": "boolean"}},
            }
        ),
        max_tokens_key: nullable({"type": "integer", "minimum": 1, "maximum": policy.max_tokens_limit}),
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "n": nullable({"type": "integer", "minimum": 1, "maximum": policy.max_n}),
        "stop": nullable(
            {"anyOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": policy.max_stop}]}
        ),
        "presence_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "logit_bias": nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                "description": f"token id (0 to {policy.vocab_size - 1}) → bias added to its logit",
            }
        ),
        "seed": nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
        # OpenAI fields with no effect here: any value is accepted and ignored.
        **{name: {"description": "accepted and ignored"} for name in _IGNORED},
        # vLLM's extensions, sent by the openai client through `extra_body`.
        "top_k": nullable({"type": "integer", "minimum": -1}),
        "min_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "repetition_penalty": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 10}),
        "ignore_eos": nullable({"type": "boolean"}),
        "stop_token_ids": nullable({"type": "array", "items": token_id}),
    }


def _literal(text: str) -> str:
    """`text` as a regex matching itself, escaping only what ECMA regexes (JSON Schema's) allow escaped."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}/" else c for c in text)


_USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
_FINISH = {"enum": ["stop", "length", "tool_calls", "abort", None]}


def _envelope(object_name: str, choice: Schema, *, usage_required: bool) -> Schema:
    required = ["id", "object", "created", "model", "choices", *(["usage"] if usage_required else [])]
    return {
        "type": "object",
        "required": required,
        "properties": {
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": ref("Usage") if usage_required else nullable(ref("Usage")),
        },
    }


# Chat completions.
_TEXT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "additionalProperties": False,
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_TOOL_CALL: Schema = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
_FUNCTION_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
_JSON_SCHEMA = {"type": "object", "description": "a JSON Schema"}


def _chat_schemas(policy: RequestPolicy) -> dict[str, Schema]:
    # Sizes in bytes of the field's JSON (a string's UTF-8), which no JSON Schema keyword can say.
    sized = f"at most {policy.max_grammar_bytes} bytes"
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART, "minItems": 1}]}
    message = {
        "type": "object",
        "required": ["role"],
        "additionalProperties": False,
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": nullable(content),
            "name": nullable({"type": "string"}),
            "tool_calls": nullable({"type": "array", "items": _TOOL_CALL}),
            "tool_call_id": nullable({"type": "string"}),
        },
    }
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": _FUNCTION_NAME,
                    "description": nullable({"type": "string"}),
                    "parameters": nullable(_JSON_SCHEMA),
                    "strict": nullable({"type": "boolean"}),
                },
            },
        },
    }
    named_choice = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": _FUNCTION_NAME}},
        },
    }
    response_format = {
        "type": "object",
        "required": ["type"],
        "additionalProperties": False,
        "description": f"its `json_schema`, `regex` or `grammar` {sized}",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema", "regex", "grammar"]},
            "json_schema": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "schema": _JSON_SCHEMA,
                    "strict": nullable({"type": "boolean"}),
                },
            },
            "regex": {"type": "string"},
            "grammar": {"type": "string", "description": "Lark or GBNF"},
        },
    }
    request = {
        "type": "object",
        "required": ["model", "messages"],
        "additionalProperties": False,
        "properties": {
            **_sampling_properties(policy, "max_tokens"),
            "max_completion_tokens": nullable({"type": "integer", "minimum": 1, "maximum": policy.max_tokens_limit}),
            "messages": {"type": "array", "items": ref("ChatMessage"), "minItems": 1},
            "logprobs": nullable({"type": "boolean"}),
            "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
            "response_format": nullable(response_format),
            "tools": nullable(
                {
                    "type": "array",
                    "items": tool,
                    "maxItems": policy.max_tools,
                    "description": f"`parameters` schemas together at most {policy.max_tool_schema_bytes} bytes",
                }
            ),
            "tool_choice": nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named_choice]}),
            "parallel_tool_calls": nullable({"type": "boolean"}),
            "guided_json": nullable({**_JSON_SCHEMA, "description": f"a JSON Schema, {sized}"}),
            "guided_regex": nullable({"type": "string", "description": sized}),
            "guided_grammar": nullable({"type": "string", "description": f"Lark or GBNF, {sized}"}),
            "guided_choice": nullable(
                {"type": "array", "items": {"type": "string"}, "minItems": 1, "description": sized}
            ),
            # Accepted only in their "off" spelling: the server answers anything else with 400.
            "functions": nullable({"type": "array", "maxItems": 0}),
            "function_call": nullable({"enum": ["none", "auto"]}),
            "modalities": nullable({"type": "array", "items": {"const": "text"}}),
        },
    }
    logprob = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": {"type": "integer"}},
            "top_logprobs": {"type": "array"},
        },
    }
    choice_logprobs = nullable({"type": "object", "properties": {"content": {"type": "array", "items": logprob}}})
    reply = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"]},
            "tool_calls": {"type": "array", "items": _TOOL_CALL},
        },
    }
    choice = {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": reply,
            "logprobs": choice_logprobs,
            "finish_reason": _FINISH,
        },
    }
    delta_choice = {
        "type": "object",
        "required": ["index", "delta", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "delta": {"type": "object"},
            "logprobs": choice_logprobs,
            "finish_reason": _FINISH,
        },
    }
    return {
        "ChatMessage": message,
        "ChatCompletionRequest": request,
        "ChatCompletion": _envelope("chat.completion", choice, usage_required=True),
        "ChatCompletionChunk": _envelope("chat.completion.chunk", delta_choice, usage_required=False),
        "Usage": _USAGE,
    }


def chat_piece(policy: RequestPolicy) -> RoutePiece:
    operation = generation_operation(
        "Create a chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
    )
    return RoutePiece({"/v1/chat/completions": {"post": operation}}, _chat_schemas(policy))


# Completions.
def _completion_schemas(policy: RequestPolicy) -> dict[str, Schema]:
    token_ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": policy.vocab_size - 1},
        "minItems": 1,
    }
    text = {"type": "string", "minLength": 1}
    prompt = {
        "anyOf": [
            text,
            token_ids,
            {"type": "array", "items": {"anyOf": [text, token_ids]}, "minItems": 1, "maxItems": policy.max_prompts},
        ]
    }
    request = {
        "type": "object",
        "required": ["model", "prompt"],
        "additionalProperties": False,
        "properties": {
            **_sampling_properties(policy, "max_tokens"),
            "prompt": prompt,
            "echo": nullable({"type": "boolean"}),
            "logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}),
            "suffix": nullable({"const": ""}),
            "best_of": nullable({"type": "integer", "minimum": 1, "maximum": policy.max_n}),
        },
    }
    choice = {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "text": {"type": "string"},
            "logprobs": nullable({"type": "object"}),
            "finish_reason": _FINISH,
        },
    }
    return {
        "CompletionRequest": request,
        "Completion": _envelope("text_completion", choice, usage_required=True),
        "CompletionChunk": _envelope("text_completion", choice, usage_required=False),
        "Usage": _USAGE,
    }


def completions_piece(policy: RequestPolicy) -> RoutePiece:
    operation = generation_operation("Create a completion", "CompletionRequest", "Completion", "CompletionChunk")
    return RoutePiece({"/v1/completions": {"post": operation}}, _completion_schemas(policy))
